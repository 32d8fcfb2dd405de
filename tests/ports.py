"""Port ranges of the suites that pick fixed ports, split between pytest-xdist workers.

``make test`` runs two workers at once; a suite's range is cut into one share per worker, so
two workers never try the same port (a port that is free when checked can be taken before it
is bound).

Every fixed port lies below the kernel's ephemeral range (32768 and up on Linux): there the
kernel hands out the local ends of outgoing connections (to Redis, PostgreSQL, a worker), and
one of them can take a port between the check that it is free and the bind.
"""

from __future__ import annotations

import os
from pathlib import Path


def worker_share(first: int, end: int) -> range:
    """This worker's share of the ports ``first`` to ``end`` (exclusive); all of it alone."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = (end - first) // count
    return range(first + index * size, first + (index + 1) * size)


def ephemeral_range() -> range:
    """The kernel's range for the local ends of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except OSError:
        return range(32768, 61000)
    return range(int(low), int(high) + 1)
