"""One generation, from a parsed ask to a checked answer: the core every caller goes through.

The problem: the API routes, the canary prober, and every later caller (batch prompts, ``n``
choices) must pass the same gates in the same order. A caller with a path of its own is a path
around the checks, and a change to admission that must be made in several places is made in
all but one of them.

The invariant, for every ``GenerationAsk``:

1. admit: the prompt is counted with the model's own tokenizer (or refused from its byte length
   alone) and refused with 400 ``context_length_exceeded`` if it fits no candidate pair's live
   limits, before any worker is contacted;
2. queue and claim: a tenant's request waits its turn for a slot of the chosen pair in the
   pair's fair queue (``gateway.core.pair_queues``), then the tenant's limits and the pair's KV
   tokens are claimed; slot and claims are held in one ``Held`` (``gateway.core.held``) that
   releases them on every exit path; a stream takes it over whole and closes it when it ends;
3. dispatch and verify: nothing of decode's answer is handed out before its ``meta_info`` has
   passed ``check_meta``, its text the content scan, and its finish reason the abort check;
   where outputs are read into reasoning, text and tool calls (``GenerationAsk.output``),
   every field handed out is scanned too, and output that broke its constraint fails;
4. audit: a ``Trace`` collects what happened and ``GenerationCore.record`` files its one audit
   event (built by ``Trace.event``, the only builder).

The core knows nothing of HTTP: ``gateway.api.pipeline`` reads requests and writes responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from gateway.common.errors import APIError, bad_request, unavailable
from gateway.common.ids import new_generation_id, tenant_cache_salt
from gateway.common.json_turns import in_turns
from gateway.config.policies import ModelPolicy, Policies, Share, TenantLimits
from gateway.core.admission import (
    CONTEXT_LENGTH_EXCEEDED,
    Claim,
    ClaimLedger,
    PromptLimit,
    context_length_exceeded,
    refuse_if_over,
)
from gateway.core.fair_queue import OUTPUT_TOKEN_COST, Slot, generation_cost
from gateway.core.held import Held
from gateway.core.pair_queues import PairQueues, RequestBound
from gateway.core.routing import Candidates, RoutingCache
from gateway.observability.metrics import Metrics
from gateway.openai.protocol import PromptLogprobs, TokenLogprob, TokenLogprobs, utf8_length
from gateway.openai.tokenize import ChatTurn, ModelTokenizer
from gateway.tenancy.audit import AuditEvent, AuditLog
from gateway.tenancy.auth import Principal
from gateway.tenancy.budgets import BudgetHold, TokenBudgets
from gateway.tenancy.limits import LimitLease, TenantLimiter, model_scopes
from gateway.tool_parsers import InvalidToolOutput, OutputParser, OutputSpec, ParsedOutput, ToolCall
from gateway.verification.verify import (
    ContentScanner,
    Expectation,
    IncrementalChunks,
    IsolationFailure,
    StreamGuard,
    check_logprob_entries,
    check_meta,
    check_prompt_logprobs,
    check_text,
)
from gateway.workers.answer_json import parse_positions, release_positions
from gateway.workers.dispatch import PREFILL_META, EngineRequest, PDDispatcher
from gateway.workers.pairs import WorkerPair
from gateway.workers.refusals import engine_refusal

log = logging.getLogger("isogate.request")


# ---- what a caller asks for ----------------------------------------------------------------
# The values made for every request are plain slotted dataclasses, not frozen ones: a frozen
# dataclass sets each field through object.__setattr__, several times the cost per request.


@dataclass(slots=True)
class ChatPrompt:
    turns: list[ChatTurn]
    # The request's tool definitions, for the template (None: no tools offered).
    tools: list[dict[str, Any]] | None = None
    # The request's variables for the template (``chat_template_kwargs``), the generation
    # prompt (vLLM's ``add_generation_prompt``), and the final assistant text the answer
    # continues (``continue_final_message``): see ``ModelTokenizer.encode_chat``.
    template_kwargs: dict[str, Any] | None = None
    generation_prompt: bool = True
    continuation: str | None = None

    def utf8_bytes(self) -> int:
        total = sum(utf8_length(turn.content) for turn in self.turns)
        return total if self.continuation is None else total + utf8_length(self.continuation)


@dataclass(slots=True)
class TextPrompt:
    text: str

    def utf8_bytes(self) -> int:
        return utf8_length(self.text)


@dataclass(slots=True)
class TokenPrompt:
    ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(slots=True, kw_only=True)
class GenerationAsk:
    """One request: ``n`` choices for each of its prompts, admitted and claimed as a whole."""

    tenant_id: str
    model: ModelPolicy
    prompts: Sequence[Prompt]
    max_tokens: int
    sampling_params: dict[str, Any]  # SGLang's, ``max_new_tokens`` included
    # The tenant's limits; None where a generation is not the tenant's traffic (the canary).
    limits: TenantLimits | None
    # The tenant's request, counted already (``GenerationCore.enter``); its tokens are reserved
    # at admission. None: ``limits`` (when set) are claimed whole at admission.
    lease: LimitLease | None = None
    n: int = 1
    # Log probabilities of each completion token with this many alternatives; None: none.
    top_logprobs: int | None = None
    # The prompt's tokens scored too, with as many alternatives (``echo``; needs top_logprobs).
    prompt_logprobs: bool = False
    # How outputs are read into reasoning, text and tool calls; None: they are text.
    output: OutputSpec | None = None
    # A pair chosen by the caller (the canary probes every pair in turn); else routed.
    pair: WorkerPair | None = None
    # The content check, where it is not the gateway's scanner (the canary's own-marker check).
    scanner: ContentScanner | None = None
    # Streamed: every generation runs at once (a whole answer's may run a few at a time).
    stream: bool = False


class Catalog(Protocol):
    """The policies and tokenizers in force; replaced together on reload."""

    @property
    def policies(self) -> Policies: ...

    @property
    def tokenizers(self) -> Mapping[str, ModelTokenizer]: ...


@dataclass(slots=True)
class Choice:
    """One PD request of an admitted generation: its own generation ID, tags and checks."""

    index: int
    prompt_index: int
    request: EngineRequest
    expected: Expectation
    need: int = 0  # KV tokens it may occupy: prompt + max_tokens + the margin


@dataclass(slots=True)
class Admitted:
    """A generation that passed gate 1 and holds its claims: ready to dispatch."""

    pair: WorkerPair
    choices: list[Choice]
    scanner: ContentScanner
    lease: LimitLease | None
    tokenizer: ModelTokenizer
    output: OutputSpec | None = None
    # The queue's grant: every choice's, or with ``metered`` the first choice's alone.
    slot: Slot | None = None
    # A whole answer whose choices past the first wait their own turns (see ``_Metered``).
    metered: _Metered | None = None
    max_tokens: int = 0
    # The ``x-budget-*`` header lines of the tenant's token budget (none without one).
    budget_lines: bytes = b""


@dataclass(slots=True)
class Completion:
    index: int
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: Sequence[TokenLogprob] | None = None
    # With an output parser: the thinking part (None: none was parsed) and the calls.
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    prompt_index: int = 0  # which of the request's prompts it continues
    prompt_logprobs: PromptLogprobs | None = None


# ---- the audit record ----------------------------------------------------------------------


@dataclass(slots=True)
class Trace:
    """What the audit event of one request will say; filled in as the request advances."""

    generation_id: str
    created_at: datetime
    started: float
    stream: bool = False
    principal: Principal | None = None
    model: str | None = None  # as the client named it (an alias, or the model's own name)
    policy_model: str | None = None  # the model of models.yaml it named, once found
    pair: WorkerPair | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # What the request reserved of the tenant's token budgets, settled when it is recorded.
    budget_hold: BudgetHold | None = None

    def event(self, outcome: Outcome) -> AuditEvent:
        principal, pair = self.principal, self.pair
        tenant_id, key_id = (principal.tenant_id, principal.key_id) if principal else ("", None)
        if pair is None:
            prefill_worker = decode_worker = pool = None
        else:
            (prefill_worker, decode_worker), pool = pair.urls, pair.pool
        return AuditEvent(
            generation_id=self.generation_id,
            tenant_id=tenant_id,
            key_id=key_id,
            model=self.model,
            outcome=outcome.outcome,
            status=outcome.status,
            code=outcome.code,
            prefill_worker=prefill_worker,
            decode_worker=decode_worker,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            stream=self.stream,
            latency_ms=(time.perf_counter() - self.started) * 1000.0,
            created_at=self.created_at,
            detail=outcome.detail,
            pool=pool,
            policy_model=self.policy_model,
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
        return cls(outcome, error.status, error.code, (error.audit_detail or error.message)[:300])

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
        queues: PairQueues,
        margin_tokens: int,
        cache_salt_secret: str,
        budgets: TokenBudgets | None = None,
    ) -> None:
        self._catalog = catalog
        self._budgets = budgets
        self._queues = queues
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

    async def enter(self, tenant_id: str, limits: TenantLimits, held: Held) -> LimitLease:
        """Count the tenant's request and take its concurrency slot (held on ``held``) as soon as
        its key is known, before its body is read: what a request costs the gateway to refuse is
        paid only while the tenant has requests left."""
        lease = await self._limiter.enter(tenant_id, limits)
        held.push(lease.release)
        return lease

    async def admit(self, ask: GenerationAsk, trace: Trace, held: Held) -> Admitted:
        """Gate 1 for every prompt, then the claims for every choice (pushed onto ``held``),
        on one pair; raises ``APIError`` on refusal."""
        model, margin, max_tokens = ask.model, self._margin, ask.max_tokens
        budgets = self._budgets if ask.limits is not None else None
        if budgets is not None:
            # A spent token budget refuses before the prompt is counted.
            await budgets.check(self._catalog.policies, ask.tenant_id, model)
        if ask.pair is None:
            candidates = self._routes.candidates(self._catalog.policies, model, ask.tenant_id)
        else:
            candidates = Candidates([ask.pair], model.max_context_tokens)
        limit = candidates.best_limit(max_tokens, margin)
        tokenizer = self._catalog.tokenizers[model.name]
        # Gate 1 on each prompt; a refusal for length is counted here, once, whichever check
        # made it (the byte bound before tokenizing, or the count after).
        counted: list[list[int]] = []
        try:
            for prompt in ask.prompts:
                if isinstance(prompt, TokenPrompt):
                    refuse_if_over(len(prompt.ids), limit, max_tokens)
                    ids = tokenizer.check_token_ids(prompt.ids)
                else:
                    ids = await self._encoding(ask, tokenizer, prompt, limit)
                    refuse_if_over(len(ids), limit, max_tokens)
                if not ids:  # SGLang refuses empty input_ids on both workers; refused here
                    raise bad_request(
                        "A prompt is empty: it encodes to no tokens.",
                        code="invalid_value",
                        param="messages" if isinstance(prompt, ChatPrompt) else "prompt",
                    )
                counted.append(ids)
        except APIError as error:
            if error.code == CONTEXT_LENGTH_EXCEEDED:
                self._metrics.admission_refusals.labels(model.name, limit.bound).inc()
            raise
        prompt_lengths = [len(ids) for ids in counted for _ in range(ask.n)]
        trace.prompt_tokens = prompt_total = sum(prompt_lengths)

        generations = len(prompt_lengths)
        budget_lines = b""
        if budgets is not None:
            # What it may use is reserved before it queues, so requests in flight together
            # are counted together; settled to what it used by ``record``.
            may_use = prompt_total + max_tokens * generations
            hold = await budgets.reserve(self._catalog.policies, ask.tenant_id, model, may_use)
            if hold is not None:
                trace.budget_hold, budget_lines = hold, hold.header_lines
        # A tenant's whole answer of several generations runs them a bounded number at a
        # time, each waiting its own turn (``_Metered``): only one of them need fit now.
        metered = ask.limits is not None and not ask.stream and generations > 1
        needed_now = (max(prompt_lengths),) if metered else prompt_lengths
        pair = candidates.choose_for_all(self._ledger, needed_now, max_tokens, margin)
        if pair is None and ask.limits is not None:
            # No room now: a tenant's request waits its turn in the queue of a pair that can
            # hold it at all, rather than being refused.
            pair = _pair_to_wait_on(candidates, max(prompt_lengths), max_tokens, margin)
        if pair is None:
            raise _capacity_busy()
        trace.pair = pair

        # The pair's fair queue: a tenant's traffic waits its turn, not the others' (the
        # canary, not a tenant's traffic, goes straight on). Each generation is a slot and
        # its KV tokens, charged what it costs; the claims are taken as the request leaves the
        # queue holding its grant; all are released with ``held``.
        lease = slot = metered_by = None
        first_need = need = prompt_total + (max_tokens + margin) * generations
        if ask.limits is not None:
            share = self._catalog.policies.share(ask.tenant_id)
            queues = self._queues
            slots, cost = generations, generation_cost(prompt_total, max_tokens * generations)
            if generations > 1:
                bound = queues.request_bound(model, pair)
                if metered:
                    slots, first_need = 1, prompt_lengths[0] + max_tokens + margin
                    cost = generation_cost(prompt_lengths[0], max_tokens)
                else:
                    _refuse_stream_over(pair.pool, bound, generations, need)
            slot = queues.take_free(model, pair, share, slots, first_need, cost)
            if slot is None:
                slot = await queues.wait_turn(model, pair, share, slots, first_need, cost)
            held.push(slot.release)
            reserved = prompt_total + max_tokens * generations
            # The model's limits and the tenant's on it, on top of the tenant's own.
            scopes = model_scopes(self._catalog.policies, ask.tenant_id, model)
            if ask.lease is not None:
                lease = ask.lease
                await lease.reserve(reserved, scopes)
            else:
                lease = await self._limiter.acquire(ask.tenant_id, ask.limits, reserved, scopes)
                held.push(lease.release)
        claim = await self._claim(pair, first_need)
        held.push(claim.release)
        if metered:
            assert slot is not None  # a tenant's request: granted by the queue
            metered_by = _Metered(model, share, bound, first_need, slot, claim)

        cache_salt = tenant_cache_salt(self._cache_salt_secret, ask.tenant_id)
        choices: list[Choice] = []
        for prompt_index, input_ids in enumerate(counted):
            for _ in range(ask.n):
                # The first choice's ID is the request's (the response id, the audit key).
                generation_id = new_generation_id() if choices else trace.generation_id
                request = EngineRequest(
                    generation_id=generation_id,
                    tenant_id=ask.tenant_id,
                    input_ids=input_ids,
                    sampling_params=ask.sampling_params,
                    cache_salt=cache_salt,
                    top_logprobs=ask.top_logprobs,
                    prompt_logprobs=ask.prompt_logprobs and ask.top_logprobs is not None,
                )
                expected = Expectation(
                    generation_id,
                    ask.tenant_id,
                    len(input_ids),
                    max_tokens,
                    model.require_engine_tags,
                    ask.top_logprobs,
                    tokenizer.vocab_size,
                )
                if slot is not None and (metered_by is None or not choices):
                    request.priority = slot.priority  # the others take their own grant's
                need_each = len(input_ids) + max_tokens + margin
                choices.append(Choice(len(choices), prompt_index, request, expected, need_each))
        return Admitted(
            pair,
            choices,
            ask.scanner or self._scanner,
            lease,
            tokenizer,
            ask.output,
            slot,
            metered_by,
            max_tokens,
            budget_lines,
        )

    async def _claim(self, pair: WorkerPair, need: int) -> Claim:
        """``need`` tokens of ``pair`` claimed for a request on its way to it; 503
        ``capacity_busy`` when they are not free (taken by others while it waited).

        The fair queue grants on its own count of what the gateway has sent; the claim also
        counts what the workers last reported in use, which may be a poll taken while requests
        since ended still ran. Where only that report stands in the way, the claim is tried
        again on the next polls' observations (a bounded wait) instead of refused on it."""
        ledger = self._ledger
        claim = await ledger.take(pair, need)
        for _ in range(_CLAIM_POLLS_AWAITED):
            if claim is not None or not ledger.refused_on_reported_use(pair, need):
                break
            observed = await self._routes.observed_after_next_poll(pair)
            if observed is None:
                break
            pair = observed
            claim = await ledger.take(pair, need)
        if claim is None:
            raise _capacity_busy()
        return claim

    def _encoding(
        self,
        ask: GenerationAsk,
        tokenizer: ModelTokenizer,
        prompt: ChatPrompt | TextPrompt,
        limit: PromptLimit,
    ) -> Awaitable[list[int]]:
        """The tokenizer's count of a text prompt, to await; refused first when its byte length
        alone proves it too long (no token is longer than the longest entry). Not a coroutine
        itself: every suspension of the tokenizer's would resume one frame more."""
        at_least = tokenizer.min_tokens_for_bytes(prompt.utf8_bytes())
        if at_least > limit.tokens:
            self._metrics.refused_untokenized_inc(ask.model.name)
            raise context_length_exceeded(f"at least {at_least}", limit, ask.max_tokens)
        if isinstance(prompt, ChatPrompt):
            return tokenizer.encode_chat(
                prompt.turns,
                control_text=ask.model.chat_control_text,
                tools=prompt.tools,
                template_kwargs=prompt.template_kwargs,
                generation_prompt=prompt.generation_prompt,
                continuation=prompt.continuation,
            )
        return tokenizer.encode_text(prompt.text, control_text=ask.model.prompt_control_text)

    # -- dispatch and verify ----------------------------------------------------------------

    async def complete(self, admitted: Admitted, trace: Trace) -> list[Completion]:
        """Every choice's whole answer, checked; one failed choice fails them all (the others
        are cancelled); the tenant's token count settled, in its limits and in its queue."""
        metered = admitted.metered
        if len(admitted.choices) == 1:  # without a coroutine of its own, one frame less to resume
            choice = admitted.choices[0]
            output = await self._dispatcher.generate(admitted.pair, choice.request)
            only = await self._checked(admitted, choice, output)
            completions, completion_tokens = [only], only.completion_tokens
        elif metered is not None:
            completions = await _all_or_nothing(
                [self._complete_metered(admitted, metered, choice) for choice in admitted.choices]
            )
            completion_tokens = sum([c.completion_tokens for c in completions])
        else:
            completions = await _all_or_nothing(
                [self._complete_one(admitted, choice) for choice in admitted.choices]
            )
            completion_tokens = sum([c.completion_tokens for c in completions])
        if admitted.slot is not None and metered is None:
            # Charged for max_tokens of each; what was not produced is given back.
            unmade = admitted.max_tokens * len(completions) - completion_tokens
            admitted.slot.refund(OUTPUT_TOKEN_COST * unmade)
        trace.completion_tokens = completion_tokens
        if admitted.lease is not None:
            await admitted.lease.settle((trace.prompt_tokens or 0) + completion_tokens)
        return completions

    async def _complete_one(self, admitted: Admitted, choice: Choice) -> Completion:
        output = await self._dispatcher.generate(admitted.pair, choice.request)
        return await self._checked(admitted, choice, output)

    async def _complete_metered(
        self, admitted: Admitted, metered: _Metered, choice: Choice
    ) -> Completion:
        """One choice of a whole answer whose choices run a bounded number at a time: each
        past the first waits for room in the request's bound, then for its own turn in the
        pair's queue, and gives its slot and tokens back as soon as it ends."""
        pair, need = admitted.pair, choice.need
        if choice.index == 0:  # granted and claimed at admission
            slot, claim = metered.first_slot, metered.first_claim
        else:
            await metered.enter(need)
            try:
                cost = generation_cost(choice.expected.prompt_tokens, admitted.max_tokens)
                queues, model, share = self._queues, metered.model, metered.share
                grant = queues.take_free(model, pair, share, 1, need, cost)
                slot = grant or await queues.wait_turn(model, pair, share, 1, need, cost)
            except BaseException:
                metered.leave(need)
                raise
            claim = None
        try:
            if claim is None:
                claim = await self._claim(pair, need)
            choice.request.priority = slot.priority
            output = await self._dispatcher.generate(pair, choice.request)
            completion = await self._checked(admitted, choice, output)
            slot.refund(OUTPUT_TOKEN_COST * (admitted.max_tokens - completion.completion_tokens))
            return completion
        finally:
            if claim is not None:
                claim.release()
            slot.release()
            metered.leave(need)

    async def _checked(
        self, admitted: Admitted, choice: Choice, output: dict[str, Any]
    ) -> Completion:
        """One choice's answer from decode, once it has passed every check."""
        meta = output.get("meta_info")
        expected = choice.expected
        check_meta(meta, expected, entries=False)  # the entries: ``checked_logprobs``
        assert isinstance(meta, dict)  # check_meta refuses anything else
        text = output.get("text", "")
        check_text(admitted.scanner, text, expected.tenant_id)
        logprobs = None
        if expected.top_logprobs is not None:
            logprobs = await checked_logprobs(meta, expected, admitted.tokenizer)
            check_text(admitted.scanner, "".join(logprobs.tokens), expected.tenant_id)
        finish_reason = finish_reason_of(meta)
        reasoning = calls = None
        if admitted.output is not None:
            cut = cut_short(meta, choice.request.sampling_params)
            parsed = read_output(admitted.output.parser(), text, final=True, cut=cut)
            check_parsed(admitted.scanner, parsed, expected.tenant_id)
            text, calls = parsed.text, parsed.calls
            reasoning = parsed.reasoning if admitted.output.reasoning is not None else None
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        scored_prompt = None
        if choice.request.prompt_logprobs:
            scored_prompt = await checked_prompt_scores(
                output.get(PREFILL_META), choice.request.input_ids, expected, admitted.tokenizer
            )
        return Completion(
            choice.index,
            text,
            finish_reason,
            expected.prompt_tokens,
            meta.get("completion_tokens", 0),
            meta.get("cached_tokens", 0),
            logprobs,
            reasoning,
            calls,
            choice.prompt_index,
            scored_prompt,
        )

    async def open_stream(self, admitted: Admitted, trace: Trace) -> ChoiceStreams:
        """Decode's stream of every choice, once each one's first chunks have passed the
        checks, so that an early failure still has its own status."""
        if len(admitted.choices) == 1:
            streams = [await self._open_one(admitted, admitted.choices[0])]
        else:
            streams = await _all_or_nothing(
                [self._open_one(admitted, choice) for choice in admitted.choices],
                on_abandon=CheckedStream.aclose,
            )
        return ChoiceStreams(streams, trace, admitted.lease, admitted.slot, admitted.max_tokens)

    async def _open_one(self, admitted: Admitted, choice: Choice) -> CheckedStream:
        batches = self._dispatcher.stream(admitted.pair, choice.request)
        guard = StreamGuard(admitted.scanner, choice.expected.tenant_id)
        shaper = None
        if admitted.output is not None:
            shaper = OutputShaper(
                admitted.output.parser(),
                admitted.scanner,
                choice.expected.tenant_id,
                admitted.output.stream_reasoning,
            )
        stream = CheckedStream(
            choice,
            batches,
            guard,
            admitted.tokenizer,
            shaper,
            engine_repeats_output=not admitted.pair.decode_state.incremental_streams,
        )
        try:
            stream.take_first(await batches.__anext__())
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
        return stream

    async def run(self, ask: GenerationAsk, trace: Trace) -> list[Completion]:
        """Admit, dispatch and verify whole answers, releasing every claim before returning."""
        async with Held() as held:
            return await self.complete(await self.admit(ask, trace, held), trace)

    # -- audit ------------------------------------------------------------------------------

    def record(self, trace: Trace, outcome: Outcome) -> None:
        """The one place a request's outcome is recorded: audit event, counters, log line."""
        event = trace.event(outcome)
        self._audit.record(event)
        principal = trace.principal
        # Budgets are settled after the response, as the audit log (their durable record)
        # counts it: a request without completion tokens used none.
        used = 0
        if trace.completion_tokens is not None:
            used = (trace.prompt_tokens or 0) + trace.completion_tokens
        if trace.budget_hold is not None:
            trace.budget_hold.settle(used)
        elif self._budgets is not None and principal is not None and trace.policy_model:
            # Nothing reserved: the budget was set while the request ran.
            self._budgets.charge_later(
                self._catalog.policies, principal.tenant_id, trace.policy_model, used
            )
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
        # The policy's name: an alias's traffic is its model's. A model name the client made
        # up is not a label value: clients could grow the series.
        model = trace.policy_model or (
            trace.model if trace.model in self._catalog.policies.models else ""
        )
        self._metrics.observe_request(
            model or "", tenant, outcome.outcome, time.perf_counter() - trace.started
        )


