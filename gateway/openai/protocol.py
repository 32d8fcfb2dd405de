"""The OpenAI wire format: request schemas and response builders, in one place.

Requests are parsed strictly: an unknown field is a 400 naming it, never silently dropped,
and fields that steer isolation (``rid``, ``extra_key``, ``cache_salt``, ``bootstrap_*``) are
refused outright because a client must never choose them. Responses are built as plain dicts
and serialised with orjson (the hot path does not need models for its own output); the
response models at the end describe exactly those dicts, for ``/openapi.json`` and for the
tests that hold each builder to its model.
"""

from __future__ import annotations

import json
import re
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, overload

import jsonschema_rs
import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
    with_config,
)
from pydantic_core import PydanticCustomError

# pydantic needs typing_extensions' TypedDict (a dependency of its own) before Python 3.12.
from typing_extensions import TypedDict

from gateway.common.errors import QUOTE_CHARS, APIError, bad_request, clipped, quoted
from gateway.openai.engine_bounds import FIELD_BOUNDS, LOGIT_BIAS_KEY, TOP_K_ALL
from gateway.openai.schema_shape import schema_shape_error
from gateway.tool_parsers import Function, call_schema

# Fields an engine (SGLang, or vLLM for the clients written for it) would honour if they
# reached it, which no client may send, even as null: each with why (the 400 says it). The
# other fields of both engines are declared on the request models below, honoured, ignored
# (``Ignored``) or refused for a reason (``_refused``); tests/engine_parity holds SGLang's
# request models to that, field by field.
_ISOLATION = "it steers isolation, which the gateway alone decides"
_GATEWAY_ROUTES = "the gateway routes each request to its prefill/decode pair itself"
_RUNS_CODE = "it would run the client's code inside the engine"
_ENGINE_STATE = "it keeps a request's state in the engine for later requests, outside isolation"
RESERVED_FIELDS: Mapping[str, str] = {
    "rid": _ISOLATION + " (the engine's request ID is the gateway's generation ID)",
    "request_id": _ISOLATION + " (the engine's request ID is the gateway's generation ID)",
    "extra_key": _ISOLATION + " (the prefix cache's key is the tenant's)",
    "cache_salt": _ISOLATION + " (the prefix cache's key is the tenant's)",
    "input_ids": _ISOLATION + " (the gateway tokenizes every prompt itself)",
    "sampling_params": _ISOLATION + " (give the sampling fields themselves)",
    "bootstrap_host": _GATEWAY_ROUTES,
    "bootstrap_port": _GATEWAY_ROUTES,
    "bootstrap_room": _GATEWAY_ROUTES,
    "routed_dp_rank": _GATEWAY_ROUTES,
    "disagg_prefill_dp_rank": _GATEWAY_ROUTES,
    "data_parallel_rank": _GATEWAY_ROUTES,
    "kv_transfer_params": _GATEWAY_ROUTES,
    "lora_path": "the model's policy decides the weights a tenant runs",
    "custom_logit_processor": _RUNS_CODE,
    "custom_params": _RUNS_CODE + " (they are a custom logit processor's parameters)",
    "logits_processors": _RUNS_CODE,
    "chat_template": "the model's own chat template renders every conversation (a client's "
    "template could make message text into control tokens)",
    "session_id": _ENGINE_STATE,
    "session_params": _ENGINE_STATE,
    "priority": "the gateway orders tenants by fair share; an engine priority would let one "
    "tenant's requests overtake the others'",
}
# Headers that steer isolation inside the engine; a client sending one is refused.
RESERVED_HEADER_PREFIXES = ("x-isolation-", "x-isogate-")

_LOGIT_BIAS_KEY = re.compile(LOGIT_BIAS_KEY)
# How much of a metaschema error (which may quote the schema) a 400 repeats.
SCHEMA_ERROR_CHARS = 200


# Upper bounds the gateway sets where OpenAI sets none: one request may not fan out without end.
# (The ranges of the fields that reach the engine are in ``engine_bounds.FIELD_BOUNDS``.)
MAX_PROMPTS = 64
MAX_MESSAGES = 4096
MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_TOOLS = 128
MAX_CHOICES = 256  # guided_choice's strings
MAX_TEMPLATE_KWARGS = 32


def _refuse(field: str, reason: str) -> PydanticCustomError:
    """A documented field (or value) that cannot be honoured here: a 400 that says why."""
    return PydanticCustomError(
        "unsupported_parameter",
        "'{param}' is not supported by this gateway: {reason}",
        {"param": field, "reason": reason},
    )


