"""``/v1/tokenize`` and ``/v1/detokenize``: the model's own tokenizer, for tenants.

The bodies are SGLang's (``sglang.srt.entrypoints.openai.protocol.TokenizeRequest`` and
``DetokenizeRequest``: ``prompt`` as a string or a list of strings, or chat ``messages``;
``add_special_tokens``; ``tokens`` and ``skip_special_tokens``), and so are the answers
(``tokens``, ``count``, ``max_model_len``; ``text``). Tokenize adds what only the gateway
knows: the largest prompt that the worker pairs this tenant may use admit *now* for the given
``max_tokens`` (1 when absent, as ``/v1/models`` computes its cards), what sets that limit, and
whether the prompt fits under it, so a client can learn whether a prompt fits before sending it.

Counting is a generation's own: a chat prompt is the ``ChatPrompt`` of the same messages,
rendered with the chat template and encoded by ``ModelTokenizer.encode_chat``; a text prompt is
a ``TextPrompt`` encoded by ``encode_text``; long texts are encoded off the event loop there.
So ``count`` for some messages is the ``prompt_tokens`` a chat completion of them reports, and
``fits`` is what gate 1 would decide (``gateway.core.admission.refuse_if_over``) on the limits as of
now. ``fits`` does not promise that a pair has room at this instant: a request that fits may
still wait on a busy pool (503 ``capacity_busy``).

Each call is a tenant's request like a generation: it counts against the tenant's requests per
minute as soon as its key is known, before its body is read (429 while none are left), and its
tokens against its tokens per minute (the least its text could hold before tokenizing, with a
concurrency slot; the count once known), with OpenAI's rate-limit headers on the answer.

What one request may cost is bounded, and refused before any tokenizing: the body by
``max_body_bytes`` (413, as a generation's); a list by ``protocol.MAX_PROMPTS`` prompts or
``protocol.MAX_MESSAGES`` messages (400); a prompt whose UTF-8 length alone proves it longer than
the model's configured context (400 ``context_length_exceeded``: no generation could take it);
all the prompts of one request together by one context's worth of bytes, the context times
the longest token's bytes (413); a detokenize by a context's worth of ids (400). A large body
is parsed, and checked against these bounds, in the parsing process
(``gateway.server.intake``), so a refused one never reaches the event loop; long texts are
encoded, and long id lists checked and decoded, off the event loop, in one call per request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope

from gateway.api.pipeline import ClientHeaders, read_large_body
from gateway.common.errors import APIError, bad_request
from gateway.config.policies import ModelPolicy, Policies
from gateway.core.admission import PromptLimit
from gateway.core.generation import ChatPrompt
from gateway.core.held import Held
from gateway.openai import protocol
from gateway.openai.protocol import ChatMessage, utf8_length
from gateway.openai.tokenize import ChatTurn, ModelTokenizer
from gateway.server.http_server import header_pairs
from gateway.service.components import Components
from gateway.tenancy.limits import LimitLease, LimitScope, model_scopes

# At most this many prompts in one ``prompt`` list (each is a separate count, like SGLang's),
# and messages in ``messages``: a completion's and a chat's own bounds (``protocol.check_counts``
# refuses longer lists before validating an item).
MAX_PROMPTS = protocol.MAX_PROMPTS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_Texts = Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]


class TokenizeRequest(_Strict):
    """Text or chat messages to count with the model's own tokenizer; exactly one of
    ``prompt`` and ``messages``."""

    model: str = Field(min_length=1)
    prompt: str | _Texts | None = Field(
        default=None,
        description="A text, or a list of texts each counted on its own, encoded as a "
        "completion's prompt is.",
    )
    messages: (
        Annotated[list[ChatMessage], Field(min_length=1, max_length=protocol.MAX_MESSAGES)] | None
    ) = Field(
        default=None,
        description="Chat messages, rendered with the model's chat template and encoded as a "
        "chat completion's are.",
    )
    add_special_tokens: bool = Field(
        default=True,
        description="Whether to add the model's special tokens (e.g. BOS) to a prompt; "
        "messages are encoded as a chat completion encodes them (the template places them).",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="The completion to reserve room for in the limit (1 when absent).",
    )


class DetokenizeRequest(_Strict):
    """Token ids to turn back into text with the model's own tokenizer."""

    model: str = Field(min_length=1)
    tokens: list[int] | list[list[int]] = Field(
        description="Token ids, or a list of lists of them, each decoded on its own."
    )
    skip_special_tokens: bool = Field(
        default=True, description="Whether to leave special tokens (e.g. BOS, EOS) out."
    )


