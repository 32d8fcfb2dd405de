"""Fixtures for the security suite: one gateway process in front of stand-in workers per module,
and a tally of how many fuzz cases each test sent, with the worst loop lag and memory the
real-engine fuzzing saw (printed at the end of the run).

Each test's cases travel in its report's ``user_properties``, so that the tally is whole when
xdist workers ran the tests (the summary runs in the controller, which ran none)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from tests.reliability.stack import STANDIN_POOL_TOKENS, StandInStack, standin_stack
from tests.standin_worker import Behaviour

# Small enough that "huge body" cases are cheap to send, large enough for every honest case.
FUZZ_MAX_BODY_BYTES = 1024 * 1024

FUZZ_CASES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInStack]:
    # One token per answer: an honest reply to any max_tokens >= 1 (the default two-chunk stand-in
    # would rightly fail the gateway's token-count check when max_tokens is 1).
    honest = Behaviour(text_chunks=("Hi",), pool_tokens=STANDIN_POOL_TOKENS)
    with standin_stack(
        tmp_path_factory.mktemp("security"),
        behaviour=honest,
        env={"ISOGATE_MAX_BODY_BYTES": str(FUZZ_MAX_BODY_BYTES)},
    ) as running:
        yield running


@pytest.fixture(autouse=True)
def fuzz_cases_of_this_test(request: pytest.FixtureRequest) -> Iterator[None]:
    before = Counter(FUZZ_CASES)
    yield
    sent = FUZZ_CASES - before
    if sent:
        request.node.user_properties.append(("fuzz_cases", dict(sent)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tally: Counter[str] = Counter()
    figures: list[str] = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "teardown":
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == "fuzz_cases":
                    tally.update(value)
                elif name == "fuzz_figures":
                    figures.append(value)
    if tally:
        terminalreporter.section("fuzz cases sent to the gateway")
        for name, count in sorted(tally.items()):
            terminalreporter.write_line(f"{count:6d}  {name}")
        terminalreporter.write_line(f"{sum(tally.values()):6d}  total")
    if figures:
        terminalreporter.section("fuzzing on real SGLang: the invariants' worst, per test")
        for line in sorted(figures):
            terminalreporter.write_line(line)
