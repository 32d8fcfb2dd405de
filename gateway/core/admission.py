"""Gate 1: a prompt is admitted only if the live KV pools of the workers it goes to can hold it.

The problem: an engine that advertises a context length larger than its KV pool will accept
a prompt it cannot hold, and in PD mode the mismatch between what prefill wrote and what decode
reserved is how other tenants' pages get read. The advertised context length is not a bound;
the live pool is.

The invariant: for the (prefill, decode) pair a request is sent to,
``prompt + max_tokens + margin`` fits both pools, the policy and each worker's context length,
and the prompt fits each worker's ``max_req_input_len``; and the tokens are *claimed* against
the pair's free pool before dispatch. Admission is a claim, not a look: two requests that each
fit a pool alone cannot both be sent to it on one stale poll. A ``Claim`` is released on every
exit path (it is a context manager), so claimed tokens never leak.

Across processes (``--workers``, replicas) the claims are shared through Redis when it is
configured: ``ClaimLedger.take`` also claims within this process's lease of the pool, which
grows only by room one atomic step has found free among every process's leases
(``gateway.core.shared_claims``), and fails closed when Redis does not answer. This ledger
stays this process's own account either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.common.errors import APIError, bad_request, unavailable
from gateway.core.shared_claims import ClaimsUnreachable, SharedClaims
from gateway.workers.capacity import WorkerCapacity
from gateway.workers.pairs import WorkerPair


@dataclass(frozen=True, slots=True)
class PromptLimit:
    """The most prompt tokens a pair admits for a given ``max_tokens``, and what sets it."""

    tokens: int
    bound: str


def prompt_limit(
    policy_max_context: int,
    prefill: WorkerCapacity,
    decode: WorkerCapacity,
    max_tokens: int,
    margin: int,
) -> PromptLimit:
    reserve = max_tokens + margin
    candidates: list[tuple[int, str]] = [
        (policy_max_context - max_tokens, "policy max_context_tokens"),
        (prefill.max_total_num_tokens - reserve, "prefill KV pool"),
        (decode.max_total_num_tokens - reserve, "decode KV pool"),
    ]
    for worker in (prefill, decode):
        if worker.context_length is not None:
            candidates.append((worker.context_length - max_tokens, f"{worker.role} context_length"))
        if worker.max_req_input_len is not None:
            candidates.append((worker.max_req_input_len, f"{worker.role} max_req_input_len"))
    tokens, bound = min(candidates, key=lambda candidate: candidate[0])
    return PromptLimit(max(0, tokens), bound)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def refuse_if_over(prompt_tokens: int, limit: PromptLimit, max_tokens: int) -> None:
    """Gate 1 on a counted prompt: over the limit is a 400, before any worker is contacted."""
    if prompt_tokens > limit.tokens:
        raise context_length_exceeded(prompt_tokens, limit, max_tokens)


def fits_now(
    ledger: ClaimLedger, pair: WorkerPair, limit: PromptLimit, prompt_tokens: int, need: int
) -> bool:
    """Whether a request fits ``pair`` at this moment: under its prompt limit, and ``need``
    tokens free in both pools once what is claimed in flight is counted."""
    return prompt_tokens <= limit.tokens and ledger.has_room(pair, need)


def claims_unreachable(reason: str) -> APIError:
    error = unavailable(
        "Admission is paused: the claims shared between gateway processes cannot be reached; "
        "try again shortly.",
        code="claims_unreachable",
    )
    error.audit_detail = f"claims unreachable: {reason}"
    return error


def context_length_exceeded(
    prompt_tokens: int | str, limit: PromptLimit, max_tokens: int
) -> APIError:
    return bad_request(
        f"This model's maximum prompt length on the workers available now is {limit.tokens} tokens "
        f"(set by the {limit.bound}, with max_tokens={max_tokens} reserved); "
        f"your prompt has {prompt_tokens} tokens.",
        code=CONTEXT_LENGTH_EXCEEDED,
        param="messages",
    )


@dataclass
class ClaimLedger:
    """Tokens claimed by requests in flight, per worker, in this process; with ``shared``,
    each claim is also taken against every process's claims."""

    claimed: dict[str, int] = field(default_factory=dict)
    shared: SharedClaims | None = None

    def free_now(self, worker: WorkerCapacity) -> int:
        # The poll's use already counts requests that reached the worker; claims count those
        # that may not have yet. The larger of the two is a safe estimate of what is taken.
        taken = max(worker.used_tokens, self.claimed.get(worker.url, 0))
        if self.shared is not None:
            # Which pair is least loaded (routing's question) counts the other processes'
            # claims too, as of the last heartbeat; whether one fits is the shared claim's.
            taken = max(taken, self.shared.seen(worker.url))
        return worker.max_total_num_tokens - taken

    def has_room(self, pair: WorkerPair, need: int) -> bool:
        """Whether ``need`` tokens are free now in both of the pair's pools, each counted as
        ``free_now`` counts it (written out: this runs twice per request)."""
        claimed = self.claimed
        prefill, decode = pair.prefill_state, pair.decode_state
        return (
            prefill.max_total_num_tokens - max(prefill.used_tokens, claimed.get(prefill.url, 0))
            >= need
            and decode.max_total_num_tokens - max(decode.used_tokens, claimed.get(decode.url, 0))
            >= need
        )

    def refused_on_reported_use(self, pair: WorkerPair, need: int) -> bool:
        """Whether only the workers' reported use, not this process's claims, leaves less than
        ``need`` free in one of the pair's pools."""
        claimed = self.claimed
        return not self.has_room(pair, need) and all(
            state.max_total_num_tokens - claimed.get(state.url, 0) >= need
            for state in (pair.prefill_state, pair.decode_state)
        )

    async def take(self, pair: WorkerPair, need: int) -> Claim | None:
        """``need`` tokens claimed on both of the pair's pools if they have room now, counting
        every process's claims when they are shared; None if they do not. Raises a 503 when
        the shared claims cannot be reached (fail closed: see ``gateway.core.shared_claims``)."""
        if not self.has_room(pair, need):
            return None  # full on this process's own claims: no need to ask the others
        if self.shared is None:
            return self.claim(pair.urls, need)
        try:
            shared_id = await self.shared.claim(pair, need)
        except ClaimsUnreachable as exc:
            raise claims_unreachable(str(exc)) from exc
        if shared_id is None:
            return None
        return self.claim(pair.urls, need, shared_id)

    def claim(self, urls: tuple[str, ...], tokens: int, shared_id: str | None = None) -> Claim:
        for url in urls:
            self.claimed[url] = self.claimed.get(url, 0) + tokens
        return Claim(self, urls, tokens, shared_id)

    def _release(self, urls: tuple[str, ...], tokens: int, shared_id: str | None) -> None:
        if shared_id is not None and self.shared is not None:
            self.shared.release(shared_id)
        for url in urls:
            remaining = self.claimed.get(url, 0) - tokens
            if remaining > 0:
                self.claimed[url] = remaining
            else:
                self.claimed.pop(url, None)

    def in_flight(self) -> Iterator[tuple[str, int]]:
        return iter(self.claimed.items())


@dataclass
class Claim:
    ledger: ClaimLedger
    urls: tuple[str, ...]
    tokens: int
    shared_id: str | None = None
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.ledger._release(self.urls, self.tokens, self.shared_id)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
