"""Which (prefill, decode) pair serves a request.

Candidates are the pairs of the pools a tenant may use (its dedicated pool, or the shared
ones; never the other kind), whose workers both have fresh capacity, and, where the model
requires it, run ``engine_patch``. Among the pairs whose pools can hold the request at all,
the pair chosen is one where it fits *now* and whose workers have the fewest tokens in use.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.common.errors import APIError, unavailable
from gateway.config.policies import ModelPolicy, Policies, WorkerPool
from gateway.core.admission import ClaimLedger, PromptLimit, fits_now, prompt_limit
from gateway.workers.capacity import CapacityRegistry
from gateway.workers.pairs import WorkerPair


def pairs_of(
    pools: Iterable[WorkerPool], model: ModelPolicy, registry: CapacityRegistry
) -> list[WorkerPair]:
    """Every (prefill, decode) pair of ``pools`` whose workers both have fresh capacity data
    and, where the model requires it, run engine_patch."""
    pairs: list[WorkerPair] = []
    for pool in pools:
        prefills = [(w, registry.get(w.url)) for w in pool.prefill]
        decodes = [(w, registry.get(w.url)) for w in pool.decode]
        for prefill, prefill_state in prefills:
            for decode, decode_state in decodes:
                if prefill_state is None or decode_state is None:
                    continue
                if model.require_engine_tags and not (
                    prefill_state.engine_patch and decode_state.engine_patch
                ):
                    continue
                pairs.append(WorkerPair(pool.name, prefill, decode, prefill_state, decode_state))
    return pairs


def candidate_pairs(
    policies: Policies, model: ModelPolicy, tenant_id: str, registry: CapacityRegistry
) -> list[WorkerPair]:
    """Pairs this tenant may use right now; 403 when no pool serves it, 503 when none is fresh."""
    pools = policies.pools_for(model, tenant_id)
    if not pools:
        raise APIError(
            403,
            f"No worker pool of model '{model.name}' serves this tenant's isolation class.",
            "permission_error",
            "no_pool_for_tenant",
            "model",
        )
    pairs = pairs_of(pools, model, registry)
    if not pairs:
        raise unavailable(
            f"No prefill/decode pair of model '{model.name}' has fresh capacity data"
            + (" and runs engine_patch" if model.require_engine_tags else "")
            + "; try again shortly.",
        )
    return pairs


@dataclass(slots=True)
class Candidates:
    """The pairs a tenant may use now, and each pair's prompt limit per ``max_tokens``."""

    pairs: list[WorkerPair]
    policy_max_context: int
    # Wall-clock time after which some observation used here may no longer be routed on.
    fresh_until: float = math.inf
    # Per (max_tokens, margin): each pair's limit in ``pairs`` order, and the largest of them.
    _limits: dict[tuple[int, int], tuple[list[PromptLimit], PromptLimit]] = field(
        default_factory=dict
    )

    def limits(self, max_tokens: int, margin: int) -> list[PromptLimit]:
        """Each pair's limit, in ``pairs`` order (computed once per ``max_tokens``)."""
        return self._limits_of(max_tokens, margin)[0]

    def best_limit(self, max_tokens: int, margin: int) -> PromptLimit:
        """The largest prompt any candidate pair admits: a prompt over it fits nowhere."""
        return self._limits_of(max_tokens, margin)[1]

    def _limits_of(self, max_tokens: int, margin: int) -> tuple[list[PromptLimit], PromptLimit]:
        key = (max_tokens, margin)
        known = self._limits.get(key)
        if known is None:
            if len(self._limits) >= _LIMITS_PER_ENTRY:
                self._limits.clear()  # clients choosing many max_tokens values: bounded memory
            limits = [
                prompt_limit(
                    self.policy_max_context, p.prefill_state, p.decode_state, max_tokens, margin
                )
                for p in self.pairs
            ]
            known = self._limits[key] = (limits, max(limits, key=_tokens))
        return known

    def choose(
        self, ledger: ClaimLedger, prompt_tokens: int, max_tokens: int, margin: int
    ) -> WorkerPair | None:
        """The least loaded pair where the request fits now; None if it fits nowhere now."""
        return self.choose_for_all(ledger, (prompt_tokens,), max_tokens, margin)

    def choose_for_all(
        self, ledger: ClaimLedger, prompts: Sequence[int], max_tokens: int, margin: int
    ) -> WorkerPair | None:
        """The least loaded pair where requests with these prompt lengths all fit now at once
        (the choices of one generation go to one pair); None if there is none now."""
        if len(prompts) == 1:
            longest = need = prompts[0]
            need += max_tokens + margin
        else:
            need = sum(prompts) + (max_tokens + margin) * len(prompts)
            longest = max(prompts)
        best: WorkerPair | None = None
        best_load: int | None = None  # counted once a second pair fits: one alone is not compared
        limits = self._limits_of(max_tokens, margin)[0]
        for pair, limit in zip(self.pairs, limits, strict=True):
            if not fits_now(ledger, pair, limit, longest, need):
                continue
            if best is None:
                best = pair
                continue
            if best_load is None:
                best_load = _tokens_in_use(ledger, best)
            load = _tokens_in_use(ledger, pair)
            if load < best_load:
                best, best_load = pair, load
        return best


