"""One generation, from a parsed ask to a checked answer: the core every caller goes through.

The problem: the API routes, the canary prober, and every later caller (batch prompts, ``n``
choices) must pass the same gates in the same order. A caller with a path of its own is a path
around the checks, and a change to admission that must be made in several places is made in
all but one of them.

The invariant, for every ``GenerationAsk``:

1. admit: the prompt is counted with the model's own tokenizer (or refused from its byte length
   alone) and refused with 400 ``context_length_exceeded`` if it fits no candidate pair's live
   limits, before any worker is contacted;
2. claim: the tenant's limits (when it has any) and the chosen pair's KV tokens are claimed,
   both held in one ``AsyncExitStack`` that releases them on every exit path; a stream takes the
   stack over whole and closes it when it ends;
3. dispatch and verify: nothing of decode's answer is handed out before its ``meta_info`` has
   passed ``check_meta``, its text the content scan, and its finish reason the abort check;
4. audit: a ``Trace`` collects what happened and ``GenerationCore.record`` files its one audit
   event (built by ``Trace.event``, the only builder).

The core knows nothing of HTTP: ``gateway.pipeline`` reads requests and writes responses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from .admission import ClaimLedger, PromptLimit, context_length_exceeded, refuse_if_over
from .audit import AuditEvent, AuditLog
from .auth import Principal
from .dispatch import EngineRequest, PDDispatcher
from .errors import APIError, unavailable
from .ids import tenant_cache_salt
from .limits import LimitLease, TenantLimiter
from .metrics import Metrics
from .pairs import WorkerPair
from .policies import ModelPolicy, Policies, TenantLimits
from .protocol import utf8_length
from .routing import Candidates, RoutingCache
from .tokenize import ChatTurn, ModelTokenizer
from .verify import (
    ContentScanner,
    Expectation,
    IsolationFailure,
    StreamGuard,
    check_meta,
    check_text,
)

log = logging.getLogger("isogate.request")


# ---- what a caller asks for ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    turns: list[ChatTurn]

    def utf8_bytes(self) -> int:
        return sum(utf8_length(turn.content) for turn in self.turns)


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str

    def utf8_bytes(self) -> int:
        return utf8_length(self.text)


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True, slots=True)
class GenerationAsk:
    tenant_id: str
    model: ModelPolicy
    prompt: Prompt
    max_tokens: int
    sampling_params: dict[str, Any]  # SGLang's, ``max_new_tokens`` included
    # The tenant's limits; None where a generation is not the tenant's traffic (the canary).
    limits: TenantLimits | None
    # A pair chosen by the caller (the canary probes every pair in turn); else routed.
    pair: WorkerPair | None = None
    # The content check, where it is not the gateway's scanner (the canary's own-marker check).
    scanner: ContentScanner | None = None


class Catalog(Protocol):
    """The policies and tokenizers in force; replaced together on reload."""

    @property
    def policies(self) -> Policies: ...

    @property
    def tokenizers(self) -> Mapping[str, ModelTokenizer]: ...


@dataclass(frozen=True, slots=True)
class Admitted:
    """A generation that passed gate 1 and holds its claims: ready to dispatch."""

    pair: WorkerPair
    request: EngineRequest
    expected: Expectation
    scanner: ContentScanner
    lease: LimitLease | None


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


# ---- the audit record ----------------------------------------------------------------------


@dataclass
class Trace:
    """What the audit event of one request will say; filled in as the request advances."""

    generation_id: str
    created_at: datetime
    started: float
    stream: bool = False
    principal: Principal | None = None
    model: str | None = None
    pair: WorkerPair | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def event(self, outcome: Outcome) -> AuditEvent:
        return AuditEvent(
            generation_id=self.generation_id,
            tenant_id=self.principal.tenant_id if self.principal else "",
            key_id=self.principal.key_id if self.principal else None,
            model=self.model,
            outcome=outcome.outcome,
            status=outcome.status,
            code=outcome.code,
            prefill_worker=self.pair.prefill.url if self.pair else None,
            decode_worker=self.pair.decode.url if self.pair else None,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            stream=self.stream,
            latency_ms=(time.perf_counter() - self.started) * 1000.0,
            created_at=self.created_at,
            detail=outcome.detail,
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended: the audit event's outcome and the status the client got."""

    outcome: str
    status: int
    code: str | None = None
    detail: str | None = None

    @classmethod
    def of_error(cls, error: APIError) -> Outcome:
        if error.status == 429:
            outcome = "rate_limited"
        elif error.status in (502, 503, 504):
            outcome = "upstream_error"
        else:
            outcome = "rejected"
        return cls(outcome, error.status, error.code, error.message[:300])

    @classmethod
    def of_failure(cls, failure: IsolationFailure, status: int = 502) -> Outcome:
        return cls("verification_failed", status, "isolation_check_failed", failure.reason[:300])


SERVED = Outcome("served", 200)
CLIENT_CANCELLED = Outcome("client_cancelled", 499, "client_cancelled")


# ---- the core ------------------------------------------------------------------------------


