"""``isogate serve --workers``: how many gateway processes, and never several without Redis."""

from __future__ import annotations

import pytest

from gateway.cli.main import main, worker_count


def test_without_redis_the_gateway_is_one_process() -> None:
    assert worker_count(None, redis_configured=False, cores=8) == 1


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
