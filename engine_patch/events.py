"""What the plugin decided, as counters and one log line per decision.

Every line starts with ``isogate-engine:`` so tests and operators can grep a
worker's log; each carries the running total of its kind in this process. When
SGLang runs with ``--enable-metrics`` the same counts are exported as
Prometheus counters (SGLang's multiprocess collector gathers the scheduler's).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger("isogate.engine")

LOG_PREFIX = "isogate-engine:"


class DecisionCounter:
    """Per-process counts of verified and refused requests, by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.verified = 0
        self.refused: Counter[str] = Counter()
        self._prometheus: Any = None

    def record_verified(self, rid: str, detail: str) -> None:
        with self._lock:
            self.verified += 1
            total = self.verified
        logger.info("%s verified rid=%s verified_total=%d %s", LOG_PREFIX, rid, total, detail)
        metrics = self._metrics()
        if metrics is not None:
            metrics[0].inc()

    def record_refused(self, reason: str, rid: str | None, detail: str) -> None:
        with self._lock:
            self.refused[reason] += 1
            total = sum(self.refused.values())
        logger.error(
            "%s refused reason=%s rid=%s refused_total=%d %s",
            LOG_PREFIX,
            reason,
            rid,
            total,
            detail,
        )
        metrics = self._metrics()
        if metrics is not None:
            metrics[1].labels(reason=reason).inc()

    def _metrics(self) -> Any:
        # Created lazily: prometheus_client decides single- vs multi-process mode
        # when a metric is created, and SGLang sets PROMETHEUS_MULTIPROC_DIR only
        # once the server starts, after plugins were imported.
        if self._prometheus is None:
            if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                return None
            try:
                from prometheus_client import Counter as PromCounter
            except ImportError:
                return None
            self._prometheus = (
                PromCounter(
                    "isogate_engine_requests_verified",
                    "Requests whose KV coverage and binding the isogate plugin verified",
                ),
                PromCounter(
                    "isogate_engine_requests_refused",
                    "Requests the isogate plugin failed, by reason",
                    ["reason"],
                ),
            )
        return self._prometheus


# One per process: the scheduler, the tokenizer and the detokenizer each count
# their own decisions.
DECISIONS = DecisionCounter()