class GenerationCore:
    """Admit, claim, dispatch, verify and audit one generation (see the module doc)."""

    def __init__(
        self,
        *,
        catalog: Catalog,
        routes: RoutingCache,
        ledger: ClaimLedger,
        limiter: TenantLimiter,
        dispatcher: PDDispatcher,
        scanner: ContentScanner,
        audit: AuditLog,
        metrics: Metrics,
        margin_tokens: int,
        cache_salt_secret: str,
    ) -> None:
        self._catalog = catalog
        self._routes = routes
        self._ledger = ledger
        self._limiter = limiter
        self._dispatcher = dispatcher
        self._scanner = scanner
        self._audit = audit
        self._metrics = metrics
        self._margin = margin_tokens
        self._cache_salt_secret = cache_salt_secret

    # -- admit and claim --------------------------------------------------------------------

    async def admit(self, ask: GenerationAsk, trace: Trace, held: AsyncExitStack) -> Admitted:
        """Gate 1, then the claims (pushed onto ``held``); raises ``APIError`` on refusal."""
        model, margin, max_tokens = ask.model, self._margin, ask.max_tokens
        if ask.pair is None:
            candidates = self._routes.candidates(self._catalog.policies, model, ask.tenant_id)
        else:
            candidates = Candidates([ask.pair], model.max_context_tokens)
        limit = candidates.best_limit(max_tokens, margin)
        input_ids = await self._count(ask, limit)
        trace.prompt_tokens = prompt_tokens = len(input_ids)
        self._refuse_if_over(model, prompt_tokens, limit, max_tokens)

        lease = None
        if ask.limits is not None:
            lease = await self._limiter.acquire(
                ask.tenant_id, ask.limits, prompt_tokens + max_tokens
            )
            await held.enter_async_context(lease)

        pair = candidates.choose(self._ledger, prompt_tokens, max_tokens, margin)
        if pair is None:
            raise unavailable(
                "Every worker pair that could hold this request is busy; try again shortly.",
                code="capacity_busy",
            )
        trace.pair = pair
        held.enter_context(self._ledger.claim(pair.urls, prompt_tokens + max_tokens + margin))

        request = EngineRequest(
            generation_id=trace.generation_id,
            tenant_id=ask.tenant_id,
            input_ids=input_ids,
            sampling_params=ask.sampling_params,
            cache_salt=tenant_cache_salt(self._cache_salt_secret, ask.tenant_id),
        )
        expected = Expectation(
            trace.generation_id, ask.tenant_id, prompt_tokens, max_tokens, model.require_engine_tags
        )
        return Admitted(pair, request, expected, ask.scanner or self._scanner, lease)

    async def _count(self, ask: GenerationAsk, limit: PromptLimit) -> list[int]:
        """The prompt's token ids; refuses, before tokenizing, what its byte length alone proves
        too long (no token is longer than the vocabulary's longest entry)."""
        tokenizer = self._catalog.tokenizers[ask.model.name]
        prompt = ask.prompt
        if isinstance(prompt, TokenPrompt):
            self._refuse_if_over(ask.model, len(prompt.ids), limit, ask.max_tokens)
            return tokenizer.check_token_ids(prompt.ids)
        at_least = tokenizer.min_tokens_for_bytes(prompt.utf8_bytes())
        if at_least > limit.tokens:
            self._metrics.refused_untokenized_inc(ask.model.name)
            self._metrics.admission_refusals.labels(ask.model.name, limit.bound).inc()
            raise context_length_exceeded(f"at least {at_least}", limit, ask.max_tokens)
        if isinstance(prompt, ChatPrompt):
            return await tokenizer.encode_chat(prompt.turns)
        return await tokenizer.encode_text(prompt.text)

    def _refuse_if_over(
        self, model: ModelPolicy, prompt_tokens: int, limit: PromptLimit, max_tokens: int
    ) -> None:
        try:
            refuse_if_over(prompt_tokens, limit, max_tokens)
        except APIError:
            self._metrics.admission_refusals.labels(model.name, limit.bound).inc()
            raise

    # -- dispatch and verify ----------------------------------------------------------------

    async def complete(self, admitted: Admitted, trace: Trace) -> Completion:
        """Decode's whole answer, checked; the tenant's token count settled."""
        output = await self._dispatcher.generate(admitted.pair, admitted.request)
        meta = output.get("meta_info")
        check_meta(meta, admitted.expected)
        assert isinstance(meta, dict)  # check_meta refuses anything else
        text = output.get("text", "")
        check_text(admitted.scanner, text, admitted.expected.tenant_id)
        finish_reason = finish_reason_of(meta)
        trace.completion_tokens = completion_tokens = meta.get("completion_tokens", 0)
        if admitted.lease is not None:
            await admitted.lease.settle(admitted.expected.prompt_tokens + completion_tokens)
        return Completion(
            text,
            finish_reason,
            admitted.expected.prompt_tokens,
            completion_tokens,
            meta.get("cached_tokens", 0),
        )

    async def open_stream(self, admitted: Admitted, trace: Trace) -> CheckedStream:
        """Decode's stream, once its first chunks have passed the checks, so that an early
        failure still has its own status."""
        batches = self._dispatcher.stream(admitted.pair, admitted.request)
        guard = StreamGuard(admitted.scanner, admitted.expected.tenant_id)
        try:
            first = checked_delta(await batches.__anext__(), admitted.expected, guard)
        except StopAsyncIteration:
            raise APIError(
                502,
                "The decode worker ended the stream without output.",
                "upstream_error",
                "upstream_error",
            ) from None
        except BaseException:
            await batches.aclose()
            raise
        return CheckedStream(admitted.expected, admitted.lease, trace, batches, guard, first)

    async def run(self, ask: GenerationAsk, trace: Trace) -> Completion:
        """Admit, dispatch and verify a whole answer, releasing every claim before returning."""
        async with AsyncExitStack() as held:
            return await self.complete(await self.admit(ask, trace, held), trace)

    # -- audit ------------------------------------------------------------------------------

    def record(self, trace: Trace, outcome: Outcome) -> None:
        """The one place a request's outcome is recorded: audit event, counters, log line."""
        event = trace.event(outcome)
        self._audit.record(event)
        if outcome.outcome == "verification_failed":
            log.error(
                "isolation check failed",
                extra={
                    "generation_id": trace.generation_id,
                    "reason": outcome.detail,
                    "tenant_id": trace.principal.tenant_id if trace.principal else None,
                },
            )
            self._metrics.verification_failed(trace.model or "", outcome.detail or "")
        # A served request's line is DEBUG: its audit event already records it, and at INFO
        # the line cost as much CPU as the audit insert (bench/RESULTS.md).
        level = logging.DEBUG if outcome.outcome == "served" else logging.INFO
        if log.isEnabledFor(level):
            log.log(
                level,
                "request finished",
                extra={
                    "outcome": outcome.outcome,
                    "status": outcome.status,
                    "code": outcome.code,
                    "latency_ms": round(event.latency_ms, 3),
                },
            )
        tenant = trace.principal.tenant_id if trace.principal else ""
        # A model name the client made up is not a label value: clients could grow the series.
        model = trace.model if trace.model in self._catalog.policies.models else ""
        self._metrics.observe_request(
            model or "", tenant, outcome.outcome, time.perf_counter() - trace.started
        )


