"""The log handler batches writes; a line is late by at most its flush interval, never lost or
reordered."""

from __future__ import annotations

import io
import logging
import time

import orjson

from gateway.observability.logs import (
    BatchingStreamHandler,
    GenerationIdFilter,
    JsonFormatter,
    current_generation_id,
)


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def _logger(handler: logging.Handler, name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger


def test_info_lines_are_written_together_after_the_interval_in_order() -> None:
    stream = CountingStream()
    log = _logger(BatchingStreamHandler(stream, flush_interval_s=0.2), "test.batching.order")
    for number in range(50):
        log.info("line %d", number)
    assert stream.getvalue() == ""  # nothing written per line
    deadline = time.monotonic() + 5
    while not stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream.getvalue().splitlines() == [f"line {n}" for n in range(50)]
    assert stream.writes == 1


def test_a_warning_is_written_at_once_after_the_lines_before_it() -> None:
    stream = CountingStream()
    log = _logger(BatchingStreamHandler(stream, flush_interval_s=60), "test.batching.warning")
    log.info("first")
    log.warning("something is wrong")
    assert stream.getvalue().splitlines() == ["first", "something is wrong"]


def test_flush_writes_what_is_pending_as_logging_shutdown_does_at_exit() -> None:
    stream = CountingStream()
    handler = BatchingStreamHandler(stream, flush_interval_s=60)
    log = _logger(handler, "test.batching.flush")
    log.info("pending")
    handler.flush()
    assert stream.getvalue() == "pending\n"


def test_a_full_batch_is_written_without_waiting() -> None:
    stream = CountingStream()
    log = _logger(
        BatchingStreamHandler(stream, flush_interval_s=60, max_pending=10), "test.batching.full"
    )
    for number in range(25):
        log.info("line %d", number)
    assert stream.getvalue().splitlines() == [f"line {n}" for n in range(20)]


def test_json_lines_carry_the_generation_id_of_the_request() -> None:
    stream = CountingStream()
    handler = BatchingStreamHandler(stream, flush_interval_s=60)
    handler.addFilter(GenerationIdFilter())
    handler.setFormatter(JsonFormatter())
    log = _logger(handler, "test.batching.json")
    token = current_generation_id.set("gen_01TEST")
    try:
        log.info("request finished", extra={"status": 200})
    finally:
        current_generation_id.reset(token)
    handler.flush()
    line = orjson.loads(stream.getvalue())
    assert line["generation_id"] == "gen_01TEST" and line["status"] == 200
    assert line["message"] == "request finished" and line["ts"].endswith("Z")