# tokenize()
class TokenizeResponse(_Strict):
    """The prompt's tokens and, as of now, whether the model admits it for this tenant."""

    tokens: list[int] | list[list[int]] = Field(
        description="The token ids (a list of them per prompt when ``prompt`` was a list)."
    )
    count: int | list[int] = Field(description="How many tokens (per prompt for a list).")
    max_model_len: int = Field(
        description="The model's configured maximum context (its policy's max_context_tokens)."
    )
    max_prompt_tokens: int | None = Field(
        description="The largest prompt any worker pair this tenant may use admits now, with "
        "max_tokens reserved; null when no pair is available now."
    )
    max_prompt_bound: str | None = Field(description="What sets max_prompt_tokens.")
    max_tokens: int = Field(description="The completion reserved in max_prompt_tokens.")
    fits: bool | list[bool] | None = Field(
        description="Whether count is within max_prompt_tokens (per prompt for a list); null "
        "when no pair is available now."
    )


# detokenize()
class DetokenizeResponse(_Strict):
    """The text of the token ids."""

    text: str | list[str] = Field(description="The text (a text per list for a list of lists).")


# ---- the bounds -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelBounds:
    """What one request for a model may hold; picklable, so that a large body is checked
    where it is parsed (``gateway.server.intake``)."""

    max_context_tokens: int
    max_token_bytes: int  # the longest token of the vocabulary, in UTF-8 bytes

    @property
    def text_bytes(self) -> int:
        """The most bytes of text one request may hold together: what one context could hold
        were every token the longest."""
        return self.max_context_tokens * self.max_token_bytes

    def min_tokens(self, utf8_bytes: int) -> int:
        """The fewest tokens this many bytes can be (``ModelTokenizer.min_tokens_for_bytes``)."""
        return -(-utf8_bytes // self.max_token_bytes)


def bounds_of(
    policies: Policies, tokenizers: Mapping[str, ModelTokenizer]
) -> dict[str, ModelBounds]:
    bounds = {
        name: ModelBounds(model.max_context_tokens, tokenizers[name].max_token_bytes)
        for name, model in policies.models.items()
    }
    # An alias is bounded as its model (a name not here is left to the handler's 404).
    bounds.update({alias: bounds[target] for alias, target in policies.aliases.items()})
    return bounds


def check_tokenize(bounds: Mapping[str, ModelBounds], ask: TokenizeRequest) -> None:
    """The bounds of a tokenize request that need no tokenizer (the module doc); an unknown
    model is left to the handler's 404."""
    model = bounds.get(ask.model)
    if model is None:
        return
    if ask.messages is not None:
        # A chat prompt's bytes, as ``ChatPrompt.utf8_bytes`` counts them.
        sizes, param = [sum(utf8_length(m.text()) for m in ask.messages)], "messages"
    elif ask.prompt is not None:
        texts = [ask.prompt] if isinstance(ask.prompt, str) else ask.prompt
        sizes, param = [utf8_length(text) for text in texts], "prompt"
    else:
        return
    for size in sizes:
        at_least = model.min_tokens(size)
        if at_least > model.max_context_tokens:
            raise _never_fits(at_least, model.max_context_tokens, param)
    total = sum(sizes)
    if total > model.text_bytes:
        raise APIError(
            413,
            f"The {param} hold {total} bytes of text together; one tokenize request may hold "
            f"at most {model.text_bytes} (this model's max_context_tokens "
            f"{model.max_context_tokens} times its longest token's {model.max_token_bytes} "
            "bytes: what one context could hold). Split it into several requests.",
            "invalid_request_error",
            "request_too_large",
            param,
        )


def check_detokenize(bounds: Mapping[str, ModelBounds], ask: DetokenizeRequest) -> None:
    """A detokenize request holds at most a context's worth of ids: what a generation can take
    or give (an unknown model is left to the handler's 404)."""
    model = bounds.get(ask.model)
    if model is None:
        return
    lists = ask.tokens if ask.tokens and isinstance(ask.tokens[0], list) else None
    total = sum(map(len, lists)) if lists is not None else len(ask.tokens)
    if total > model.max_context_tokens:
        raise bad_request(
            f"'tokens' holds {total} ids; at most {model.max_context_tokens} (this model's "
            "max_context_tokens) are decoded in one request.",
            code="invalid_value",
            param="tokens",
        )


def _never_fits(at_least: int, context: int, param: str) -> APIError:
    return bad_request(
        f"This prompt has at least {at_least} tokens, more than this model's maximum "
        f"context ({context}): it can never be admitted, and is not tokenized.",
        code="context_length_exceeded",
        param=param,
    )


# ---- the routes ------------------------------------------------------------------------------

Endpoint = Literal["tokenize", "detokenize"]
# Answers with at least this many tokens are written as JSON off the event loop.
_JSON_IN_THREAD_MIN_TOKENS = 65_536


async def serve(
    components: Components, scope: Scope, receive: Receive, endpoint: Endpoint
) -> Response:
    """One call, metered as a tenant's request (the module doc): the key, the request counted,
    the body read and parsed (off the loop when large) and checked against the bounds, the
    tokens charged, then the answer with the rate-limit headers. Whatever happens, the
    concurrency slot is given back as the call ends."""
    held = Held()
    try:
        headers = ClientHeaders.of(scope)
        client = scope.get("client")  # behind a trusted proxy, the client it forwards
        principal = await components.unauthenticated.authenticate(
            components.authenticator, headers.authorization, client[0] if client else ""
        )
        if principal.is_admin:
            # The limits these routes answer and charge are a tenant's.
            raise APIError(
                403,
                "The admin key cannot use this endpoint; use a tenant key.",
                "permission_error",
                "admin_key_not_allowed",
            )
        # Policies and tokenizers are replaced together on reload: both taken before any wait.
        policies, tokenizers = components.policies, components.tokenizers
        tenant_id = principal.tenant_id
        lease = await components.core.enter(tenant_id, policies.tenant(tenant_id).limits, held)
        settings = components.settings
        body = await read_large_body(
            scope,
            receive,
            headers.content_length,
            settings.max_body_bytes,
            settings.body_timeout_s,
            components.parser,
        )
        bounds = bounds_of(policies, tokenizers)
        if endpoint == "tokenize":
            ask = await components.parser.parse(
                body, TokenizeRequest, functools.partial(check_tokenize, bounds)
            )
            answer, tokens = await tokenize(
                components,
                tenant_id,
                ask,
                lease=lease,
                policies=policies,
                tokenizers=tokenizers,
                key_models=principal.models,
            )
        else:
            asked = await components.parser.parse(
                body, DetokenizeRequest, functools.partial(check_detokenize, bounds)
            )
            answer, tokens = await detokenize(
                components,
                tenant_id,
                asked,
                lease=lease,
                policies=policies,
                tokenizers=tokenizers,
                key_models=principal.models,
            )
        if tokens >= _JSON_IN_THREAD_MIN_TOKENS:
            payload = await asyncio.to_thread(orjson.dumps, answer)
        else:
            payload = orjson.dumps(answer)
        response = Response(payload, media_type="application/json")
        response.raw_headers.extend(header_pairs(lease.header_lines()))
        return response
    except APIError as error:
        return error.response()
    except ClientDisconnect:
        return APIError(
            499, "The client went away.", "invalid_request_error", "client_cancelled"
        ).response()
    finally:
        await held.aclose()


# ---- the answers ---------------------------------------------------------------------------


async def tokenize(
    components: Components,
    tenant_id: str,
    ask: TokenizeRequest,
    *,
    lease: LimitLease | None = None,
    policies: Policies | None = None,
    tokenizers: Mapping[str, ModelTokenizer] | None = None,
    key_models: tuple[str, ...] | None = None,
) -> tuple[dict[str, Any], int]:
    """The answer, and how many tokens it holds (charged to ``lease`` where there is one:
    the fewest the text can be before tokenizing, the count after)."""
    policies = policies or components.policies
    tokenizers = tokenizers or components.tokenizers
    model = policies.resolve_model(tenant_id, ask.model, key_models)
    tokenizer = tokenizers[model.name]
    max_tokens = ask.max_tokens if ask.max_tokens is not None else 1
    if max_tokens > model.max_output_tokens:
        raise bad_request(
            f"max_tokens is {max_tokens}; this model allows at most {model.max_output_tokens}.",
            code="invalid_value",
            param="max_tokens",
        )
    if (ask.prompt is None) == (ask.messages is None):
        if ask.prompt is None:
            raise bad_request(
                "Missing required parameter: 'prompt' (or 'messages').",
                code="missing_required_parameter",
                param="prompt",
            )
        raise bad_request(
            "Give one of 'prompt' and 'messages', not both.", code="invalid_value", param="prompt"
        )
    # The bounds: checked where the body was parsed already; again here for a caller that
    # parsed it itself (cheap: a length per prompt).
    bound = ModelBounds(model.max_context_tokens, tokenizer.max_token_bytes)
    check_tokenize({ask.model: bound}, ask)
    scopes = model_scopes(policies, tenant_id, model)

    if ask.messages is not None:
        # What ``gateway.api.pipeline`` asks the core for: the same turns, the same template.
        chat = ChatPrompt([ChatTurn(m.role, m.text(), m.template_fields()) for m in ask.messages])
        await _charge_before(lease, bound.min_tokens(chat.utf8_bytes()), scopes)
        tokens: list[int] | list[list[int]] = await tokenizer.encode_chat(
            chat.turns, control_text=model.chat_control_text
        )
        counts: list[int] = [len(tokens)]
    else:
        texts = [ask.prompt] if isinstance(ask.prompt, str) else list(ask.prompt or [])
        at_least = sum(bound.min_tokens(utf8_length(t)) for t in texts)
        await _charge_before(lease, at_least, scopes)
        encoded = await tokenizer.encode_texts(
            texts,
            add_special_tokens=ask.add_special_tokens,
            control_text=model.prompt_control_text,
        )
        counts = [len(ids) for ids in encoded]
        tokens = encoded[0] if isinstance(ask.prompt, str) else encoded
    total = sum(counts)
    await _charge_after(lease, total)

    limit = _limit_now(components, policies, model, tenant_id, max_tokens)
    # Gate 1's rule (``refuse_if_over``): a prompt over the largest limit fits nowhere.
    fits = None if limit is None else [count <= limit.tokens for count in counts]
    single = isinstance(ask.prompt, str) or ask.messages is not None
    answer = {
        "tokens": tokens,
        "count": counts[0] if single else counts,
        "max_model_len": model.max_context_tokens,
        "max_prompt_tokens": limit.tokens if limit else None,
        "max_prompt_bound": limit.bound if limit else None,
        "max_tokens": max_tokens,
        "fits": fits[0] if (fits is not None and single) else fits,
    }
    return answer, total


async def detokenize(
    components: Components,
    tenant_id: str,
    ask: DetokenizeRequest,
    *,
    lease: LimitLease | None = None,
    policies: Policies | None = None,
    tokenizers: Mapping[str, ModelTokenizer] | None = None,
    key_models: tuple[str, ...] | None = None,
) -> tuple[dict[str, Any], int]:
    """The answer, and how many ids it decoded (charged to ``lease`` where there is one)."""
    policies = policies or components.policies
    tokenizers = tokenizers or components.tokenizers
    model = policies.resolve_model(tenant_id, ask.model, key_models)
    tokenizer = tokenizers[model.name]
    bound = ModelBounds(model.max_context_tokens, tokenizer.max_token_bytes)
    check_detokenize({ask.model: bound}, ask)
    # Validated strictly as one arm of the union or the other: the first item says which.
    lists = ask.tokens if ask.tokens and isinstance(ask.tokens[0], list) else None
    total = sum(map(len, lists)) if lists is not None else len(ask.tokens)
    await _charge_before(lease, total, model_scopes(policies, tenant_id, model))
    texts = await tokenizer.decode_lists(
        lists if lists is not None else [cast(list[int], ask.tokens)],
        skip_special_tokens=ask.skip_special_tokens,
    )
    await _charge_after(lease, total)
    return {"text": texts if lists is not None else texts[0]}, total


async def _charge_before(
    lease: LimitLease | None, at_least: int, scopes: tuple[LimitScope, ...] = ()
) -> None:
    """A concurrency slot and the fewest tokens the request can come to, before the work: 429
    if the tenant has either no more (its requests were counted at entry), or the model's
    limits (``scopes``) have not."""
    if lease is not None:
        await lease.reserve(at_least, scopes)


async def _charge_after(lease: LimitLease | None, tokens: int) -> None:
    """The tokens the request came to, charged (the bucket may go into debt, as a generation's
    overshoot does); the remaining tokens the answer reports, as of this charge."""
    if lease is None:
        return
    overshoot = tokens - lease.reserved_tokens
    await lease.settle(tokens)
    if lease.left is not None:
        lease.left.tokens -= overshoot


def _limit_now(
    components: Components, policies: Policies, model: ModelPolicy, tenant_id: str, max_tokens: int
) -> PromptLimit | None:
    """The largest prompt any candidate pair admits now (what admission computes); None when
    this tenant has no pair now (no pool serves it, or none is fresh): ``/v1/models`` says so
    with nulls too, rather than guessing."""
    try:
        candidates = components.routes.candidates(policies, model, tenant_id)
    except APIError:
        return None
    return candidates.best_limit(max_tokens, components.settings.admission_safety_margin_tokens)
