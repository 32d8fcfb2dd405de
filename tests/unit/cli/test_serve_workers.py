"""``isogate serve --workers``: how many gateway processes, and never several without Redis."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gateway.cli.main import main, worker_count
from gateway.config.settings import Settings


def test_without_redis_the_gateway_is_one_process() -> None:
    assert worker_count(None, redis_configured=False, cores=8) == 1


def test_an_empty_redis_url_is_no_redis_for_the_process_count_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It counted as Redis for the number of processes and as none for their claims: two
    # processes each holding half the pool, refusing after a 10 s wait what fit the whole.
    monkeypatch.setenv("ISOGATE_REDIS_URL", "")
    redis_url = Settings().redis_url
    assert redis_url is None
    assert worker_count(None, redis_configured=redis_url is not None, cores=8) == 1


def test_with_redis_the_default_is_one_process_per_core() -> None:
    assert worker_count(None, redis_configured=True, cores=8) == 8


def test_an_explicit_count_is_kept_when_redis_shares_the_claims() -> None:
    assert worker_count(2, redis_configured=True, cores=8) == 2
    assert worker_count(1, redis_configured=False, cores=8) == 1


def test_several_processes_without_redis_are_refused_naming_why() -> None:
    with pytest.raises(ValueError, match="needs Redis"):
        worker_count(2, redis_configured=False, cores=8)
    with pytest.raises(ValueError, match="at least 1"):
        worker_count(0, redis_configured=True, cores=8)


def test_serve_refuses_to_start_several_processes_without_redis(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ISOGATE_REDIS_URL", raising=False)
    monkeypatch.chdir("/")  # no .env here to configure one
    assert main(["serve", "--workers", "2"]) == 2
    assert "needs Redis" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_several_processes_share_a_metrics_directory_that_lives_as_long_as_the_run(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    for name in ("ISOGATE_METRICS_DIR", "ISOGATE_QUEUE_REPLICAS"):
        monkeypatch.setenv(name, "")  # restored (unset) when the test ends, whatever serve sets
        monkeypatch.delenv(name)
    monkeypatch.setenv("ISOGATE_REDIS_URL", "redis://127.0.0.1:1/0")  # never connected here
    seen: list[Path | None] = []

    def run(*args: Any, **kwargs: Any) -> None:
        directory = os.environ.get("ISOGATE_METRICS_DIR")
        seen.append(Path(directory) if directory else None)
        assert directory is None or Path(directory).is_dir()

    monkeypatch.setattr(uvicorn, "run", run)
    assert main(["serve", "--workers", str(workers)]) == 0
    (directory,) = seen
    if workers == 1:
        assert directory is None  # one process answers for itself, as it always did
    else:
        assert directory is not None and not directory.exists()  # gone with the run
