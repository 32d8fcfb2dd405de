"""One ``/metrics`` for every process of ``isogate serve --workers N``.

The N processes share one port, so a scrape reaches whichever accepts it. Each process writes
its own metric families (what ``/metrics`` says of it alone) to a file of its own in the run's
directory, on a timer and when it exits, replaced atomically; the process that answers a
scrape writes its own afresh, reads every file and renders them as one:

- counters and histograms (and summaries) are summed over every process, those that exited
  included (as prometheus_client's multiprocess mode keeps them), so they never go back;
  their ``_created`` series take the earliest;
- gauges come from live processes only, by ``GaugeRule``: ``livesum`` for what each process
  holds (queue lengths), ``livemax`` for the worst of any process (event loop lag), and
  ``mostrecent`` for the rest, the values every process reads from one shared source (a
  worker's capacity, the stored responses, the canary markers): the answering process's own,
  the freshest; never summed, which would count one worker's pool N times.

A scrape reads every process's latest file, and the answering one's is written for it, so a
later scrape never counts less than an earlier one, whichever processes answered them.

prometheus_client's own multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) is not used: it
keeps each library metric in a memory-mapped file, written on every ``inc``/``observe``, and
cannot hold the custom collectors that keep the per-request series as plain integers
(``gateway.observability.metrics``). Here the hot path is untouched; the cost is a collection
per process each interval, and what a process killed without warning counted since its last
file is lost. The files hold the families as JSON, not the text format: prometheus_client's
text parser took ten times as long as the collection it reads back.

The scrape leaves a mark (its time) in the directory, so a process knows when its last file
was read: its reset-when-read gauges (``LoopLagSeries``) carry a maximum until a scrape has
seen it, whichever process answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

GaugeRule = Literal["livesum", "livemax", "mostrecent"]
_Combine = Literal["sum", "min", "livesum", "livemax", "mostrecent"]

_LIVE_SUFFIX = ".json"  # a process still running (unless its pid is gone)
_EXITED_SUFFIX = ".exited"  # a process that wrote its last file on its way out
_MARK = "scraped"


Render = Callable[[], Iterable[Metric]]  # a process's own families, collected now


@dataclass(frozen=True)
class ProcessFamilies:
    """One process's file: its families, whether it still runs, when it was written."""

    families: list[Metric]
    live: bool
    written_at: float


def encode(families: Iterable[Metric]) -> bytes:
    """A process's families as its file holds them (``decode`` reads them back)."""
    return orjson.dumps(
        [
            [
                f.name,
                f.documentation,
                f.type,
                f.unit,
                [[s.name, s.labels, _number(s.value)] for s in f.samples],
            ]
            for f in families
        ]
    )


def decode(data: bytes) -> list[Metric]:
    families = []
    for name, documentation, type_, unit, samples in orjson.loads(data):
        family = Metric(name, documentation, type_, unit)
        family.samples = [Sample(n, labels, float(value)) for n, labels, value in samples]
        families.append(family)
    return families


def _number(value: float) -> float | str:
    # JSON has no infinities or NaN: those go as text that float() reads back.
    return value if math.isfinite(value) else repr(value)