def _tokens_in_use(ledger: ClaimLedger, pair: WorkerPair) -> int:
    prefill, decode = pair.prefill_state, pair.decode_state
    return (prefill.max_total_num_tokens - ledger.free_now(prefill)) + (
        decode.max_total_num_tokens - ledger.free_now(decode)
    )


_LIMITS_PER_ENTRY = 64
_tokens = operator.attrgetter("tokens")
_MAX_ENTRIES = 10_000


class RoutingCache:
    """``candidate_pairs`` and the pairs' prompt limits, kept until what they come from changes.

    Why: they are functions of the policies, the tenant and the capacity observations, which
    change once per poll, while requests arrive thousands of times a second; recomputed for
    each request they took ~8 % of a request's time in a profile of the pipeline (53 µs of
    ~690, profiled; 13 µs with this cache, bench/RESULTS.md). The invariant: an entry
    says exactly what ``candidate_pairs`` would say now. It is dropped when the policies are
    replaced, when the registry adopts or drops an observation or a worker fails its liveness
    probe (its ``version``), and once an observation it used may no longer be routed on.
    Errors (no pool, no fresh pair) are not kept.
    """

    def __init__(self, registry: CapacityRegistry) -> None:
        self._registry = registry
        self._policies: Policies | None = None
        self._version = -1
        self._entries: dict[tuple[str, str], Candidates] = {}

    def candidates(self, policies: Policies, model: ModelPolicy, tenant_id: str) -> Candidates:
        registry = self._registry
        if (
            policies is not self._policies
            or registry.version != self._version
            or len(self._entries) >= _MAX_ENTRIES
        ):
            self._entries.clear()
            self._policies, self._version = policies, registry.version
        key = (model.name, tenant_id)
        entry = self._entries.get(key)
        if entry is not None and time.time() <= entry.fresh_until:
            return entry
        pairs = candidate_pairs(policies, model, tenant_id, registry)
        usable_until = min(
            min(registry.usable_until(p.prefill_state), registry.usable_until(p.decode_state))
            for p in pairs
        )
        entry = self._entries[key] = Candidates(pairs, model.max_context_tokens, usable_until)
        return entry

    async def observed_after_next_poll(self, pair: WorkerPair) -> WorkerPair | None:
        """``pair`` as the registry's next poll observes its workers; None if no poll ends
        within two intervals or either worker can no longer be routed on."""
        registry = self._registry
        if not await registry.next_refresh(2 * registry.poll_interval_s):
            return None
        prefill, decode = registry.get(pair.prefill.url), registry.get(pair.decode.url)
        if prefill is None or decode is None:
            return None
        return dataclasses.replace(pair, prefill_state=prefill, decode_state=decode)
