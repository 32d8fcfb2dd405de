"""The command line of a side-by-side micro benchmark (``held_bench``, ``timer_bench``): two ways
of doing one thing, interleaved in every round in one process; prints the measurement's JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable


def run(
    argv: list[str] | None,
    description: str | None,
    count_flag: str,
    count_default: int,
    measure: Callable[[int, int], dict[str, float]],
) -> int:
    """Parse ``--rounds`` and the count of operations per round (``count_flag``), then print
    ``measure(rounds, count)`` as JSON."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(count_flag, type=int, default=count_default)
    args = parser.parse_args(argv)
    count = getattr(args, count_flag.lstrip("-").replace("-", "_"))
    print(json.dumps(measure(args.rounds, count)))
    return 0
