"""Workers that do not run engine_patch are never routed to while the model requires engine tags.

A stand-in plays the unpatched worker: it answers like SGLang but its ``/server_info`` carries
no ``isogate_engine_patch`` marker. Neither tenants' requests nor canary probes reach it; once
it publishes the marker, it is used.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.standin_worker import Behaviour
from tests.verification.stack import MODEL, POOL_TOKENS, LyingStack, lying_stack, wait_until

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say something."}],
    "max_tokens": 4,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingStack]:
    with lying_stack(
        tmp_path_factory.mktemp("unpatched"),
        env={"ISOGATE_CANARY_INTERVAL_S": "0.2"},
        decode=Behaviour(pool_tokens=POOL_TOKENS, engine_patch=None),
    ) as running:
        yield running


def test_a_decode_worker_without_engine_patch_is_never_routed_to(stack: LyingStack) -> None:
    _, key = stack.gateway.create_tenant()
    with stack.client(key) as client:
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "no_worker_available"
            assert "engine_patch" in response.json()["error"]["message"]
    assert (
        stack.decode.requests == [] and stack.prefill.requests == []
    )  # not even the canary prober's


def test_the_same_worker_is_used_once_it_runs_engine_patch(stack: LyingStack) -> None:
    _, key = stack.gateway.create_tenant()
    stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS)  # now publishes the marker
    try:
        with stack.client(key) as client:
            # /server_info is re-read every 10 s (CapacityRegistry.config_refresh_s); allow for a
            # busy machine.
            assert wait_until(
                lambda: client.post("/v1/chat/completions", json=CHAT).status_code == 200,
                timeout_s=30,
                interval_s=0.5,
            )
    finally:
        stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS, engine_patch=None)
    assert stack.decode.requests