def _refused(reason: str, allowed: Callable[[Any], bool] = lambda value: value is None) -> Any:
    """A field validator for a documented field the gateway cannot honour: any value but the
    allowed ones (by default only null) is refused, saying why. As a field validator it runs
    only when the client sent the field, so the fields cost nothing when absent."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if not allowed(value):
            raise _refuse(str(info.field_name), reason)
        return value

    return AfterValidator(check)


def _only(default: Any, reason: str) -> Any:
    """``_refused`` for an engine's extension that clients send at its default: null or the
    default is accepted (it asks for nothing), any other value refused, saying why."""
    return _refused(reason, lambda value: value is None or value == default)


@dataclass(frozen=True, slots=True)
class Ignored:
    """Marks a field that is accepted and has no effect here, with why (its annotation's
    metadata; ``IGNORED_FIELDS`` lists them, the docs and the conformance tests read it)."""

    reason: str


def ignored_fields(schema: type[BaseModel]) -> dict[str, str]:
    """The fields of ``schema`` accepted without effect, and why."""
    return {
        name: marker.reason
        for name, info in schema.model_fields.items()
        for marker in info.metadata
        if isinstance(marker, Ignored)
    }


# Why the engines' extensions that the gateway refuses are refused (beside RESERVED_FIELDS).
_ENGINE_INTERNALS = "the engine's internals (hidden states, experts, token ids, meta_info) are "
_NOT_RETURNED = _ENGINE_INTERNALS + "not passed on: they carry other requests' routing"
_TEXT_ONLY = "this model takes text only"
_NO_BEAM_SEARCH = "there is no beam search here (nor in SGLang's OpenAI server)"
_REGEX_IN_ENGINE = (
    "a stop regex runs in the engine's scheduler loop on every token, where a pathological "
    "pattern would stall every tenant's decoding; use stop strings"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events; none is sent
    # vLLM's and SGLang's: every chunk carries the choice's usage so far (guidellm reads it).
    continuous_usage_stats: bool | None = None


class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs 'json_schema'")
        return self


# The request's sampling fields and the names SGLang gives them.
_SAMPLING_FIELDS = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("min_tokens", "min_new_tokens"),
    ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"),
    ("ignore_eos", "ignore_eos"),
    ("skip_special_tokens", "skip_special_tokens"),
    ("no_stop_trim", "no_stop_trim"),
    ("include_stop_str_in_output", "no_stop_trim"),  # vLLM's name (they must agree)
    ("spaces_between_special_tokens", "spaces_between_special_tokens"),
    ("seed", "sampling_seed"),
)
_SAMPLING_FIELD_NAMES = frozenset(field for field, _ in _SAMPLING_FIELDS)
# The fields ``check_against`` bounds by the model.
_MODEL_BOUNDED_FIELDS = frozenset({"logit_bias", "stop_token_ids", "min_tokens"})


class _Request(_Strict):
    """The fields both generation routes share: OpenAI's, then SGLang's extensions.

    Every field OpenAI documents is here: honoured, or refused by a validator that says why.
    An explicit ``null`` means "not given", as in OpenAI's API.
    """

    # Every numeric field that reaches the engine is bounded by ``engine_bounds.FIELD_BOUNDS``.
    model: str = Field(min_length=1)
    max_tokens: int | None = FIELD_BOUNDS["max_tokens"].field()
    temperature: float | None = FIELD_BOUNDS["temperature"].field()
    top_p: float | None = FIELD_BOUNDS["top_p"].field()
    n: int | None = FIELD_BOUNDS["n"].field()
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = FIELD_BOUNDS["seed"].field()
    presence_penalty: float | None = FIELD_BOUNDS["presence_penalty"].field()
    frequency_penalty: float | None = FIELD_BOUNDS["frequency_penalty"].field()
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = Field(default=None, max_length=256)

    # SGLang's sampling extensions, as its OpenAI server takes them (clients: ``extra_body``).
    top_k: int | None = FIELD_BOUNDS["top_k"].field()
    min_p: float | None = FIELD_BOUNDS["min_p"].field()
    min_tokens: int | None = FIELD_BOUNDS["min_tokens"].field()
    repetition_penalty: float | None = FIELD_BOUNDS["repetition_penalty"].field()
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, FIELD_BOUNDS["stop_token_ids"].item()]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    ebnf: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    json_schema: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    # OpenAI's on chat; SGLang takes it on completions too.
    response_format: ResponseFormat | None = None

    # ---- SGLang's and vLLM's other extensions (issue 41) ---------------------------------
    # Honoured: vLLM's names for what SGLang does (the constraints through ``grammar``).
    include_stop_str_in_output: bool | None = None  # SGLang's no_stop_trim
    spaces_between_special_tokens: bool | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: (
        list[Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]] | None
    ) = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    # Accepted without effect.
    guided_decoding_backend: Annotated[
        str | None, Ignored("the operator's engine configuration picks its grammar backend")
    ] = Field(default=None, max_length=64)
    length_penalty: Annotated[
        float | None, Ignored("it weighs beam search's candidates; " + _NO_BEAM_SEARCH)
    ] = FIELD_BOUNDS["length_penalty"].field()
    custom_labels: Annotated[
        dict[str, str] | None,
        Ignored(
            "the engine's metric labels are the operator's; a tenant's traffic is "
            "labelled by the gateway's own metrics"
        ),
    ] = Field(default=None, max_length=16)
    # Refused at any value but their default, saying why.
    use_beam_search: Annotated[bool | None, _only(False, _NO_BEAM_SEARCH)] = None
    guided_whitespace_pattern: Annotated[
        str | None, _refused("the engine's JSON grammar decides the whitespace it allows")
    ] = None
    structured_outputs: Annotated[
        dict[str, Any] | None,
        _refused("give guided_json, guided_regex, guided_choice or guided_grammar instead"),
    ] = None
    truncate_prompt_tokens: Annotated[
        int | None, _refused("no prompt is truncated here: one too long is a 400 naming the limit")
    ] = None
    prompt_logprobs: Annotated[
        int | None, _refused("the prompt is scored by /v1/completions with echo and logprobs")
    ] = None
    allowed_token_ids: Annotated[
        list[int] | None, _refused("give logit_bias to favour or exclude tokens")
    ] = None
    bad_words: Annotated[list[str] | None, _refused("give logit_bias to exclude tokens")] = None
    stop_regex: Annotated[str | list[str] | None, _refused(_REGEX_IN_ENGINE)] = None
    watermark: Annotated[dict[str, Any] | None, _refused("there is no watermarking here")] = None
    return_tokens_as_token_ids: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    return_token_ids: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    return_hidden_states: Annotated[bool | Literal["last"] | None, _only(False, _NOT_RETURNED)] = (
        None
    )
    return_routed_experts: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    routed_experts_start_len: Annotated[int | None, _only(0, _NOT_RETURNED)] = None
    return_cached_tokens_details: Annotated[
        bool | None,
        _only(
            False,
            "usage.prompt_tokens_details.cached_tokens counts the cached tokens; "
            "the engine's breakdown by cache tier is not passed on",
        ),
    ] = None
    return_spec_tokens_details: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    images_config: Annotated[dict[str, Any] | None, _refused(_TEXT_ONLY)] = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, _refused(_TEXT_ONLY)] = None
    prompt_embeds: Annotated[Any, _refused("a prompt is text or token ids here")] = None
    vllm_xargs: Annotated[
        dict[str, Any] | None, _refused("vLLM's own extension arguments; the engine is SGLang")
    ] = None

    # The fields ``grammar`` reads: without any of them sent, there is no constraint.
    GRAMMAR_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {
            "regex",
            "ebnf",
            "json_schema",
            "response_format",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        }
    )

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return stop

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, top_k: int | None) -> int | None:
        if top_k is not None and not FIELD_BOUNDS["top_k"].accepts(top_k):
            raise ValueError(f"top_k must be -1 (no limit) or from 1 to {TOP_K_ALL}")
        return top_k

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        tokens, biases = FIELD_BOUNDS["logit_bias (token id)"], FIELD_BOUNDS["logit_bias (bias)"]
        for token, value in (bias or {}).items():
            if _LOGIT_BIAS_KEY.fullmatch(token) is None or not tokens.accepts(int(token)):
                raise ValueError(
                    f"logit_bias keys are token ids in ASCII digits (0 to {tokens.high}), "
                    f"got {quoted(token)}"
                )
            if not biases.accepts(value):
                raise ValueError(f"logit_bias values are in {biases.describe()}, got {value}")
        return bias

    @field_validator("json_schema")
    @classmethod
    def _json_schema_text(cls, text: str | None) -> str | None:
        if text is not None:
            check_json_schema(_schema_of_text(text, "json_schema"), "json_schema")
        return text

    @field_validator("guided_choice")
    @classmethod
    def _choices_bounded(cls, choices: list[str] | None) -> list[str] | None:
        if choices is not None and sum(map(len, choices)) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"at most {MAX_GRAMMAR_CHARS} characters in all")
        return choices

    @field_validator("guided_json")
    @classmethod
    def _guided_json(cls, schema: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(schema, str):
            if len(schema) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"at most {MAX_GRAMMAR_CHARS} characters")
            check_json_schema(_schema_of_text(schema, "guided_json"), "guided_json")
        elif schema is not None:
            check_json_schema(schema, "guided_json")
        return schema

    @field_validator("response_format")
    @classmethod
    def _response_schema(cls, format_: ResponseFormat | None) -> ResponseFormat | None:
        if format_ is not None and format_.json_schema and format_.json_schema.schema_ is not None:
            check_json_schema(format_.json_schema.schema_, "response_format.json_schema.schema")
        return format_

    @model_validator(mode="after")
    def _stop_trim_agrees(self) -> _Request:
        keep, trim = self.include_stop_str_in_output, self.no_stop_trim
        if keep is not None and trim is not None and keep != trim:
            raise _invalid(
                "include_stop_str_in_output",
                "include_stop_str_in_output (vLLM's name) and no_stop_trim (SGLang's) are one "
                "setting, and these disagree",
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def choices(self) -> int:
        return self.n or 1

    def constraints(self) -> list[tuple[str, str, str]]:
        """Every output constraint the request gives, as (its field, SGLang's sampling
        parameter, the value): SGLang's own fields, vLLM's ``guided_*`` mapped onto the same
        grammars, and ``response_format``'s JSON."""
        found: list[tuple[str, str, str]] = []
        if self.regex is not None:
            found.append(("regex", "regex", self.regex))
        if self.ebnf is not None:
            found.append(("ebnf", "ebnf", self.ebnf))
        if self.json_schema is not None:
            found.append(("json_schema", "json_schema", self.json_schema))
        guided_json = self.guided_json
        if guided_json is not None:
            text = guided_json if isinstance(guided_json, str) else orjson.dumps(guided_json)
            found.append(("guided_json", "json_schema", _text(text)))
        if self.guided_regex is not None:
            found.append(("guided_regex", "regex", self.guided_regex))
        if self.guided_choice is not None:
            found.append(("guided_choice", "ebnf", choice_grammar(self.guided_choice)))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", "ebnf", self.guided_grammar))
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            schema: Any = {"type": "object"}
            if response_format.json_schema is not None:
                schema = response_format.json_schema.schema_ or {"type": "object"}
            found.append(("response_format", "json_schema", orjson.dumps(schema).decode()))
        return found

    def grammar(self) -> dict[str, str]:
        """The one constraint SGLang is to decode under, as its sampling parameter (a 400
        where the request gives more than one)."""
        found = self.constraints()
        if len(found) > 1:
            raise bad_request(
                "Only one output constraint may be given; this request gives "
                + ", ".join(field for field, _, _ in found)
                + ".",
                code="invalid_value",
                param=found[0][0],
            )
        return {name: value for _, name, value in found}

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """SGLang's sampling parameters for this request (``max_new_tokens`` already decided)."""
        params: dict[str, Any] = {"max_new_tokens": max_tokens}
        # Every sampling field defaults to None, so only one the client sent can hold a value;
        # most requests send none, and the set test is one C call where the loop is fourteen
        # steps of the interpreter (and ``grammar`` a call and its reads).
        sent = self.model_fields_set
        if not _SAMPLING_FIELD_NAMES.isdisjoint(sent):
            values = self.__dict__
            for field, name in _SAMPLING_FIELDS:
                value = values[field]
                if value is not None:
                    params[name] = value
        if "logit_bias" in sent and self.logit_bias:
            params["logit_bias"] = self.logit_bias
        if self.GRAMMAR_FIELDS.isdisjoint(sent):
            return params
        grammar = self.grammar()
        if grammar and self.min_tokens is not None and self.min_tokens > 1:
            # A constraint decides where the output ends. Where it ends at the first token
            # (a one-token choice, "{}"), SGLang's PD decode still steps once with the end
            # masked by min_tokens: every token is then barred and it fails the request (500).
            raise bad_request(
                "min_tokens above 1 cannot be combined with an output constraint: the "
                "constraint decides where the output ends.",
                code="invalid_value",
                param="min_tokens",
            )
        params.update(grammar)
        return params

    def check_against(self, vocab_size: int, max_tokens: int) -> None:
        """What only the model can bound: token ids in the vocabulary, min_tokens under the
        completion's length (checked here, so the engine never refuses what was accepted)."""
        if _MODEL_BOUNDED_FIELDS.isdisjoint(self.model_fields_set):
            return  # none of them sent (most requests)
        for param, ids in (
            ("logit_bias", list(map(int, self.logit_bias or ()))),
            ("stop_token_ids", self.stop_token_ids or []),
        ):
            for token in ids:
                if not 0 <= token < vocab_size:
                    raise bad_request(
                        f"Token id {token} in '{param}' is outside the vocabulary "
                        f"(0..{vocab_size - 1}).",
                        code="invalid_value",
                        param=param,
                    )
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens is {self.min_tokens}, more than max_tokens ({max_tokens}).",
                code="invalid_value",
                param="min_tokens",
            )


