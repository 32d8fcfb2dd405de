"""A script run in a fresh SGLang interpreter, forked from one that imported SGLang already.

Loading a plugin through SGLang's own ``load_plugins`` patches SGLang's modules for the rest of
its process, so each test that does it needs a process of its own. Starting one means importing
torch and SGLang again, most of half a minute per test on a busy two-core host (beside the
gateway suite, whose clusters start meanwhile). A ``forkserver`` imports the SGLang modules
those scripts import, once; each script's process is forked from it, so it starts where a
fresh interpreter would be after those imports: nothing loaded, nothing patched. Neither
plugin is imported before the fork (each one's own import is part of what a test checks).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import warnings
from collections.abc import Mapping
from pathlib import Path

# What the scripts and both plugins import from SGLang; everything else they import is cheap.
PRELOAD = [
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.managers.io_struct",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.scheduler_components.output_streamer",
    "sglang.srt.mem_cache.common",
]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def run_script(
    script: str, env: Mapping[str, str], work_dir: Path, *, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    """``script`` as ``python -W ignore -c script`` would run it, with ``env`` added to the
    environment; its exit status and what it wrote to stdout and stderr."""
    out, err = work_dir / "stdout.txt", work_dir / "stderr.txt"
    process = _context.Process(target=_run, args=(script, dict(env), str(out), str(err)))
    process.start()
    process.join(timeout_s)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise TimeoutError(f"the script did not end within {timeout_s} s")
    return subprocess.CompletedProcess(
        ["<forked>", script], process.exitcode, out.read_text(), err.read_text()
    )


def _run(script: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    """In the forked process: the environment, stdout and stderr as files, then the script as
    ``__main__`` (an exception leaves exit status 1 and its traceback on stderr)."""
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    warnings.simplefilter("ignore")
    exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