def merge(processes: Sequence[ProcessFamilies], gauge_rules: Mapping[str, GaugeRule]) -> bytes:
    """The processes' families as one exposition (the module doc), in the newest one's order
    first."""
    families: dict[str, Metric] = {}
    # Each sample's values, newest process first, and how they combine.
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    rules: dict[tuple[str, str], _Combine] = {}
    for process in sorted(processes, key=lambda p: p.written_at, reverse=True):
        for family in process.families:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            into = values[family.name]
            for sample in family.samples:
                rule = rules.get((family.name, sample.name))
                if rule is None:
                    rule = rules[family.name, sample.name] = _combine(family, sample, gauge_rules)
                if process.live or rule in ("sum", "min"):
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    into.setdefault(key, []).append(sample.value)
    for name, merged in families.items():
        for (sample_name, labels), each in values[name].items():
            rule = rules[name, sample_name]
            merged.samples.append(Sample(sample_name, dict(labels), _COMBINE[rule](each)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def _combine(family: Metric, sample: Sample, gauge_rules: Mapping[str, GaugeRule]) -> _Combine:
    if family.name.endswith("_created") or sample.name.endswith("_created"):
        return "min"  # when the series began: the earliest process's
    if family.type in ("counter", "histogram", "summary", "gaugehistogram"):
        return "sum"
    if family.type == "gauge":
        return gauge_rules.get(family.name, "mostrecent")
    return "mostrecent"


# fsum: a sum rounded once, whatever the order the processes come in (the newest first, so
# the answering one's first): an idle gateway's float sums never move between scrapes, which
# a counter's rate would read as a reset.
_COMBINE: dict[_Combine, Callable[[list[float]], float]] = {
    "sum": math.fsum,
    "livesum": math.fsum,
    "min": min,
    "livemax": max,
    "mostrecent": operator.itemgetter(0),
}


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class ProcessMetrics:
    """This process's file in the run's directory (``directory``), and the whole gateway's
    exposition for a scrape (``scrape``). Each method that writes takes ``render``, this
    process's own families."""

    def __init__(
        self,
        directory: Path,
        gauge_rules: Mapping[str, GaugeRule],
        *,
        pid: int | None = None,
    ) -> None:
        self._directory = directory
        self._gauge_rules = gauge_rules
        # The pid says whether the process runs; the token keeps a reused pid's file apart.
        self._stem = f"{pid or os.getpid()}-{secrets.token_hex(4)}"
        self._path = directory / (self._stem + _LIVE_SUFFIX)
        self._lock = threading.Lock()  # the timer's write and a scrape's, in two threads
        self._last_written = 0.0

    def last_file_read(self) -> bool:
        """Whether a scrape has read this process's last file (or it wrote none yet)."""
        try:
            return float((self._directory / _MARK).read_text()) >= self._last_written
        except (OSError, ValueError):
            return self._last_written == 0.0

    def write(self, render: Render) -> None:
        with self._lock:
            self._write(render())

    def scrape(self, render: Render) -> bytes:
        """Every process's series as one: this one's rendered now, the others' last files."""
        with self._lock:
            self._write(render())
            # A file renamed into place before this moment is read below (or a newer one).
            _replace(self._directory / _MARK, repr(time.time()).encode())
            return merge(list(self._read_all()), self._gauge_rules)

    def close(self, render: Render) -> None:
        """The last file, renamed as an exited process's: its counters stay in every scrape."""
        with self._lock:
            try:
                self._write(render())
                os.replace(self._path, self._directory / (self._stem + _EXITED_SUFFIX))
            except OSError as exc:  # shutting down: the last timer's file stands
                log.warning("metrics: could not write %s on exit: %s", self._path, exc)

    async def run(self, render: Render, interval_s: float) -> None:
        """Write this process's file every ``interval_s`` until cancelled (off the loop: a
        collection walks every series)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await asyncio.to_thread(self.write, render)
            except Exception as exc:  # the next interval tries again; scrapes still answer
                log.warning("metrics: could not write %s: %s", self._path, exc)

    def _write(self, families: Iterable[Metric]) -> None:
        _replace(self._path, encode(families))
        self._last_written = time.time()

    def _read_all(self) -> Iterator[ProcessFamilies]:
        for path in self._directory.iterdir():
            exited = path.suffix == _EXITED_SUFFIX
            if not exited and path.suffix != _LIVE_SUFFIX:
                continue
            try:
                data, written_at = path.read_bytes(), path.stat().st_mtime
            except FileNotFoundError:  # exited since the listing: read under its new name
                path = path.with_suffix(_EXITED_SUFFIX)
                exited = True
                try:
                    data, written_at = path.read_bytes(), path.stat().st_mtime
                except FileNotFoundError:
                    continue
            if path == self._path:
                written_at = float("inf")  # this process's own: rendered for this scrape
            live = not exited and _running(int(path.name.split("-", 1)[0]))
            yield ProcessFamilies(decode(data), live, written_at)


def _replace(path: Path, content: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{threading.get_ident()}")
    temporary.write_bytes(content)
    os.replace(temporary, path)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: the signal's answer stands
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


@contextlib.contextmanager
def run_directory() -> Iterator[Path]:
    """A fresh directory for one ``serve`` run's processes, removed when the run ends: a new
    run's counters start at zero, as a restarted process's do."""
    with tempfile.TemporaryDirectory(prefix="isogate-metrics-") as directory:
        yield Path(directory)