@dataclass(slots=True)
class StreamStep:
    """What engine chunks of one choice that arrived together add for the client, all of them
    checked: text, and the log probabilities of tokens whose text is out too (with an output
    parser: the answer's text, the reasoning's, and the calls completed)."""

    delta: str
    meta: dict[str, Any]  # the last chunk's ``meta_info``
    logprobs: Sequence[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] | None = None
    # Plain text of several chunks: ``delta`` cut where each chunk ended, so that the client
    # gets an event per engine chunk, as from the engine itself (None: one event).
    pieces: list[str] | None = None

    @property
    def finished(self) -> bool:
        return self.meta.get("finish_reason") is not None


@dataclass(slots=True)
class StreamEnd:
    """What is left of one choice once its stream ended: held-back text and tokens."""

    tail: str
    finish_reason: str
    completion_tokens: int
    cached_tokens: int
    logprobs: Sequence[TokenLogprob] | None
    reasoning: str = ""
    tool_calls: list[ToolCall] | None = None


class CheckedStream:
    """Decode's stream of one choice, a checked step at a time.

    ``steps`` yields the first step and then one per batch of chunks; ``finish`` (after the
    last step) gives what was held back and the finish reason; ``aclose`` closes decode's
    stream. A failed check raises ``IsolationFailure`` before any of its batch is handed out.
    Each chunk is read as what it adds (``IncrementalChunks``), so a step costs what its chunks
    add, wherever the stream is. Log-probability entries are held back with the text their
    tokens spell (the scanner's hold-back), so no token reaches the client before the text it
    is part of was scanned.
    """

    def __init__(
        self,
        choice: Choice,
        batches: AsyncGenerator[list[dict[str, Any]]],
        guard: StreamGuard,
        tokenizer: ModelTokenizer | None,
        shaper: OutputShaper | None = None,
        *,
        engine_repeats_output: bool,
    ) -> None:
        self.choice = choice
        self._batches = batches
        self._guard = guard
        self._tokenizer = tokenizer
        self._shaper = shaper
        self._chunks = IncrementalChunks(engine_repeats_output)
        self._first: StreamStep | None = None
        self._last_meta: dict[str, Any] = {}
        # Entries whose text is held back still (their text not out yet), and the text out.
        self._logprobs = TokenLogprobs()
        self._logprob_chars_sent = 0

    @property
    def index(self) -> int:
        return self.choice.index

    def take_first(self, batch: list[dict[str, Any]]) -> None:
        self._first = self._step(batch)

    async def steps(self) -> AsyncGenerator[StreamStep]:
        if self._first is not None:
            yield self._first
        async for batch in self._batches:
            yield self._step(batch)

    def _step(self, batch: list[dict[str, Any]]) -> StreamStep:
        expected = self.choice.expected
        parts = [self._chunks.checked(chunk, expected) for chunk in batch]
        texts = [part.get("text") or "" for part in parts]
        fed, sent = self._guard.length, self._guard.sent_chars
        delta = self._guard.feed("".join(texts))
        self._last_meta = meta = parts[-1]["meta_info"]
        step = StreamStep(delta, meta) if self._shaper is None else self._shaper.step(delta, meta)
        if expected.top_logprobs is None or self._tokenizer is None:
            if len(texts) > 1 and self._shaper is None:
                step.pieces = pieces_of(texts, fed, sent, delta)
            return step
        fresh = [token_logprobs(part["meta_info"], self._tokenizer) for part in parts]
        for run in fresh:
            self._logprobs.extend(run)
        self._guard.scan_extra("".join(token for run in fresh for token in run.tokens))
        step.logprobs = self._release_logprobs(self._guard.sent_chars)
        return step

    def _release_logprobs(self, chars: int | None) -> TokenLogprobs:
        """The entries whose text is out (all of them with ``chars`` None), held no longer."""
        held = self._logprobs
        released = 0
        while released < len(held):
            length = len(held.tokens[released])
            if chars is not None and self._logprob_chars_sent + length > chars:
                break
            self._logprob_chars_sent += length
            released += 1
        entries, self._logprobs = held[:released], held[released:]
        return entries

    def finish(self) -> StreamEnd:
        """After the last step: the held-back tail and tokens, the finish reason and counts."""
        meta = self._last_meta
        finish_reason = finish_reason_of(meta)
        tail = self._guard.finish()
        logprobs = None
        if self.choice.expected.top_logprobs is not None:
            logprobs = self._release_logprobs(None)
        end = StreamEnd(
            tail,
            finish_reason,
            meta.get("completion_tokens", 0),
            meta.get("cached_tokens", 0),
            logprobs,
        )
        if self._shaper is not None:
            self._shaper.end(end, cut_short(meta, self.choice.request.sampling_params))
        return end

    async def aclose(self) -> None:
        await self._batches.aclose()


