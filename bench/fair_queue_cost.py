"""Instructions one free slot of the fair queue costs: a take and its release, with nobody waiting.

Every request goes through ``FairQueue.take_free`` and ``Slot.release`` (``gateway.core.pair_queues``),
and at the bench's load none waits, so this path is what the queue adds to a request. Counted
by valgrind's callgrind (the same for the same code, whatever else the machine does): a process
making ``--takes`` takes and releases, less one making none, divided by ``--takes``. Eight slots
are held throughout by one tenant, as at 16 in flight (the contended cap is below that, so the
cap that holds is looked up as under load).

    .venv/bin/python -m bench.fair_queue_cost [--takes 20000]

Needs valgrind (Debian package valgrind).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from core.fair_queue import FairQueue

from gateway.config.policies import Share
from gateway.observability.metrics import Metrics

_TOTAL = re.compile(rb"I\s+refs:\s+([\d,]+)")


def take_and_release(takes: int) -> None:
    queue = FairQueue(
        1_000_000,
        contended_capacity=2,
        linger_s=1.0,
        max_queued_per_tenant=256,
        observer=Metrics().queue_observer("pool"),
    )
    share = Share("tenant")
    held = [queue.take_free(share) for _ in range(8)]
    assert all(held)
    for _ in range(takes):
        slot = queue.take_free(share)
        assert slot is not None
        slot.release()


def instructions(takes: int) -> int:
    """The instructions of a whole process that makes ``takes`` takes and releases."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "bench.fair_queue_cost",
            "--inside",
            str(takes),
        ],
        capture_output=True,
        check=True,
    )
    found = _TOTAL.search(run.stderr)
    assert found is not None, run.stderr[-2000:]
    return int(found.group(1).replace(b",", b""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--takes", type=int, default=20_000)
    parser.add_argument("--inside", type=int, help=argparse.SUPPRESS)  # the measured process
    args = parser.parse_args(argv)
    if args.inside is not None:
        take_and_release(args.inside)
        return 0
    per_take = (instructions(args.takes) - instructions(0)) / args.takes
    print(f"fair queue, a free take and its release: {per_take / 1000:.1f} k instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
