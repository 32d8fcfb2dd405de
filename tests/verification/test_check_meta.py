"""``check_meta`` in-process: each field of the engine's ``meta_info`` that can betray a foreign
answer."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.verification.verify import Expectation, IsolationFailure, check_meta

GEN, TENANT = "gen_01KB0000000000000000000000", "tenant-a"
EXPECTED = Expectation(GEN, TENANT, prompt_tokens=11, max_tokens=8, require_tags=True)


def meta(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": GEN,
        "prompt_tokens": 11,
        "completion_tokens": 8,
        "cached_tokens": 10,
        "isolation_generation": GEN,
        "isolation_tenant": TENANT,
        "isolation_verified": True,
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def test_an_honest_meta_info_passes() -> None:
    check_meta(meta(), EXPECTED)
    check_meta(
        meta(isolation_verified=...), EXPECTED
    )  # an engine that does not report the attestation
    check_meta(
        meta(isolation_generation=..., isolation_tenant=...), Expectation(GEN, TENANT, 11, 8, False)
    )


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"id": "gen_01KB0000000000000000000001"}, "meta_info.id"),
        ({"id": ...}, "meta_info.id"),
        ({"isolation_generation": "gen_01KB0000000000000000000001"}, "another generation ID"),
        ({"isolation_generation": ...}, "did not echo the generation ID"),
        ({"isolation_tenant": "tenant-b"}, "another tenant"),
        ({"isolation_tenant": ...}, "did not echo the tenant"),
        ({"isolation_verified": False}, "coverage"),
        ({"prompt_tokens": 10}, "prompt tokens"),
        ({"prompt_tokens": 12}, "prompt tokens"),
        ({"prompt_tokens": ...}, "prompt tokens"),
        ({"completion_tokens": 9}, "completion_tokens"),
        ({"completion_tokens": -1}, "completion_tokens"),
        ({"completion_tokens": "8"}, "completion_tokens"),
        ({"cached_tokens": 12}, "cached_tokens"),
        ({"cached_tokens": -1}, "cached_tokens"),
    ],
)
def test_each_lie_fails_with_its_reason(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(IsolationFailure, match=reason):
        check_meta(meta(**changes), EXPECTED)


def test_a_missing_meta_info_fails() -> None:
    with pytest.raises(IsolationFailure, match="no meta_info"):
        check_meta(None, EXPECTED)