def pieces_of(texts: list[str], fed: int, sent: int, released: str) -> list[str]:
    """``released`` (the stream's text from ``sent`` on) cut where each chunk's new text (of
    ``texts``, the first after ``fed`` characters) ended; chunks that add nothing released
    give no piece."""
    pieces, start, end = [], sent, sent + len(released)
    for text in texts:
        fed += len(text)
        cut = min(fed, end)
        if cut > start:
            pieces.append(released[start - sent : cut - sent])
            start = cut
    return pieces


class ChoiceStreams:
    """The streams of every choice of one generation, merged as their steps arrive.

    ``events`` yields ``(stream, step)`` for each checked step and ``(stream, end)`` once a
    choice's stream ended; after the last, the tenant's token count is settled. ``aclose``
    closes every choice's stream, however far it got.
    """

    def __init__(
        self,
        streams: list[CheckedStream],
        trace: Trace,
        lease: LimitLease | None,
        slot: Slot | None = None,
        max_tokens: int = 0,
    ) -> None:
        self.streams = streams
        self._trace = trace
        self._lease = lease
        self._slot = slot
        self._max_tokens = max_tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(stream.choice.expected.prompt_tokens for stream in self.streams)

    async def events(self) -> AsyncGenerator[tuple[CheckedStream, StreamStep | StreamEnd]]:
        completion_tokens = 0
        if len(self.streams) == 1:  # no tasks: the common case stays as cheap as it was
            stream = self.streams[0]
            async for step in stream.steps():
                yield stream, step
            end = stream.finish()
            completion_tokens = end.completion_tokens
            yield stream, end
        else:
            async for stream, item in _merged(self.streams):
                if isinstance(item, StreamEnd):
                    completion_tokens += item.completion_tokens
                yield stream, item
        self._trace.completion_tokens = completion_tokens
        if self._slot is not None:  # charged for max_tokens of each: the rest given back
            unmade = self._max_tokens * len(self.streams) - completion_tokens
            self._slot.refund(OUTPUT_TOKEN_COST * unmade)
        if self._lease is not None:
            await self._lease.settle(self.prompt_tokens + completion_tokens)

    async def aclose(self) -> None:
        for stream in self.streams:
            await stream.aclose()


