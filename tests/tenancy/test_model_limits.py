"""Limits of a model as a whole and of a tenant on a model, on top of each tenant's own: the
same limiter, one more scope per set of limits, in memory and in real Redis (issue 45)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.common.errors import APIError
from gateway.config.policies import PolicyError, TenantLimits, load_policies
from gateway.tenancy.limits import (
    LimitScope,
    TenantLimiter,
    model_scope,
    model_scopes,
    tenant_model_scope,
)
from tests.unit.config.test_model_access import write

pytestmark = pytest.mark.anyio

WIDE = TenantLimits(requests_per_minute=1000, tokens_per_minute=1_000_000, max_concurrent=100)


async def _refused(
    limiter: TenantLimiter, tenant: str, scopes: tuple[LimitScope, ...], tokens: int = 10
) -> APIError:
    with pytest.raises(APIError) as raised:
        await limiter.acquire(tenant, WIDE, tokens, scopes)
    return raised.value


async def test_a_models_limit_holds_every_tenants_traffic_together(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    whole = model_scope(
        "tiny", TenantLimits(requests_per_minute=3, tokens_per_minute=10_000, max_concurrent=50)
    )
    for tenant in ("acme", "globex", "acme"):
        await new_limiter().acquire(tenant, WIDE, 10, (whole,))
    error = await _refused(new_limiter(), "initech", (whole,))
    assert error.status == 429
    assert error.message == "Rate limit reached (model tiny): 3 requests per minute."
    assert error.headers["x-ratelimit-scope"] == "model tiny"
    # Another model's traffic is not this one's.
    other = model_scope("other", whole.limits)
    await new_limiter().acquire("initech", WIDE, 10, (other,))


async def test_a_tenants_limit_on_a_model_binds_that_tenant_on_that_model_only(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limits = TenantLimits(requests_per_minute=1000, tokens_per_minute=100, max_concurrent=50)
    acme_on_tiny = tenant_model_scope("acme", "tiny", limits)
    await new_limiter().acquire("acme", WIDE, 60, (acme_on_tiny,))
    error = await _refused(new_limiter(), "acme", (acme_on_tiny,), tokens=60)
    assert error.message == "Rate limit reached (tenant on model tiny): 100 tokens per minute."
    assert error.headers["x-ratelimit-scope"] == "tenant on model tiny"
    await new_limiter().acquire("globex", WIDE, 60, (tenant_model_scope("globex", "tiny", limits),))
    await new_limiter().acquire("acme", WIDE, 60, (tenant_model_scope("acme", "other", limits),))
    await new_limiter().acquire("acme", WIDE, 60)  # its own limits alone


async def test_a_refusal_by_a_model_scope_takes_nothing_from_the_tenants_limits(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    tenant = TenantLimits(requests_per_minute=2, tokens_per_minute=10_000, max_concurrent=1)
    full = model_scope(
        "tiny", TenantLimits(requests_per_minute=1000, tokens_per_minute=10_000, max_concurrent=1)
    )
    held = await new_limiter().acquire("other-tenant", WIDE, 10, (full,))
    with pytest.raises(APIError) as raised:
        await new_limiter().acquire("acme", tenant, 10, (full,))
    assert raised.value.message == "Too many concurrent requests (model tiny): the limit is 1."
    await held.release()  # the model's slot is given back with the lease
    # Neither the request nor the slot of the refused call was taken from the tenant.
    first = await new_limiter().acquire("acme", tenant, 10, (full,))
    await first.release()
    await new_limiter().acquire("acme", tenant, 10)


async def test_a_request_counted_at_entry_is_counted_against_its_model_at_admission(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    whole = model_scope(
        "tiny", TenantLimits(requests_per_minute=1, tokens_per_minute=10_000, max_concurrent=50)
    )
    lease = await new_limiter().enter("acme", WIDE)
    await lease.reserve(10, (whole,))
    later = await new_limiter().enter("globex", WIDE)
    with pytest.raises(APIError) as raised:
        await later.reserve(10, (whole,))
    assert raised.value.headers["x-ratelimit-scope"] == "model tiny"


async def test_the_rate_limit_headers_give_the_binding_scope_of_each_figure(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    few_requests = model_scope(
        "tiny", TenantLimits(requests_per_minute=5, tokens_per_minute=1_000_000, max_concurrent=50)
    )
    token_limits = TenantLimits(requests_per_minute=1000, tokens_per_minute=500, max_concurrent=50)
    few_tokens = tenant_model_scope("acme", "tiny", token_limits)
    limiter = new_limiter()
    lease = await limiter.acquire("acme", WIDE, 100, (few_requests, few_tokens))
    headers = dict(
        line.split(": ", 1) for line in lease.header_lines().decode().strip().split("\r\n")
    )
    assert headers["x-ratelimit-limit-requests"] == "5"
    assert headers["x-ratelimit-remaining-requests"] == "4"
    assert headers["x-ratelimit-scope-requests"] == "model tiny"
    assert headers["x-ratelimit-limit-tokens"] == "500"
    assert headers["x-ratelimit-remaining-tokens"] == "400"
    assert headers["x-ratelimit-scope-tokens"] == "tenant on model tiny"
    # Settled to what it used: every scope's tokens given back alike.
    await lease.settle(0)
    again = await limiter.acquire("acme", WIDE, 500, (few_tokens,))
    assert again.scope_left[0].tokens == 0


def test_policies_give_each_model_and_tenant_on_model_their_scopes(tmp_path: Path) -> None:
    policies = load_policies(
        write(
            tmp_path,
            tenants={"acme": {"model_limits": {"small": {"tokens_per_minute": 500}}}},
        )
    )
    models = policies.models
    (scope,) = model_scopes(policies, "acme", models["small"])
    assert (scope.key, scope.name) == ("{acme}:model:small", "tenant on model small")
    assert scope.limits.tokens_per_minute == 500
    assert scope.limits.requests_per_minute > 10**9  # unset: does not bound
    assert model_scopes(policies, "globex", models["small"]) == ()
    assert model_scopes(policies, "acme", models["large"]) == ()


def test_a_models_own_limits_are_its_scope(tmp_path: Path) -> None:
    directory = write(tmp_path)
    document = (directory / "models.yaml").read_text()
    (directory / "models.yaml").write_text(
        document.replace("  name: small\n", "  name: small\n  limits: {max_concurrent: 3}\n", 1)
    )
    policies = load_policies(directory)
    (scope,) = model_scopes(policies, "anyone", policies.models["small"])
    assert (scope.name, scope.limits.max_concurrent) == ("model small", 3)


def test_limits_on_a_model_that_does_not_exist_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as raised:
        load_policies(write(tmp_path, tenants={"acme": {"model_limits": {"huge": {}}}}))
    assert "tenants.yaml: tenants.acme.model_limits: no such model 'huge'" in str(raised.value)
