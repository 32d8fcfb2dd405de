"""The log handler batches writes; a line is late by at most its flush interval, never lost or
reordered. Log files are readable by their owner only."""

from __future__ import annotations

import io
import logging
import os
import stat
import time
from pathlib import Path

import orjson

from gateway.dev.cluster import ManagedProcess
from gateway.observability import logs
from gateway.observability.logs import (
    BatchingStreamHandler,
    GenerationIdFilter,
    JsonFormatter,
    current_generation_id,
    open_log_file,
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


def test_an_idle_handler_leaves_its_flush_thread_asleep(monkeypatch) -> None:
    sleeps = 0
    sleep = time.sleep

    def counted(seconds: float) -> None:
        nonlocal sleeps
        sleeps += seconds == interval_s  # this handler's thread: no other sleeps this long
        sleep(seconds)

    interval_s = 0.0137
    monkeypatch.setattr(logs.time, "sleep", counted)
    stream = CountingStream()
    log = _logger(BatchingStreamHandler(stream, flush_interval_s=interval_s), "test.batching.idle")
    sleep(0.3)
    assert sleeps == 0  # no wake-up per interval with nothing pending
    log.info("after a quiet while")
    deadline = time.monotonic() + 5
    while not stream.getvalue() and time.monotonic() < deadline:
        sleep(0.01)
    assert stream.getvalue() == "after a quiet while\n"


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


# ---- log files: readable by their owner only, like the store ------------------------------


def test_a_new_log_file_is_created_0600_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "gateway.log"
    previous = os.umask(0o022)
    try:
        with open_log_file(path) as log:
            log.write(b"a line\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"a line\n"


def test_an_existing_log_file_is_narrowed_to_0600_and_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "gateway.log"
    path.write_bytes(b"before a restart\n")
    path.chmod(0o644)
    with open_log_file(path) as log:
        log.write(b"after\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"before a restart\nafter\n"


def test_the_dev_servers_log_files_are_0600(tmp_path: Path) -> None:
    """SGLang's and the gateway's logs under ``make run`` and the tests (they carry prompts at
    debug level, tenants and models always)."""
    process = ManagedProcess("echo", ["echo", "a line"], {}, tmp_path / "logs" / "server.log")
    process.start()
    assert process.wait(timeout_s=10) == 0
    assert stat.S_IMODE(process.log_path.stat().st_mode) == 0o600