def _schema_of_text(text: str, param: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{param} is not valid JSON: {exc}") from exc


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()


def choice_grammar(choices: list[str]) -> str:
    """vLLM's ``guided_choice`` as the EBNF grammar SGLang's backend takes: exactly one of the
    strings (each a JSON string literal, which the grammar's literals read alike)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def check_json_schema(schema: Any, param: str) -> None:
    """A schema the engine's grammar compiler can take: a JSON Schema object, checked against
    the metaschema, so that a bad one is a 400 here and not a failure inside the engine."""
    if not isinstance(schema, dict):
        raise PydanticCustomError(
            "invalid_field", "A JSON schema must be an object.", {"param": param}
        )
    # jsonschema-rs, not the pure-Python jsonschema: this runs on the event loop, which the
    # pure-Python check held for as long as a large schema took to walk.
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        # The message may quote the schema (the offending part of it): a prefix only.
        why = clipped(exc.message, SCHEMA_ERROR_CHARS)
        raise PydanticCustomError(
            "invalid_field", "Invalid JSON schema: {why}", {"param": param, "why": why}
        ) from exc
    except RecursionError as exc:  # parse_request bounds the depth first; this is the net
        raise PydanticCustomError(
            "invalid_field", "The JSON schema is nested too deeply.", {"param": param}
        ) from exc


class TextPart(_Strict):
    type: Literal["text"]
    text: str


ContentPart = Annotated["TextPart | RefusedPart", Field(discriminator="type")]


class RefusedPart(BaseModel):
    """Content parts this gateway's models cannot take (images, audio, files)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    type: Literal["image_url", "input_audio", "file", "refusal"]

    @model_validator(mode="after")
    def _refused(self) -> RefusedPart:
        raise _refuse(f"content part of type {self.type}", "this model takes text only")


class FunctionCallParam(_Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_GRAMMAR_CHARS)  # JSON text, as the model wrote it


class ToolCallParam(_Strict):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCallParam


_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            check_json_schema(parameters, "tools.function.parameters")
        return parameters


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Annotated[
        Literal["system", "developer", "user", "assistant", "tool", "function"],
        _refused("use role 'tool' for tool results", lambda role: role != "function"),
    ]
    # Null only on an assistant turn that made tool calls (checked below).
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    # Assistant messages: OpenAI's fields; a model without audio takes none.
    refusal: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(default=None, max_length=MAX_TOOLS)
    function_call: Annotated[
        dict[str, Any] | None, _refused("use tool_calls (function_call is deprecated)")
    ] = None
    audio: Annotated[dict[str, Any] | None, _refused("this model takes text only")] = None
    # Tool messages: the call they answer.
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        if "content" not in self.model_fields_set and not (
            self.role == "assistant" and self.tool_calls
        ):
            raise PydanticCustomError("missing", "Field required", {"param": "messages.content"})
        if self.tool_calls is not None and self.role != "assistant":
            raise _invalid("messages.tool_calls", "only an assistant message has tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise _invalid("messages.tool_call_id", "a tool message needs tool_call_id")
        if self.tool_call_id is not None and self.role != "tool":
            raise _invalid("messages.tool_call_id", "only a tool message has tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _invalid(
                "messages.content", "content may be null only with an assistant's tool_calls"
            )
        return self

    def text(self) -> str:
        content = self.content
        if isinstance(content, str):
            return content
        # As SGLang's chat path flattens text parts for string-content templates.
        return " ".join(part.text for part in content or () if isinstance(part, TextPart))

    def template_fields(self) -> dict[str, Any] | None:
        """The message's fields beyond role and content, as Hugging Face's
        ``apply_chat_template`` hands them to the template (None: there are none)."""
        fields: dict[str, Any] = {}
        if self.content is None:
            fields["content"] = None
        if self.tool_calls:
            fields["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            fields["name"] = self.name
        return fields or None


def _invalid(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_field", message + ".", {"param": param})


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = FIELD_BOUNDS["max_completion_tokens"].field()
    logprobs: bool | None = None
    top_logprobs: int | None = FIELD_BOUNDS["top_logprobs"].field()
    # Honoured as OpenAI defines them for a deployment that keeps nothing and has one tier.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: Annotated[
        bool | None,
        _refused("completions are not stored here (store must be false)", lambda v: not v),
    ] = None
    service_tier: Literal["auto", "default"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    modalities: Annotated[
        list[Literal["text", "audio"]] | None,
        _refused("this model produces text only", lambda v: v is None or "audio" not in v),
    ] = None
    # OpenAI fields this gateway cannot honour: any value but null is refused, saying why.
    verbosity: Annotated[
        Literal["low", "medium", "high"] | None, _refused("this model has no verbosity control")
    ] = None
    audio: Annotated[dict[str, Any] | None, _refused("this model produces text only")] = None
    prediction: Annotated[
        dict[str, Any] | None, _refused("predicted outputs are not supported")
    ] = None
    web_search_options: Annotated[
        dict[str, Any] | None, _refused("there is no web search here")
    ] = None
    moderation: Annotated[dict[str, Any] | None, _refused("there is no moderation model here")] = (
        None
    )
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Annotated[
        list[dict[str, Any]] | None, _refused("use tools (functions is deprecated)")
    ] = None
    function_call: Annotated[
        str | dict[str, Any] | None, _refused("use tool_choice (function_call is deprecated)")
    ] = None

    # ---- SGLang's and vLLM's chat extensions (issue 41) ----------------------------------
    # Honoured as SGLang honours them (``template_kwargs``, ``continuation``, the answers).
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, max_length=MAX_TEMPLATE_KWARGS
    )
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None  # vLLM's
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    # Accepted without effect.
    thinking: Annotated[
        dict[str, Any] | bool | None,
        Ignored(
            "SGLang gives it only to the chat encoders of model families that define a "
            "thinking mode of their own; chat templates take chat_template_kwargs"
        ),
    ] = None
    task: Annotated[
        str | None,
        Ignored("only DeepSeek-V4's chat encoder reads it; the models here use chat templates"),
    ] = Field(default=None, max_length=32)
    # Refused at any value but their default, saying why.
    add_special_tokens: Annotated[
        bool | None, _only(False, "the chat template places every special token")
    ] = None
    echo: Annotated[bool | None, _only(False, "a chat answer does not repeat the conversation")] = (
        None
    )
    documents: Annotated[list[dict[str, Any]] | None, _refused("put documents in the messages")] = (
        None
    )
    return_prompt_token_ids: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    return_meta_info: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    return_input_ids_in_sglext: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    return_output_ids_in_sglext: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    return_sampling_mask: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    sampling_logprobs_mode: Annotated[str | None, _refused(_NOT_RETURNED)] = None
    return_flat_raw_output_top_logprobs: Annotated[bool | None, _only(False, _NOT_RETURNED)] = None
    return_flat_raw_top_logprobs_b64: Annotated[bool | None, _only(True, _NOT_RETURNED)] = None
    max_dynamic_patch: Annotated[int | None, _refused(_TEXT_ONLY)] = None
    min_dynamic_patch: Annotated[int | None, _refused(_TEXT_ONLY)] = None
    use_audio_in_video: Annotated[bool | None, _only(False, _TEXT_ONLY)] = None
    video_config: Annotated[dict[str, Any] | None, _refused(_TEXT_ONLY)] = None

    GRAMMAR_FIELDS: ClassVar[frozenset[str]] = _Request.GRAMMAR_FIELDS | {
        "tool_choice",  # a forced call
    }

    def template_kwargs(self) -> dict[str, Any] | None:
        """What the chat template is given beside the messages and tools, as SGLang gives it:
        ``reasoning_effort``, then ``chat_template_kwargs`` over it; a reasoning effort turns
        thinking on (or off, with "none") unless the kwargs say otherwise. The tokenizer passes
        on only the variables the model's template reads (``tokenize.ModelTokenizer``)."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = self.reasoning_effort
        if effort is not None:
            kwargs.setdefault("thinking", effort != "none")
            kwargs.setdefault("enable_thinking", effort != "none")
            kwargs = {"reasoning_effort": effort, **kwargs}
        return kwargs or None

    def continuation(self) -> str | None:
        """With ``continue_final_message``, the final assistant message's text, which the
        answer continues (SGLang renders the conversation before it, with the generation
        prompt, then appends this text's tokens); None otherwise."""
        messages = self.messages
        if not self.continue_final_message or messages[-1].role != "assistant":
            return None
        return messages[-1].text()

    @model_validator(mode="after")
    def _tool_choice_of_tools(self) -> ChatCompletionRequest:
        tools, choice = self.tools or [], self.tool_choice
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise _invalid("tools", "function names in tools must be unique")
        if choice is not None and choice != "none" and not tools:
            raise _invalid("tool_choice", "tool_choice other than 'none' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _invalid(
                "tool_choice", f"tool_choice names '{choice.function.name}', which is not in tools"
            )
        return self

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        params = super().sampling_params(max_tokens)
        spaces = (self.chat_template_kwargs or {}).get("spaces_between_special_tokens")
        if isinstance(spaces, bool) and self.spaces_between_special_tokens is None:
            params["spaces_between_special_tokens"] = spaces  # where SGLang reads it
        if self.offered_tools and self.skip_special_tokens is None:
            # Some families' call markers are special tokens (Llama's <|python_tag|>); the
            # parser must see them, as SGLang's server keeps them whenever tools are offered.
            params["skip_special_tokens"] = False
        return params

    @property
    def offered_tools(self) -> list[ToolDefinition]:
        """The tools the model may call: none with ``tool_choice`` none; all of them otherwise
        (a named choice constrains the output, not the template, as in OpenAI's API)."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    @property
    def forced_tools(self) -> list[ToolDefinition] | None:
        """The functions constrained decoding must call one of (``required`` or named)."""
        choice = self.tool_choice
        if choice == "required":
            return list(self.tools or [])
        if isinstance(choice, NamedToolChoice):
            return [t for t in self.tools or [] if t.function.name == choice.function.name]
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise PydanticCustomError(
                "invalid_field", "top_logprobs needs logprobs: true.", {"param": "top_logprobs"}
            )
        return top

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def top_logprobs_num(self) -> int | None:
        """How many alternatives per token the engine returns; None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def grammar(self) -> dict[str, str]:
        forced = self.forced_tools
        if forced is None:
            return super().grammar()
        given = self.constraints()
        if given:
            raise bad_request(
                "tool_choice 'required' or a named function cannot be combined with another "
                f"output constraint ({', '.join(field for field, _, _ in given)}).",
                code="invalid_value",
                param="tool_choice",
            )
        functions = [Function(t.function.name, t.function.parameters or {}) for t in forced]
        try:
            calls = call_schema(functions, parallel=self.parallel_tool_calls is not False)
        except ValueError as exc:
            raise bad_request(str(exc) + ".", code="invalid_value", param="tools") from exc
        return {"json_schema": orjson.dumps(calls).decode()}


PromptList = list[str] | list[int] | list[list[int]]


class CompletionRequest(_Request):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with ``echo``: the prompt scored, nothing generated (what evaluation harnesses send);
    # the engine is still sent 1 (a PD pair always decodes one token).
    max_tokens: int | None = Field(default=None, ge=0, le=FIELD_BOUNDS["max_tokens"].high)
    echo: bool | None = None
    logprobs: int | None = FIELD_BOUNDS["logprobs"].field()
    best_of: int | None = FIELD_BOUNDS["best_of"].field()
    suffix: str | None = None
    add_special_tokens: Annotated[  # vLLM's
        bool | None,
        _only(
            True,
            "a prompt's text is encoded with the tokenizer's special tokens, as SGLang encodes "
            "it; send token ids for any other encoding",
        ),
    ] = None

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(isinstance(p, list) and not p for p in prompt):
                raise ValueError("a token-id prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _refused_fields(self) -> CompletionRequest:
        if self.suffix:
            raise _refuse("suffix", "this model has no fill-in-the-middle template")
        if self.echo and self.stream:
            raise _refuse("echo", "an echoed prompt is returned whole, not streamed, here")
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(
                "invalid_field", "max_tokens 0 needs echo: true.", {"param": "max_tokens"}
            )
        if self.best_of is not None:
            if self.best_of < self.choices:
                raise PydanticCustomError(
                    "invalid_field", "best_of must be at least n.", {"param": "best_of"}
                )
            if self.best_of > self.choices and self.stream:
                raise PydanticCustomError(
                    "invalid_field",
                    "best_of greater than n cannot be streamed.",
                    {"param": "best_of"},
                )
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def candidates(self) -> int:
        """How many completions are generated per prompt: ``best_of``, of which ``n`` are
        returned (the most likely per token)."""
        return self.best_of or self.choices  # ``_refused_fields`` refused a best_of under n

    @property
    def top_logprobs_num(self) -> int | None:
        best_of = self.best_of
        if best_of is not None and best_of > (self.n or 1):
            return self.logprobs or 0  # the ranking needs every token's log probability
        return self.logprobs

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own tokens are scored: ``echo`` with ``logprobs``."""
        return bool(self.echo) and self.logprobs is not None

    def prompts(self) -> list[str] | list[list[int]]:
        """Each prompt of the request, one choice (or ``n``) each."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]  # one token-id prompt
        return prompt  # strings, or token-id lists


_Request.model_rebuild()


def parse_request(body: bytes, schema: type[_Request]) -> Any:
    """Parse and validate a request body, or raise a 400 that names the offending field.

    orjson then ``model_validate`` on the dict: measured 1.5x faster than pydantic's own JSON
    parser on a 50 MB prompt, and validation of the parsed dict costs ~0.1 ms whatever its size.
    """
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(raw, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")
    check_counts(raw)
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


def check_counts(raw: dict[str, Any]) -> None:
    """The list bounds, checked before validation: validating a list item by item costs time
    in proportion to the list, so an over-long one is refused before any item is looked at."""
    messages = raw.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise too_many_messages()
    prompt = raw.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
        raise bad_request(
            f"Invalid value for 'prompt': at most {MAX_PROMPTS} prompts per request.",
            code="invalid_value",
            param="prompt",
        )
    check_schema_shapes(raw)


# ---- schema shapes (issue 40) -----------------------------------------------------------
# A schema's check costs by its shape, so the shape is bounded before any schema is checked.


def check_schema_shapes(
    raw: dict[str, Any],
    schemas_of: Callable[[dict[str, Any], Any], Iterator[tuple[str, Any]]] | None = None,
) -> None:
    """The request's JSON schemas together within ``schema_shape.SCHEMA_LIMITS``, or a 400
    naming the bound (before validation, which checks each against its metaschema).
    ``schemas_of`` finds them in a body of another shape than a chat or completion request's
    (the Responses API's)."""
    tools = raw.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise bad_request(
            f"Invalid value for 'tools': at most {MAX_TOOLS} tools per request.",
            code="invalid_value",
            param="tools",
        )
    error = schema_shape_error((schemas_of or _raw_schemas)(raw, tools))
    if error is not None:
        raise bad_request(
            f"Invalid value for '{error.param}': {error.message}",
            code="invalid_value",
            param=error.param,
        )


def _raw_schemas(raw: dict[str, Any], tools: Any) -> Iterator[tuple[str, Any]]:
    """Every JSON schema the request carries, where it is (wrong shapes are validation's)."""
    response_format = raw.get("response_format")
    if isinstance(response_format, dict):
        json_schema = response_format.get("json_schema")
        if isinstance(json_schema, dict):
            yield "response_format.json_schema.schema", json_schema.get("schema")
    for field in ("json_schema", "guided_json"):
        text = raw.get(field)
        if isinstance(text, str) and len(text) <= MAX_GRAMMAR_CHARS:
            try:
                yield field, orjson.loads(text)
            except orjson.JSONDecodeError:
                pass  # the field's validator refuses it
        elif isinstance(text, dict):
            yield field, text
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict):
            yield f"tools.{index}.function.parameters", function.get("parameters")


# ---- end of schema shapes -----------------------------------------------------------------


def too_many_messages() -> APIError:
    return bad_request(
        f"Invalid value for 'messages': at most {MAX_MESSAGES} messages per request.",
        code="invalid_value",
        param="messages",
    )


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    # A field refused for a reason says so, even where a union also reports other branches.
    error = next((e for e in errors if e["type"] == "unsupported_parameter"), errors[0])
    context = error.get("ctx") or {}
    # Where the error is: its location, or for a check of the whole request, the field named.
    # (A part may be a key the client wrote, of any length: a prefix of it.)
    location = ".".join(clipped(str(part), QUOTE_CHARS) for part in error["loc"])
    named = str(context["param"]) if "param" in context else None
    # A check across fields names the field at fault; otherwise the location says where.
    param = named if error["type"] == "invalid_field" else (location or named)
    kind = error["type"]
    if kind == "json_invalid":
        return bad_request(f"Request body is not valid JSON: {error['msg']}", code="invalid_json")
    if kind in ("model_type", "model_attributes_type") and not error["loc"]:
        return bad_request("Request body must be a JSON object.", code="invalid_json")
    if kind == "extra_forbidden":
        why = RESERVED_FIELDS.get(param) if param is not None else None
        if why is not None:
            return bad_request(
                f"'{param}' may not be supplied by a client: {why}.",
                code="reserved_parameter",
                param=param,
            )
        return bad_request(
            f"Unrecognized request argument supplied: {param}",
            code="unknown_parameter",
            param=param,
        )
    if kind == "unsupported_parameter":
        return bad_request(str(error["msg"]), code="unsupported_parameter", param=param)
    if kind == "invalid_field":  # a check across fields, naming the one at fault
        return bad_request(str(error["msg"]), code="invalid_value", param=param)
    if kind == "missing":
        return bad_request(
            f"Missing required parameter: '{param}'.",
            code="missing_required_parameter",
            param=param,
        )
    if param is None:
        return bad_request(f"Invalid request: {error['msg']}.", code="invalid_value")
    return bad_request(
        f"Invalid value for '{param}': {error['msg']}.", code="invalid_value", param=param
    )


def utf8_length(text: str) -> int:
    """UTF-8 byte length without encoding ASCII text (CPython knows a str is ASCII in O(1))."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


# ---- responses ------------------------------------------------------------------------

# "abort": the engine ended the generation early without an error (an operator's abort), as
# SGLang's own server reports it.
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(slots=True)
class TokenLogprob:
    """A completion token's log probability, its text as the gateway's tokenizer decodes it,
    and its most likely alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


class TokenLogprobs(Sequence[TokenLogprob]):
    """Tokens' log probabilities in flat columns: the tokens' texts and log probabilities, and
    all their alternatives' texts and log probabilities one token's after another. Read, it is
    a sequence of ``TokenLogprob``, each made when asked for; a slice is columns again.

    Why columns: a whole answer's log probabilities live until it is written. Held as an object
    per token, a list per token's alternatives and a tuple and a float per alternative, the
    largest answers a tenant may ask for (many choices, thousands of tokens, twenty
    alternatives each) were over a million objects: every full collection of the cyclic GC
    walked the tracked ones, the checking and writing of the answer set off many, and freeing
    them all when the answer had gone was one more long pause. Every other tenant waited. Here
    the floats are unboxed (``array``) and the texts are the tokenizer's own, shared: five
    containers per answer. (vLLM's FlatLogprobs, for the same reason.)
    """

    __slots__ = ("_top_ends", "logprobs", "tokens", "top_logprobs", "top_tokens")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.logprobs = array("d")
        self.top_tokens: list[str] = []
        self.top_logprobs = array("d")
        # Where each token's alternatives end in the two top columns.
        self._top_ends = array("q")

    @classmethod
    def of(cls, *runs: Iterable[TokenLogprob]) -> TokenLogprobs:
        """The entries of ``runs``, one after the other, as columns."""
        joined = cls()
        for run in runs:
            if isinstance(run, TokenLogprobs):
                joined.extend(run)
                continue
            for entry in run:
                joined.append(entry.token, entry.logprob, entry.top)
        return joined

    def append(self, token: str, logprob: float, top: Iterable[tuple[str, float]]) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        for text, alternative in top:
            self.top_tokens.append(text)
            self.top_logprobs.append(alternative)
        self._top_ends.append(len(self.top_tokens))

    def extend(self, other: TokenLogprobs) -> None:
        base = len(self.top_tokens)
        self.tokens += other.tokens
        self.logprobs += other.logprobs
        self.top_tokens += other.top_tokens
        self.top_logprobs += other.top_logprobs
        self._top_ends.extend([end + base for end in other._top_ends])

    def __len__(self) -> int:
        return len(self.tokens)

    @overload
    def __getitem__(self, index: int) -> TokenLogprob: ...

    @overload
    def __getitem__(self, index: slice) -> TokenLogprobs: ...

    def __getitem__(self, index: int | slice) -> TokenLogprob | TokenLogprobs:
        if isinstance(index, slice):
            positions = range(len(self))[index]
            if positions.step != 1 or not positions:
                return TokenLogprobs.of(map(self._entry, positions))
            return self._run(positions.start, positions.stop)
        position = range(len(self))[index]  # an IndexError as a list's, negatives counted back
        return self._entry(position)

    def __iter__(self) -> Iterator[TokenLogprob]:
        return map(self._entry, range(len(self)))

    def _run(self, start: int, stop: int) -> TokenLogprobs:
        """The columns of the tokens from ``start`` to ``stop``, copied as they are."""
        first = self._top_ends[start - 1] if start else 0
        last = self._top_ends[stop - 1]
        run = TokenLogprobs()
        run.tokens = self.tokens[start:stop]
        run.logprobs = self.logprobs[start:stop]
        run.top_tokens = self.top_tokens[first:last]
        run.top_logprobs = self.top_logprobs[first:last]
        run._top_ends = array("q", [end - first for end in self._top_ends[start:stop]])
        return run

    def _entry(self, position: int) -> TokenLogprob:
        start = self._top_ends[position - 1] if position else 0
        end = self._top_ends[position]
        top = list(zip(self.top_tokens[start:end], self.top_logprobs[start:end], strict=True))
        return TokenLogprob(self.tokens[position], self.logprobs[position], top)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __repr__(self) -> str:
        return f"TokenLogprobs({list(self)!r})"


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt's tokens scored (``echo``): the first token has no log probability, being
    conditioned on nothing; every later one is a ``TokenLogprob``."""

    first_token: str
    rest: Sequence[TokenLogprob]


def model_list(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": entries}


def model_card(
    name: str, created: int, max_context: int | None, bound: str | None
) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "isogate",
        # The effective maximum context as of now (live pools included), and what sets it.
        "max_context_tokens": max_context,
        "max_context_bound": bound,
    }


def now() -> int:
    return int(time.time())


# ---- response models -------------------------------------------------------------------
#
# The builders above return plain dicts, and the hot path never builds these models. They
# describe exactly what each builder returns, for the OpenAPI document (``gateway.api.openapi``)
# and for tests that validate every builder's output with them (strict, no field missing or
# extra), so a change to one without the other fails a test. Docstrings become the
# document's descriptions; the comment above each model names its builder.


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(ge=0)


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = Field(ge=0)


# usage()
class Usage(_Response):
    """Tokens of one request: the prompt's (of them, those found in the prefix cache) and the
    completion's."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class TopLogprob(_Response):
    token: str
    logprob: float = Field(le=0)
    bytes: list[int]


class ChatTokenLogprob(_Response):
    token: str
    logprob: float = Field(le=0)
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    """A choice's log probabilities, one entry per completion token (chat_logprobs())."""

    content: list[ChatTokenLogprob]
    refusal: None


class CompletionLogprobs(_Response):
    """The legacy completions format of log probabilities (completion_logprobs())."""

    tokens: list[str]
    # None for an echoed prompt's first token, which is conditioned on nothing.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCallOut(_Response):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCallOut(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"]
    content: str | None = Field(description="Null when the turn only calls tools.")
    reasoning_content: str | None = Field(
        default=None, description="The thinking part, for a model with a reasoning parser."
    )
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(_Response):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


# chat_completion()
class ChatCompletion(_Response):
    """The answer to a chat completion request without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: Annotated[list[ChatCompletionChoice], Field(min_length=1)]
    usage: Usage


class CompletionChoice(_Response):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


# completion()
class Completion(_Response):
    """The answer to a completion request without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: Annotated[list[CompletionChoice], Field(min_length=1)]
    usage: Usage


@with_config(ConfigDict(extra="forbid", strict=True))
class FunctionDelta(TypedDict, total=False):
    name: str
    arguments: str


@with_config(ConfigDict(extra="forbid", strict=True))
class ToolCallDelta(TypedDict, total=False):
    """A streamed call: ``index`` always; ``id``, ``type`` and the name in its first delta, then
    its arguments."""

    index: int
    id: str
    type: Literal["function"]
    function: FunctionDelta


@with_config(ConfigDict(extra="forbid", strict=True))
class ChatDelta(TypedDict, total=False):
    """What a chat chunk adds: the role (the first chunk, with empty content), text, or nothing
    (the last chunk, which carries the finish reason). A key is there or absent, never null."""

    role: Literal["assistant"]
    content: str
    reasoning_content: str
    tool_calls: list[ToolCallDelta]


class ChatChunkChoice(_Response):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None  # only on the last chunk


# chat_chunk()
class ChatCompletionChunk(_Response):
    """One event of a chat completion stream."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: Annotated[list[ChatChunkChoice], Field(min_length=1, max_length=1)]
    usage: Usage | None = Field(
        default=None,
        description="With stream_options.continuous_usage_stats: the choice's tokens so far.",
    )


class CompletionChunkChoice(_Response):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None  # only on the last chunk


# completion_chunk()
class CompletionChunk(_Response):
    """One event of a completion stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: Annotated[list[CompletionChunkChoice], Field(min_length=1, max_length=1)]
    usage: Usage | None = Field(
        default=None,
        description="With stream_options.continuous_usage_stats: the choice's tokens so far.",
    )


# usage_chunk()
class UsageChunk(_Response):
    """The last event before ``[DONE]`` of a stream with ``stream_options.include_usage``."""

    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: tuple[()]
    usage: Usage


# model_card()
class ModelCard(_Response):
    """One model, with its effective context as of now."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: Literal["isogate"]
    max_context_tokens: int | None = Field(
        description="The largest prompt plus completion admitted now (live pools included); "
        "null when no worker pair is available."
    )
    max_context_bound: str | None = Field(description="What sets max_context_tokens.")


# model_list()
class ModelList(_Response):
    """Every model the gateway serves."""

    object: Literal["list"]
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str = Field(min_length=1)
    type: str = Field(min_length=1)
    param: str | None
    code: str | None


# gateway.common.errors.APIError.body()
class ErrorResponse(_Response):
    """Every failure the gateway answers, in the OpenAI error format."""

    error: ErrorInfo
