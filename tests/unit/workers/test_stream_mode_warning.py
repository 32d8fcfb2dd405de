"""A decode worker that repeats its whole output in every stream chunk is named in the log.

The gateway reads such a worker's streams (``IncrementalChunks``), but parses everything a
stream holds so far at every token; the operator learns which worker to restart with
``--incremental-streaming-output``, once, not at every poll.
"""

from __future__ import annotations

import logging

import pytest

from gateway.workers.capacity import CapacityRegistry
from tests.standin_worker import StandInWorker

pytestmark = pytest.mark.anyio


async def test_a_decode_worker_that_repeats_its_output_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The stand-in answers /server_info as SGLang 0.5.23 does by default (tests/data).
    with StandInWorker("decode") as decode, StandInWorker("prefill") as prefill:
        registry = CapacityRegistry(poll_interval_s=600, stale_after_s=5, config_refresh_s=0)
        registry.set_workers([(decode.url, "decode"), (prefill.url, "prefill")])
        try:
            with caplog.at_level(logging.WARNING, logger="gateway.workers.capacity"):
                for _ in range(3):  # the configuration fetched anew each time
                    await registry.refresh()
        finally:
            await registry.close()
        state = registry.get(decode.url)
    assert state is not None and state.incremental_streams is False
    warned = [
        r.getMessage() for r in caplog.records if "--incremental-streaming-output" in r.getMessage()
    ]
    assert len(warned) == 1 and decode.url in warned[0] and prefill.url not in warned[0]