@dataclass(frozen=True, slots=True)
class StreamStep:
    """What engine chunks that arrived together add for the client, all of them checked."""

    delta: str
    meta: dict[str, Any]  # the last chunk's ``meta_info``

    @property
    def finished(self) -> bool:
        return self.meta.get("finish_reason") is not None


class CheckedStream:
    """Decode's stream of one admitted generation, a checked step at a time.

    ``steps`` yields the first step and then one per batch of chunks; ``finish`` (after the
    last step) gives the held-back tail and the finish reason and settles the tenant's tokens;
    ``aclose`` closes decode's stream. A failed check raises ``IsolationFailure`` before any
    text of its batch is handed out.
    """

    def __init__(
        self,
        expected: Expectation,
        lease: LimitLease | None,
        trace: Trace,
        batches: AsyncGenerator[list[dict[str, Any]]],
        guard: StreamGuard,
        first: StreamStep,
    ) -> None:
        self.expected = expected
        self._lease = lease
        self._trace = trace
        self._batches = batches
        self._guard = guard
        self._last = first

    @property
    def prompt_tokens(self) -> int:
        return self.expected.prompt_tokens

    async def steps(self) -> AsyncGenerator[StreamStep]:
        yield self._last
        async for batch in self._batches:
            self._last = checked_delta(batch, self.expected, self._guard)
            yield self._last

    async def finish(self) -> tuple[str, str, int, int]:
        """The tail, the finish reason, completion and cached tokens; after the last step."""
        meta = self._last.meta
        finish_reason = finish_reason_of(meta)
        tail = self._guard.finish()
        completion_tokens: int = meta.get("completion_tokens", 0)
        self._trace.completion_tokens = completion_tokens
        if self._lease is not None:
            await self._lease.settle(self.prompt_tokens + completion_tokens)
        return tail, finish_reason, completion_tokens, meta.get("cached_tokens", 0)

    async def aclose(self) -> None:
        await self._batches.aclose()


def checked_delta(
    batch: list[dict[str, Any]], expected: Expectation, guard: StreamGuard
) -> StreamStep:
    """The text that engine chunks which arrived together add for the client, once every one
    of them has passed the checks (none of a batch is handed out before all of it is checked)."""
    for chunk in batch:
        check_meta(chunk.get("meta_info"), expected)
    return StreamStep(
        guard.feed_all([chunk.get("text", "") for chunk in batch]), batch[-1]["meta_info"]
    )


def finish_reason_of(meta: dict[str, Any]) -> str:
    """The OpenAI finish reason of an engine answer; an abort is a failure, never content."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        # An engine abort reported with 200 is a failure (see ARCHITECTURE: the 0.5.23 abort
        # with status_code=None answers 200).
        message = reason.get("message") if isinstance(reason, dict) else None
        raise IsolationFailure(f"engine aborted the request: {message or 'no reason given'}")
    return "length" if kind == "length" else "stop"