async def _merged(
    streams: list[CheckedStream],
) -> AsyncGenerator[tuple[CheckedStream, StreamStep | StreamEnd]]:
    """Every stream's steps, in the order they are ready; a failure in one ends them all."""
    iterators = {stream: stream.steps() for stream in streams}
    pending: dict[asyncio.Future[StreamStep], CheckedStream] = {}
    try:
        for stream, steps in iterators.items():
            pending[asyncio.ensure_future(steps.__anext__())] = stream
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f].index):
                stream = pending.pop(future)
                try:
                    step = future.result()
                except StopAsyncIteration:
                    yield stream, stream.finish()
                    continue
                yield stream, step
                pending[asyncio.ensure_future(iterators[stream].__anext__())] = stream
    finally:
        for future in pending:
            future.cancel()
        for future in pending:
            with contextlib.suppress(BaseException):
                await future
        for steps in iterators.values():
            await steps.aclose()


_T = TypeVar("_T")

# How many polls a claim refused on the workers' reported use alone waits for (``_claim``).
_CLAIM_POLLS_AWAITED = 2


async def _all_or_nothing(
    calls: Sequence[Awaitable[_T]],
    on_abandon: Callable[[_T], Awaitable[None]] | None = None,
) -> list[_T]:
    """Every call's result, in order; the first failure cancels the rest and is raised (what
    already succeeded is handed to ``on_abandon``, e.g. streams to close)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failure = _first_failure(tasks)
        if failure is not None:
            raise failure
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        if on_abandon is not None:
            for result in results:
                if not isinstance(result, BaseException):
                    await on_abandon(result)
        raise


def _first_failure(tasks: Sequence[asyncio.Future[Any]]) -> BaseException | None:
    # The lowest-indexed failed choice: the same request fails the same way every time.
    for task in tasks:
        if task.done() and not task.cancelled() and (failure := task.exception()) is not None:
            return failure
    return None


class _Metered:
    """A whole answer's choices past the first: at most ``bound`` of them (slots, and KV tokens
    together, or one alone whatever its size) hold grants at once, each waiting its own turn
    in the pair's queue, as the work of a request of its own would."""

    __slots__ = (
        "_waiting",
        "bound",
        "first_claim",
        "first_slot",
        "model",
        "running",
        "running_kv",
        "share",
    )

    def __init__(
        self,
        model: ModelPolicy,
        share: Share,
        bound: RequestBound,
        first_need: int,
        first_slot: Slot,
        first_claim: Claim,
    ) -> None:
        self.model = model
        self.share = share
        self.bound = bound
        self.first_slot = first_slot
        self.first_claim = first_claim
        self.running = 1  # the first choice, granted at admission
        self.running_kv = first_need
        self._waiting: list[asyncio.Future[None]] = []

    def _fits(self, need: int) -> bool:
        return self.running == 0 or (
            self.running < self.bound.slots and self.running_kv + need <= self.bound.kv
        )

    async def enter(self, need: int) -> None:
        while not self._fits(need):
            woken = asyncio.get_running_loop().create_future()
            self._waiting.append(woken)
            try:
                await woken
            finally:
                self._waiting.remove(woken)
        self.running += 1
        self.running_kv += need

    def leave(self, need: int) -> None:
        self.running -= 1
        self.running_kv -= need
        for woken in self._waiting:  # each looks again (a smaller one may fit now)
            if not woken.done():
                woken.set_result(None)


