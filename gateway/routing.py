"""Which (prefill, decode) pair serves a request.

Candidates are the pairs of the pools a tenant may use (its dedicated pool, or the shared
ones; never the other kind), whose workers both have fresh capacity, and, where the model
requires it, run ``engine_patch``. Among the pairs whose pools can hold the request at all,
the pair chosen is one where it fits *now* and whose workers have the fewest tokens in use.
"""

from __future__ import annotations

from dataclasses import dataclass

from .admission import ClaimLedger, PromptLimit, prompt_limit
from .capacity import CapacityRegistry, WorkerCapacity
from .errors import APIError, unavailable
from .policies import DecodeWorker, ModelPolicy, Policies, PrefillWorker


@dataclass(frozen=True, slots=True)
class WorkerPair:
    pool: str
    prefill: PrefillWorker
    decode: DecodeWorker
    prefill_state: WorkerCapacity
    decode_state: WorkerCapacity

    @property
    def urls(self) -> tuple[str, str]:
        return (self.prefill.url, self.decode.url)


def candidate_pairs(policies: Policies, model: ModelPolicy, tenant_id: str,
                    registry: CapacityRegistry) -> list[WorkerPair]:
    """Pairs this tenant may use right now; 503 when there are none."""
    pools = policies.pools_for(model, tenant_id)
    if not pools:
        raise APIError(403, f"No worker pool of model '{model.name}' serves this tenant's isolation class.",
                       "permission_error", "no_pool_for_tenant", "model")
    pairs: list[WorkerPair] = []
    for pool in pools:
        prefills = [(w, registry.get(w.url)) for w in pool.prefill]
        decodes = [(w, registry.get(w.url)) for w in pool.decode]
        for prefill, prefill_state in prefills:
            for decode, decode_state in decodes:
                if prefill_state is None or decode_state is None:
                    continue
                if model.require_engine_tags and not (prefill_state.engine_patch and decode_state.engine_patch):
                    continue
                pairs.append(WorkerPair(pool.name, prefill, decode, prefill_state, decode_state))
    if not pairs:
        raise unavailable(
            f"No prefill/decode pair of model '{model.name}' has fresh capacity data"
            + (" and runs engine_patch" if model.require_engine_tags else "")
            + "; try again shortly.",
        )
    return pairs


def best_limit(pairs: list[WorkerPair], policy_max_context: int, max_tokens: int, margin: int) -> PromptLimit:
    """The largest prompt any candidate pair admits: a prompt over it fits nowhere."""
    return max(
        (prompt_limit(policy_max_context, p.prefill_state, p.decode_state, max_tokens, margin) for p in pairs),
        key=lambda limit: limit.tokens,
    )


def choose_pair(pairs: list[WorkerPair], ledger: ClaimLedger, prompt_tokens: int,
                policy_max_context: int, max_tokens: int, margin: int) -> WorkerPair | None:
    """The least loaded pair where the request fits now; None if it fits nowhere now."""
    need = prompt_tokens + max_tokens + margin
    best: tuple[int, WorkerPair] | None = None
    for pair in pairs:
        limit = prompt_limit(policy_max_context, pair.prefill_state, pair.decode_state, max_tokens, margin)
        if prompt_tokens > limit.tokens:
            continue
        free_prefill = ledger.free_now(pair.prefill_state)
        free_decode = ledger.free_now(pair.decode_state)
        if free_prefill < need or free_decode < need:
            continue
        load = (pair.prefill_state.max_total_num_tokens - free_prefill) + (
            pair.decode_state.max_total_num_tokens - free_decode
        )
        if best is None or load < best[0]:
            best = (load, pair)
    return best[1] if best else None
