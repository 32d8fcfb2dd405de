"""How an engine's finish is read: a limit is a normal finish with its reason, an abort is what
it says it is, and a constrained output is judged complete only where nothing but its own end
could have stopped it (``core.generation.finish_reason_of`` and ``cut_short``)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.common.errors import APIError
from gateway.core.generation import cut_short, finish_reason_of
from gateway.verification.verify import IsolationFailure


def meta(reason: Any) -> dict[str, Any]:
    return {"finish_reason": reason}


@pytest.mark.parametrize(
    ("reason", "finish"),
    [
        ({"type": "length", "length": 8}, "length"),
        ({"type": "stop", "matched": 1}, "stop"),
        ({"type": "stop", "matched": "\n"}, "stop"),
        # An abort without an error status: asked for (SGLang's /abort_request), a normal end.
        ({"type": "abort", "message": "Abort in waiting queue", "status_code": None}, "abort"),
        ({"type": "abort"}, "abort"),
    ],
)
def test_a_limit_or_an_asked_for_abort_is_a_normal_finish(reason: Any, finish: str) -> None:
    assert finish_reason_of(meta(reason)) == finish


@pytest.mark.parametrize(
    ("status", "code", "answer"),
    [(400, "engine_rejected", 400), (503, "worker_unavailable", 503), (500, "upstream_error", 502)],
)
def test_an_abort_with_an_error_status_is_that_error_not_an_isolation_alarm(
    status: int, code: str, answer: int
) -> None:
    reason = {"type": "abort", "message": "Grammar accept_token failed", "status_code": status}
    with pytest.raises(APIError) as failed:
        finish_reason_of(meta(reason))
    assert (failed.value.status, failed.value.code) == (answer, code)
    assert "Grammar" not in failed.value.message  # the engine's text is the operators'


def test_the_engines_own_isolation_refusal_is_an_isolation_failure() -> None:
    reason = {
        "type": "abort",
        "message": "isolation check failed (foreign_page): page 7 written by another request",
        "status_code": 500,
    }
    with pytest.raises(IsolationFailure):
        finish_reason_of(meta(reason))


@pytest.mark.parametrize(
    ("reason", "sampling", "cut"),
    [
        ({"type": "length", "length": 8}, {}, True),
        ({"type": "abort"}, {}, True),
        ({"type": "stop", "matched": "}"}, {"stop": ["}"]}, True),  # the client's stop string
        ({"type": "stop", "matched": 7}, {"stop_token_ids": [7]}, True),  # the client's stop id
        ({"type": "stop", "matched": 1}, {"no_stop_trim": True}, True),  # EOS kept in the text
        ({"type": "stop", "matched": 1}, {}, False),  # EOS: the grammar's own end
        ({"type": "stop", "matched": 1}, {"stop_token_ids": [7]}, False),
        ({"type": "stop"}, {}, False),
    ],
)
def test_an_output_is_cut_short_only_by_a_limit_the_client_set(
    reason: dict[str, Any], sampling: dict[str, Any], cut: bool
) -> None:
    assert cut_short(meta(reason), sampling) is cut