def _pair_to_wait_on(
    candidates: Candidates, longest: int, max_tokens: int, margin: int
) -> WorkerPair | None:
    """The first candidate pair whose limits admit the prompt at all (room aside)."""
    limits = candidates.limits(max_tokens, margin)
    for pair, limit in zip(candidates.pairs, limits, strict=True):
        if longest <= limit.tokens:
            return pair
    return None


def _refuse_stream_over(pool: str, bound: RequestBound, generations: int, need: int) -> None:
    """A request whose generations all run at once (a stream) and could never fit one
    request's bound is a 400; one within it waits its turn."""
    if generations > bound.slots or need > bound.kv:
        raise bad_request(
            f"A streamed request runs all its {generations} generations (n, best_of, each "
            f"prompt) at once, needing {need} KV tokens; one request may hold at most "
            f"{bound.slots} generations and {bound.kv} KV tokens of pool '{pool}' at once. "
            "Ask for fewer generations or tokens, or without stream.",
            code="request_too_large",
            param="n",
        )


def _capacity_busy() -> APIError:
    return unavailable(
        "Every worker pair that could hold this request is busy; try again shortly.",
        code="capacity_busy",
    )


# Log-probability entries (a token's and each of its alternatives) checked and read between two
# turns of the event loop, of a whole answer or a scored prompt: 1,024 tokens with 20
# alternatives each, or a prompt of 16k tokens with five, took the loop for tens of
# milliseconds to a tenth of a second and more in one go.
LOGPROB_ENTRIES_PER_TURN = 4096


