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

What one request may cost is bounded: the body by ``max_body_bytes`` (413, as a generation's);
a prompt whose UTF-8 length alone proves it longer than the model's configured context is
refused (400 ``context_length_exceeded``) without tokenizing, since no generation could take it;
long texts are encoded, and long id lists decoded, off the event loop; a detokenize request
carries at most a context's worth of ids.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, cast

from pydantic import BaseModel, ConfigDict, Field

from gateway.common.errors import APIError, bad_request, not_found
from gateway.config.policies import ModelPolicy, Policies
from gateway.core.admission import PromptLimit
from gateway.core.generation import ChatPrompt, TextPrompt
from gateway.openai.protocol import ChatMessage
from gateway.openai.tokenize import ChatTurn, ModelTokenizer
from gateway.service.components import Components

# At most this many prompts in one ``prompt`` list (each is a separate count, like SGLang's).
MAX_PROMPTS = 1024


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
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = Field(
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


# ---- the answers ---------------------------------------------------------------------------


async def tokenize(components: Components, tenant_id: str, ask: TokenizeRequest) -> dict[str, Any]:
    # Policies and tokenizers are replaced together on reload: take both before any wait.
    policies, tokenizers = components.policies, components.tokenizers
    model = model_named(policies, ask.model)
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

    if ask.messages is not None:
        # What ``gateway.api.pipeline`` asks the core for: the same turns, the same template.
        chat = ChatPrompt([ChatTurn(m.role, m.text(), m.template_fields()) for m in ask.messages])
        _refuse_if_never_fits(tokenizer, model, chat, "messages")
        tokens: list[int] | list[list[int]] = await tokenizer.encode_chat(
            chat.turns, control_text=model.chat_control_text
        )
        counts: list[int] = [len(tokens)]
    else:
        texts = [ask.prompt] if isinstance(ask.prompt, str) else list(ask.prompt or [])
        prompts = [TextPrompt(text) for text in texts]
        for prompt in prompts:
            _refuse_if_never_fits(tokenizer, model, prompt, "prompt")
        encoded = await asyncio.gather(
            *(
                tokenizer.encode_text(
                    p.text,
                    add_special_tokens=ask.add_special_tokens,
                    control_text=model.prompt_control_text,
                )
                for p in prompts
            )
        )
        counts = [len(ids) for ids in encoded]
        tokens = encoded[0] if isinstance(ask.prompt, str) else list(encoded)

    limit = _limit_now(components, policies, model, tenant_id, max_tokens)
    # Gate 1's rule (``refuse_if_over``): a prompt over the largest limit fits nowhere.
    fits = None if limit is None else [count <= limit.tokens for count in counts]
    single = isinstance(ask.prompt, str) or ask.messages is not None
    return {
        "tokens": tokens,
        "count": counts[0] if single else counts,
        "max_model_len": model.max_context_tokens,
        "max_prompt_tokens": limit.tokens if limit else None,
        "max_prompt_bound": limit.bound if limit else None,
        "max_tokens": max_tokens,
        "fits": fits[0] if (fits is not None and single) else fits,
    }


async def detokenize(components: Components, ask: DetokenizeRequest) -> dict[str, Any]:
    policies, tokenizers = components.policies, components.tokenizers
    model = model_named(policies, ask.model)
    tokenizer = tokenizers[model.name]
    skip = ask.skip_special_tokens
    # Validated strictly as one arm of the union or the other: the first item says which.
    lists = ask.tokens if ask.tokens and isinstance(ask.tokens[0], list) else None
    total = sum(map(len, lists)) if lists is not None else len(ask.tokens)
    # Decoding took ~2 µs a token here (2M ids: 3.8 s): no more than a context's worth per request
    # (what a generation can take or give), so one body cannot hold the CPU for seconds.
    if total > model.max_context_tokens:
        raise bad_request(
            f"'tokens' holds {total} ids; at most {model.max_context_tokens} (this model's "
            "max_context_tokens) are decoded in one request.",
            code="invalid_value",
            param="tokens",
        )
    if lists is not None:
        return {"text": [await tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists]}
    return {"text": await tokenizer.decode(cast(list[int], ask.tokens), skip_special_tokens=skip)}


def model_named(policies: Policies, name: str) -> ModelPolicy:
    """The model of that name; 404 ``model_not_found`` (OpenAI's answer) when there is none."""
    model = policies.models.get(name)
    if model is None:
        raise not_found(
            f"The model '{name}' does not exist.", code="model_not_found", param="model"
        )
    return model


def _refuse_if_never_fits(
    tokenizer: ModelTokenizer, model: ModelPolicy, prompt: ChatPrompt | TextPrompt, param: str
) -> None:
    """A prompt whose UTF-8 length alone proves it longer than the model's configured context
    can never be admitted: refused without tokenizing it, as a generation refuses one over the
    live limit (``GenerationCore._encoding``), so one body cannot hold a core for seconds."""
    at_least = tokenizer.min_tokens_for_bytes(prompt.utf8_bytes())
    if at_least > model.max_context_tokens:
        raise bad_request(
            f"This prompt has at least {at_least} tokens, more than this model's maximum "
            f"context ({model.max_context_tokens}): it can never be admitted, and is not "
            "tokenized.",
            code="context_length_exceeded",
            param=param,
        )


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
