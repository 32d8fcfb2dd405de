"""Policy reload without a restart: a file watch (polling mtimes, no new dependency) and SIGHUP.

Both paths end in ``PolicyReloader.reload``: the files are read and validated off the event
loop, then adopted on it with ``Components.apply_policies`` (policies and tokenizers swap
together, so a request never sees one without the other). A file that fails validation, or
a model whose tokenizer cannot be loaded, is refused with one ERROR line naming the file
and the problem; the policies in force stay in force.

The watch adopts a change only once the files' fingerprint has been the same for two polls
in a row, so a file caught half-written by an editor or ``kubectl cp`` is not read.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config.policies import Policies, PolicyError, load_policies
from gateway.service.components import Components

log = logging.getLogger("isogate.reload")

POLICY_FILES = ("models.yaml", "tenants.yaml")
POLL_INTERVAL_S = 1.0

# (name, mtime_ns, size, inode) per policy file; None where the file is missing.
Fingerprint = tuple[tuple[str, int, int, int] | None, ...]


def fingerprint(directory: Path) -> Fingerprint:
    """What changes when a policy file is edited, replaced (rename, symlink swap) or removed."""
    marks: list[tuple[str, int, int, int] | None] = []
    for name in POLICY_FILES:
        try:
            stat = (directory / name).stat()  # follows symlinks: a ConfigMap's ..data swap shows
        except FileNotFoundError:
            marks.append(None)
            continue
        marks.append((name, stat.st_mtime_ns, stat.st_size, stat.st_ino))
    return tuple(marks)


@dataclass
class PolicyReloader:
    components: Components
    poll_interval_s: float = POLL_INTERVAL_S
    _applied: Fingerprint = ()
    _task: asyncio.Task[None] | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _sighup_installed: bool = False

    @property
    def directory(self) -> Path:
        return self.components.settings.policies_dir

    def start(self) -> None:
        """Start the file watch and take SIGHUP (on the running loop)."""
        self._applied = fingerprint(self.directory)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._watch(), name="policy-watch")
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup_installed = True
        except (NotImplementedError, RuntimeError, ValueError):
            # Not the main thread (an embedded app) or no signals here: the file watch still runs.
            log.warning(
                "SIGHUP reload not available in this process; the policy file watch still runs"
            )

    async def stop(self) -> None:
        if self._sighup_installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup_installed = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _on_sighup(self) -> None:
        log.info("SIGHUP received: reloading policies", extra={"event": "policy_reload_requested"})
        asyncio.get_running_loop().create_task(self.reload("SIGHUP"), name="policy-reload-sighup")

    async def _watch(self) -> None:
        previous = self._applied
        while True:
            await asyncio.sleep(self.poll_interval_s)
            current = await asyncio.to_thread(fingerprint, self.directory)
            # Act on a change only once it has stopped changing (one full poll interval).
            if current != self._applied and current == previous:
                await self.reload("file change", current)
            previous = current

    async def reload(self, reason: str, seen: Fingerprint | None = None) -> bool:
        """Load, validate and adopt the policy files.

        False (and the old policies kept) if they are refused.
        """
        async with self._lock:
            seen = (
                seen if seen is not None else await asyncio.to_thread(fingerprint, self.directory)
            )
            # Recorded before trying: a refused file is reported once, not on every poll.
            self._applied = seen
            old = self.components.policies
            started = time.perf_counter()
            try:
                new = await asyncio.to_thread(load_policies, self.directory)
                self.components.apply_policies(new)
            except PolicyError as exc:
                self._refused(reason, str(exc), old)
                return False
            except Exception as exc:  # e.g. a tokenizer directory that cannot be read
                self._refused(reason, f"{type(exc).__name__}: {exc}", old)
                return False
            log.info(
                "policies reloaded (%s): models %s",
                reason,
                ", ".join(sorted(new.models)) or "(none)",
                extra={
                    "event": "policy_reloaded",
                    "trigger": reason,
                    "models": sorted(new.models),
                    "previous_models": sorted(old.models),
                    "duration_ms": round((time.perf_counter() - started) * 1000.0, 1),
                },
            )
            return True

    def _refused(self, reason: str, problem: str, kept: Policies) -> None:
        log.error(
            "policy reload refused (%s): %s; the previous policies stay in force (models %s)",
            reason,
            problem,
            ", ".join(sorted(kept.models)),
            extra={
                "event": "policy_reload_refused",
                "trigger": reason,
                "problem": problem,
                "models": sorted(kept.models),
            },
        )
