"""Gate 1 and routing as pure functions: limits, claims, isolation classes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.common.errors import APIError
from gateway.config.policies import PolicyError, load_policies
from gateway.core.admission import ClaimLedger, prompt_limit
from gateway.core.routing import Candidates, RoutingCache, candidate_pairs
from gateway.workers.capacity import CapacityRegistry, WorkerCapacity, parse_worker_state
from tests.harness import PoolSpec, write_policies

DATA = Path(__file__).resolve().parents[3] / "tests" / "data"


def worker(
    url: str,
    role: str,
    pool: int,
    *,
    used: int = 0,
    context: int | None = None,
    max_input: int | None = None,
    patched: bool = True,
) -> WorkerCapacity:
    return WorkerCapacity(
        url=url,
        role=role,
        observed_at=time.time(),
        max_total_num_tokens=pool,
        max_req_input_len=max_input,
        context_length=context,
        page_size=1,
        used_tokens=used,
        engine_patch="1" if patched else None,
    )


def test_the_smallest_bound_sets_the_limit_and_is_named() -> None:
    prefill = worker("p", "prefill", 681_280, context=1_048_576)
    decode = worker("d", "decode", 2_000_000, context=1_048_576)
    limit = prompt_limit(1_048_576, prefill, decode, max_tokens=1000, margin=16)
    assert limit.tokens == 681_280 - 1000 - 16
    assert limit.bound == "prefill KV pool"


def test_max_req_input_len_bounds_the_prompt_alone() -> None:
    prefill = worker("p", "prefill", 10_000, max_input=4000)
    decode = worker("d", "decode", 10_000, max_input=9000)
    limit = prompt_limit(100_000, prefill, decode, max_tokens=500, margin=0)
    assert (limit.tokens, limit.bound) == (4000, "prefill max_req_input_len")


def test_a_claim_is_released_on_every_exit_path() -> None:
    ledger = ClaimLedger()
    with ledger.claim(("p", "d"), 100):
        assert ledger.claimed == {"p": 100, "d": 100}
    assert ledger.claimed == {}
    with pytest.raises(RuntimeError), ledger.claim(("p", "d"), 50):
        raise RuntimeError("dispatch failed")
    assert ledger.claimed == {}
    claim = ledger.claim(("p",), 10)
    claim.release()
    claim.release()  # idempotent: released once
    assert ledger.claimed == {}


def test_claims_make_admission_a_claim_not_a_look(tmp_path: Path) -> None:
    policies = load_policies(
        write_policies(
            tmp_path,
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=[PoolSpec("shared", (("http://p", 1),), ("http://d",))],
        )
    )
    registry = registry_with(
        worker("http://p", "prefill", 1000), worker("http://d", "decode", 1000)
    )
    candidates = Candidates(
        candidate_pairs(policies, policies.models["m"], "tenant", registry), 10_000
    )
    ledger = ClaimLedger()
    first = candidates.choose(ledger, prompt_tokens=500, max_tokens=100, margin=0)
    assert first is not None
    ledger.claim(first.urls, 600)
    # The poll still says the pools are empty, but the first request's tokens are claimed.
    assert candidates.choose(ledger, prompt_tokens=500, max_tokens=100, margin=0) is None
    assert candidates.choose(ledger, prompt_tokens=300, max_tokens=100, margin=0) is not None


def test_least_loaded_pair_is_chosen(tmp_path: Path) -> None:
    policies = load_policies(
        write_policies(
            tmp_path,
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=[PoolSpec("shared", (("http://p1", 1), ("http://p2", 2)), ("http://d1",))],
        )
    )
    registry = registry_with(
        worker("http://p1", "prefill", 1000, used=700),
        worker("http://p2", "prefill", 1000, used=10),
        worker("http://d1", "decode", 1000),
    )
    candidates = Candidates(candidate_pairs(policies, policies.models["m"], "t", registry), 10_000)
    chosen = candidates.choose(ClaimLedger(), 100, 10, 0)
    assert chosen is not None and chosen.prefill.url == "http://p2"


def test_dedicated_tenants_use_only_their_pool_and_shared_tenants_never_a_dedicated_one(
    tmp_path: Path,
) -> None:
    policies = load_policies(
        write_policies(
            tmp_path,
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=[
                PoolSpec("shared", (("http://sp", 1),), ("http://sd",)),
                PoolSpec("acme-only", (("http://ap", 1),), ("http://ad",), dedicated_to=("acme",)),
            ],
            tenants={"acme": {"isolation": "dedicated"}},
        )
    )
    registry = registry_with(
        *(
            worker(f"http://{n}", "prefill" if n.endswith("p") else "decode", 1000)
            for n in ("sp", "sd", "ap", "ad")
        )
    )
    model = policies.models["m"]
    assert {p.pool for p in candidate_pairs(policies, model, "acme", registry)} == {"acme-only"}
    assert {p.pool for p in candidate_pairs(policies, model, "globex", registry)} == {"shared"}


def test_a_dedicated_tenant_without_a_pool_is_a_policy_error(tmp_path: Path) -> None:
    write_policies(
        tmp_path,
        model_name="m",
        tokenizer_dir=tmp_path,
        pools=[PoolSpec("shared", (("http://sp", 1),), ("http://sd",))],
        tenants={"acme": {"isolation": "dedicated"}},
    )
    with pytest.raises(PolicyError, match="acme"):
        load_policies(tmp_path)


def test_stale_or_untagged_workers_are_never_candidates(tmp_path: Path) -> None:
    policies = load_policies(
        write_policies(
            tmp_path,
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=[PoolSpec("shared", (("http://p", 1),), ("http://d",))],
        )
    )
    model = policies.models["m"]
    stale = worker("http://p", "prefill", 1000)
    stale = WorkerCapacity(**{**stale.as_dict(), "observed_at": time.time() - 60})
    with pytest.raises(APIError) as none:
        candidate_pairs(
            policies, model, "t", registry_with(stale, worker("http://d", "decode", 1000))
        )
    assert none.value.status == 503 and "Retry-After" in none.value.headers
    untagged = registry_with(
        worker("http://p", "prefill", 1000, patched=False), worker("http://d", "decode", 1000)
    )
    with pytest.raises(APIError) as refused:
        candidate_pairs(policies, model, "t", untagged)
    assert refused.value.status == 503 and "engine_patch" in refused.value.message


def test_best_limit_is_the_largest_over_candidate_pairs(tmp_path: Path) -> None:
    policies = load_policies(
        write_policies(
            tmp_path,
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=[PoolSpec("shared", (("http://p1", 1), ("http://p2", 2)), ("http://d",))],
        )
    )
    registry = registry_with(
        worker("http://p1", "prefill", 1000),
        worker("http://p2", "prefill", 5000),
        worker("http://d", "decode", 8000),
    )
    candidates = Candidates(candidate_pairs(policies, policies.models["m"], "t", registry), 100_000)
    assert candidates.best_limit(100, 0).tokens == 4900
    assert candidates.best_limit(1000, 0).tokens == 4000  # limits are kept per max_tokens


def _cached_pair_urls(cache: RoutingCache, policies, tenant: str = "t") -> set[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return {pair.urls for pair in cache.candidates(policies, policies.models["m"], tenant).pairs}


def test_the_routing_cache_answers_as_candidate_pairs_would_after_a_new_observation(
    tmp_path: Path,
) -> None:
    policies = load_policies(
        write_policies(
            tmp_path,
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=[PoolSpec("shared", (("http://p1", 1), ("http://p2", 2)), ("http://d",))],
        )
    )
    registry = registry_with(
        worker("http://p1", "prefill", 1000),
        worker("http://p2", "prefill", 1000, patched=False),
        worker("http://d", "decode", 1000),
    )
    cache = RoutingCache(registry)
    first = cache.candidates(policies, policies.models["m"], "t")
    assert cache.candidates(policies, policies.models["m"], "t") is first  # nothing changed: kept
    assert {pair.urls for pair in first.pairs} == {("http://p1", "http://d")}
    registry.adopt(worker("http://p2", "prefill", 1000))  # p2 now runs engine_patch
    assert _cached_pair_urls(cache, policies) == {
        ("http://p1", "http://d"),
        ("http://p2", "http://d"),
    }
    registry.adopt(worker("http://d", "decode", 5000))
    assert cache.candidates(policies, policies.models["m"], "t").best_limit(100, 0).tokens == 900


def test_the_routing_cache_drops_a_pair_once_its_observation_goes_stale(tmp_path: Path) -> None:
    policies = load_policies(
        write_policies(
            tmp_path,
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=[PoolSpec("shared", (("http://p1", 1), ("http://p2", 2)), ("http://d",))],
        )
    )
    ageing = WorkerCapacity(
        **{**worker("http://p2", "prefill", 1000).as_dict(), "observed_at": time.time() - 4.0}
    )
    registry = registry_with(
        worker("http://p1", "prefill", 1000), ageing, worker("http://d", "decode", 1000)
    )
    cache = RoutingCache(registry)
    assert len(cache.candidates(policies, policies.models["m"], "t").pairs) == 2
    # p2's observation passes stale_after_s (5 s) with no new poll (1 s of slack before it, for
    # a loaded machine).
    time.sleep(1.1)
    assert _cached_pair_urls(cache, policies) == {("http://p1", "http://d")}


def test_the_routing_cache_follows_reloaded_policies(tmp_path: Path) -> None:
    registry = registry_with(
        worker("http://sp", "prefill", 1000),
        worker("http://sd", "decode", 1000),
        worker("http://ap", "prefill", 1000),
        worker("http://ad", "decode", 1000),
    )
    pools = [
        PoolSpec("shared", (("http://sp", 1),), ("http://sd",)),
        PoolSpec("acme-only", (("http://ap", 1),), ("http://ad",), dedicated_to=("acme",)),
    ]
    shared = load_policies(
        write_policies(tmp_path / "a", model_name="m", tokenizer_dir=tmp_path, pools=pools)
    )
    cache = RoutingCache(registry)
    assert _cached_pair_urls(cache, shared, "acme") == {("http://sp", "http://sd")}
    dedicated = load_policies(
        write_policies(
            tmp_path / "b",
            model_name="m",
            tokenizer_dir=tmp_path,
            pools=pools,
            tenants={"acme": {"isolation": "dedicated"}},
        )
    )
    assert _cached_pair_urls(cache, dedicated, "acme") == {("http://ap", "http://ad")}


def test_real_sglang_capacity_bodies_parse() -> None:
    import json

    info = json.loads((DATA / "server_info_prefill.json").read_text())
    loads = json.loads((DATA / "loads_prefill.json").read_text())
    state = parse_worker_state("http://p", "prefill", info, loads, time.time())
    assert state.max_total_num_tokens == loads["loads"][0]["max_total_num_tokens"]
    assert state.max_req_input_len == info["max_req_input_len"]
    assert state.page_size >= 1


def registry_with(*states: WorkerCapacity) -> CapacityRegistry:
    registry = CapacityRegistry(poll_interval_s=1, stale_after_s=5)
    registry.set_workers([(s.url, s.role) for s in states])
    for state in states:
        registry.adopt(state)
    return registry
