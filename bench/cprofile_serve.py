"""Run ``python -m gateway serve`` with cProfile switched on and off by signals.

Started by ``bench.python_calls`` as ``python bench/cprofile_serve.py OUT -m gateway serve ...``
(a script path, so the checkout being measured need not have it), in the measured checkout's
directory. SIGUSR1 switches the profiler on, SIGUSR2 switches it off and writes its statistics
to OUT: start-up and warm-up stay out of the count, as callgrind's toggles keep them out of
``bench.instructions``. Signal handlers run on the main thread, the one cProfile's hook is set
on; the clock is that thread's CPU time, so the tokenizer's threads are not charged to whatever
the event loop ran meanwhile.
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
import time
from types import FrameType


def main() -> None:
    out, flag, module, *rest = sys.argv[1:]
    if flag != "-m":
        raise SystemExit("usage: cprofile_serve.py OUT -m MODULE [ARG ...]")
    sys.argv = [module, *rest]
    sys.path[0] = os.getcwd()  # the measured checkout, not this script's folder
    profiler = cProfile.Profile(time.thread_time)

    def switch_on(_signum: int, _frame: FrameType | None) -> None:
        profiler.enable()

    def switch_off_and_write(_signum: int, _frame: FrameType | None) -> None:
        profiler.disable()
        profiler.dump_stats(out)

    signal.signal(signal.SIGUSR1, switch_on)
    signal.signal(signal.SIGUSR2, switch_off_and_write)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
