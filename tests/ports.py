"""Port ranges of the suites that pick fixed ports, split between pytest-xdist workers.

``make test`` runs two workers at once; a suite's range is cut into one share per worker, so
two workers never try the same port (a port that is free when checked can be taken before it
is bound).
"""

from __future__ import annotations

import os


def worker_share(first: int, end: int) -> range:
    """This worker's share of the ports ``first`` to ``end`` (exclusive); all of it alone."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = (end - first) // count
    return range(first + index * size, first + (index + 1) * size)