# Where a large answer's entries wait, unparsed, for their slice (``gateway.workers.answer_json``).
_OUTPUT_LOGPROBS = ("output_token_logprobs", "output_top_logprobs")
_PROMPT_LOGPROBS = ("input_token_logprobs", "input_top_logprobs")


def positions_per_turn(top_logprobs: int | None) -> int:
    """Tokens whose entries (their own and ``top_logprobs`` alternatives each) fit
    ``LOGPROB_ENTRIES_PER_TURN``."""
    return max(1, LOGPROB_ENTRIES_PER_TURN // (1 + (top_logprobs or 0)))


async def _turns(total: int, expected: Expectation) -> AsyncGenerator[range]:
    """``range(total)`` in slices of ``positions_per_turn``, the loop free between two (at
    least one slice, empty for no positions: what is checked with every slice still is)."""
    if not total:
        yield range(0)
        return
    async for positions in in_turns(total, positions_per_turn(expected.top_logprobs)):
        yield positions


def token_logprobs(
    meta: dict[str, Any], tokenizer: ModelTokenizer, positions: range | None = None
) -> TokenLogprobs:
    """The log probabilities of ``meta``'s tokens (a whole answer's, or a stream chunk's new
    ones; those at ``positions`` only, if given), checked by ``check_meta`` already; token
    texts come from the gateway's own tokenizer, never from the engine."""
    entries = meta.get("output_token_logprobs") or []
    alternatives = meta.get("output_top_logprobs") or []
    text = tokenizer.token_text
    result = TokenLogprobs()
    for position in range(len(entries)) if positions is None else positions:
        logprob, token = entries[position][0], entries[position][1]
        top = alternatives[position] if position < len(alternatives) else []
        result.append(text(token), float(logprob), [(text(e[1]), float(e[0])) for e in top])
    return result


async def checked_logprobs(
    meta: dict[str, Any], expected: Expectation, tokenizer: ModelTokenizer
) -> TokenLogprobs:
    """A whole answer's log probabilities (their shape checked by ``check_meta``), checked
    (``check_logprob_entries``) and read ``positions_per_turn`` tokens at a time, with
    the loop free between them; the engine's entries let go once read."""
    result = TokenLogprobs()
    async for positions in _turns(len(meta["output_token_logprobs"]), expected):
        parse_positions(meta, _OUTPUT_LOGPROBS, positions)
        check_logprob_entries(meta, expected, positions)
        result.extend(token_logprobs(meta, tokenizer, positions))
        release_positions(meta, _OUTPUT_LOGPROBS, positions)
    return result


async def checked_prompt_scores(
    meta: Any, input_ids: list[int], expected: Expectation, tokenizer: ModelTokenizer
) -> PromptLogprobs:
    """Prefill's scores of the prompt, checked (``check_prompt_logprobs``) and read
    ``positions_per_turn`` positions at a time, with the loop free between them; token
    texts from the gateway's own tokenizer, the engine's entries let go once read."""
    rest = TokenLogprobs()
    async for positions in _turns(len(input_ids), expected):
        parse_positions(meta, _PROMPT_LOGPROBS, positions)
        check_prompt_logprobs(meta, input_ids, expected, positions)
        rest.extend(_prompt_scores(meta, tokenizer, positions))
        release_positions(meta, _PROMPT_LOGPROBS, positions)
    return PromptLogprobs(tokenizer.token_text(input_ids[0]), rest)


def _prompt_scores(
    meta: dict[str, Any], tokenizer: ModelTokenizer, positions: range
) -> TokenLogprobs:
    """The scores of the prompt's tokens at ``positions`` but the first (which has none)."""
    entries = meta["input_token_logprobs"]
    alternatives = meta.get("input_top_logprobs") or []
    text = tokenizer.token_text
    scores = TokenLogprobs()
    for position in positions:
        if not position:
            continue
        logprob, token = entries[position][0], entries[position][1]
        top = (alternatives[position] if position < len(alternatives) else None) or []
        scores.append(text(token), float(logprob), [(text(e[1]), float(e[0])) for e in top])
    return scores


def best_of(completions: list[Completion], candidates: int, keep: int) -> list[Completion]:
    """Of each prompt's ``candidates`` completions (consecutive by index), the ``keep`` with the
    highest log probability per token, re-indexed as the client's choices."""
    best: list[Completion] = []
    ordered = sorted(completions, key=lambda c: c.index)
    for start in range(0, len(ordered), candidates):
        group = ordered[start : start + candidates]
        group.sort(key=_mean_logprob, reverse=True)
        best.extend(group[:keep])
    return [dataclasses.replace(c, index=i) for i, c in enumerate(best)]


def _mean_logprob(completion: Completion) -> float:
    entries = completion.logprobs
    if not entries:
        return float("-inf")
    if isinstance(entries, TokenLogprobs):
        return sum(entries.logprobs) / len(entries)
    return sum(e.logprob for e in entries) / len(entries)


# How engine_patch's refusals (an isolation check inside the engine) begin their message.
ENGINE_ISOLATION_REFUSAL = "isolation check failed"


def finish_reason_of(meta: dict[str, Any]) -> str:
    """The OpenAI finish reason of an engine answer. An abort is what it says it is: refused
    by the engine's own isolation check (engine_patch), an isolation failure; with an error
    status (an engine error SGLang streams as an abort), that error; without one (an abort an
    operator or client asked for), a normal end, "abort", as SGLang's own server reports it."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        return _abort(reason if isinstance(reason, dict) else {})
    return "length" if kind == "length" else "stop"


def _abort(reason: dict[str, Any]) -> str:
    # The engine's reason is for operators (logged); clients see the gateway's own words
    # (a grammar compiler's verdict aside: gateway.workers.refusals).
    message, status = str(reason.get("message") or ""), reason.get("status_code")
    log.warning(
        "engine aborted a request", extra={"engine_message": message[:500], "status": status}
    )
    if message.startswith(ENGINE_ISOLATION_REFUSAL):
        raise IsolationFailure("the engine's own isolation check refused the request")
    if not isinstance(status, int) or isinstance(status, bool):
        return "abort"
    if 400 <= status < 500 and status not in (408, 429):
        raise engine_refusal("decode", message)
    if status == 503:
        raise unavailable("The decode worker is unavailable.", code="worker_unavailable")
    raise APIError(
        502, f"The decode worker failed (HTTP {status}).", "upstream_error", "upstream_error"
    )


def cut_short(meta: dict[str, Any], sampling_params: Mapping[str, Any]) -> bool:
    """Whether the engine stopped at a limit the client set (``max_tokens``, one of its stop
    sequences or stop token ids, an abort) rather than at the output's own end, which is the
    only place constrained decoding lets an output stop (a stop sequence kept in the output
    with ``no_stop_trim`` comes after that end)."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind != "stop":
        return True
    matched = reason.get("matched") if isinstance(reason, dict) else None
    if isinstance(matched, str):  # a stop string: only the client's are sent
        return True
    return bool(sampling_params.get("no_stop_trim")) or (
        isinstance(matched, int) and matched in (sampling_params.get("stop_token_ids") or ())
    )


# ---- reading outputs: reasoning, text, tool calls --------------------------------------------


def read_output(parser: OutputParser, text: str, final: bool, cut: bool = False) -> ParsedOutput:
    """``text`` through ``parser``; output that broke the constraint it was decoded under is a
    failed check (fail closed: never an answer without the calls that were promised). Output
    ``cut`` short by the client's own limit (``cut_short``) is not a broken constraint: what it
    holds of the promised calls comes back, the rest as text, with its finish reason."""
    try:
        return parser.parse(text, cut) if final else parser.feed(text)
    except InvalidToolOutput as exc:
        raise IsolationFailure(f"tool-call output broke its constraint: {exc}") from None


def check_parsed(scanner: ContentScanner, parsed: ParsedOutput, tenant_id: str) -> None:
    """The canary scan of every field handed out: answer, reasoning and each call's name and
    arguments (as serialised, so a marker the model wrote escaped is found too)."""
    for text in (parsed.text, parsed.reasoning):
        check_text(scanner, text, tenant_id)
    for call in parsed.calls:
        check_text(scanner, call.name, tenant_id)
        check_text(scanner, call.arguments, tenant_id)


class OutputShaper:
    """One streamed choice read into reasoning, answer text and calls, each field checked as
    the raw text is: answer and reasoning through their own hold-back guard, each call whole
    before it is handed out."""

    def __init__(
        self,
        parser: OutputParser,
        scanner: ContentScanner,
        tenant_id: str,
        stream_reasoning: bool = True,
    ) -> None:
        self._parser = parser
        self._scanner = scanner
        self._tenant_id = tenant_id
        self._text = StreamGuard(scanner, tenant_id)
        self._reasoning = StreamGuard(scanner, tenant_id)
        self.calls_made = 0
        # SGLang's ``stream_reasoning`` false: the reasoning goes out whole once it ends.
        self._stream_reasoning = stream_reasoning
        self._reasoning_held = ""

    def step(self, delta: str, meta: dict[str, Any]) -> StreamStep:
        parsed = read_output(self._parser, delta, final=False)
        text, reasoning = self._released(parsed)
        if not self._stream_reasoning:
            self._reasoning_held += reasoning
            answering = bool(parsed.text or parsed.calls)  # the reasoning has ended
            reasoning, self._reasoning_held = (
                (self._reasoning_held, "") if answering else ("", self._reasoning_held)
            )
        return StreamStep(text, meta, None, reasoning, parsed.calls or None)

    def end(self, end: StreamEnd, cut: bool = False) -> None:
        """Completes ``end`` (whose ``tail`` is the raw text's last part) with what the fields
        held back; ``cut``: the engine stopped at the client's limit (``cut_short``)."""
        parsed = read_output(self._parser, end.tail, final=False)
        try:
            last = self._parser.finish(cut)
        except InvalidToolOutput as exc:
            raise IsolationFailure(f"tool-call output broke its constraint: {exc}") from None
        merged = ParsedOutput(
            parsed.reasoning + last.reasoning, parsed.text + last.text, parsed.calls + last.calls
        )
        text, reasoning = self._released(merged)
        end.tail = text + self._text.finish()
        end.reasoning = self._reasoning_held + reasoning + self._reasoning.finish()
        self._reasoning_held = ""
        end.tool_calls = merged.calls or None
        if self.calls_made and end.finish_reason == "stop":
            end.finish_reason = "tool_calls"

    def _released(self, parsed: ParsedOutput) -> tuple[str, str]:
        for call in parsed.calls:
            check_text(self._scanner, call.name, self._tenant_id)
            check_text(self._scanner, call.arguments, self._tenant_id)
        self.calls_made += len(parsed.calls)
        text = self._text.feed(parsed.text)
        reasoning = self._reasoning.feed(parsed.reasoning)
        return text, reasoning
