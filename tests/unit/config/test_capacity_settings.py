"""The capacity poll must renew a worker's record before it goes stale: a setting that lets it
go stale between two polls would have the gateway refuse every request for part of every
interval, so it is refused at startup, with its reason and not a traceback."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.cli.main import main
from gateway.config.settings import Settings


@pytest.mark.parametrize(("poll_s", "stale_s"), [(30.0, 5.0), (2.5, 5.0), (1.0, 0.5)])
def test_a_poll_interval_that_lets_capacity_go_stale_between_polls_is_refused(
    poll_s: float, stale_s: float
) -> None:
    with pytest.raises(ValidationError, match="more than twice ISOGATE_CAPACITY_POLL_INTERVAL_S"):
        Settings(capacity_poll_interval_s=poll_s, capacity_stale_after_s=stale_s)


@pytest.mark.parametrize(("poll_s", "stale_s"), [(1.0, 5.0), (2.4, 5.0), (0.5, 1.5), (60.0, 300.0)])
def test_a_poll_interval_within_half_the_staleness_window_is_taken(
    poll_s: float, stale_s: float
) -> None:
    settings = Settings(capacity_poll_interval_s=poll_s, capacity_stale_after_s=stale_s)
    assert (settings.capacity_poll_interval_s, settings.capacity_stale_after_s) == (poll_s, stale_s)


def test_serve_refuses_to_start_on_a_bad_setting_with_its_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the gateway started")

    monkeypatch.setattr("uvicorn.run", started)
    monkeypatch.setenv("ISOGATE_CAPACITY_POLL_INTERVAL_S", "30")
    monkeypatch.setenv("ISOGATE_CAPACITY_STALE_AFTER_S", "5")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("isogate: refusing to start:")
    assert "ISOGATE_CAPACITY_STALE_AFTER_S (5 s)" in err
    assert "Traceback" not in err
