"""Run ``python -m gateway serve`` with cProfile, or an opcode counter, switched on and off by
signals.

Started by ``bench.python_calls`` as ``python bench/cprofile_serve.py OUT [--opcodes] -m gateway
serve ...`` (a script path, so the checkout being measured need not have it), in the measured
checkout's directory. SIGUSR1 switches the count on, SIGUSR2 switches it off and writes it to
OUT: start-up and warm-up stay out of the count, as callgrind's toggles keep them out of
``bench.instructions``. Signal handlers run on the main thread, the one the hook is set on.

cProfile's clock is that thread's CPU time, so the tokenizer's threads are not charged to
whatever the event loop ran meanwhile. ``--opcodes`` counts instead the bytecode instructions
each Python function executed (``sys.settrace`` with ``f_trace_opcodes``), with its calls,
written as JSON (``"file:line:qualname": [opcodes, calls]``): exact and the same on every run,
where the profiler's microseconds inflate cheap calls; the interpreter's share of a CPU
difference is roughly proportional to it.
"""

from __future__ import annotations

import collections
import cProfile
import json
import os
import runpy
import signal
import sys
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any


def opcode_counter(out: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """Switch-on and switch-off-and-write for counting opcodes per code object."""
    opcodes: collections.Counter[CodeType] = collections.Counter()
    calls: collections.Counter[CodeType] = collections.Counter()

    def in_frame(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "opcode":
            opcodes[frame.f_code] += 1
        return in_frame

    def on_call(frame: FrameType, event: str, _arg: Any) -> Any:
        frame.f_trace_opcodes = True
        calls[frame.f_code] += 1  # a call, or a generator or coroutine resumed
        return in_frame

    def write() -> None:
        sys.settrace(None)
        counts = {
            f"{code.co_filename}:{code.co_firstlineno}:{code.co_qualname}": [n, calls[code]]
            for code, n in opcodes.items()
        }
        with open(out, "w") as file:
            json.dump(counts, file)

    return lambda: sys.settrace(on_call), write


def profiler_switches(out: str) -> tuple[Callable[[], None], Callable[[], None]]:
    profiler = cProfile.Profile(time.thread_time)

    def write() -> None:
        profiler.disable()
        profiler.dump_stats(out)

    return profiler.enable, write


def main() -> None:
    out, *args = sys.argv[1:]
    switches = profiler_switches
    if args[:1] == ["--opcodes"]:
        switches, args = opcode_counter, args[1:]
    if len(args) < 2 or args[0] != "-m":
        raise SystemExit("usage: cprofile_serve.py OUT [--opcodes] -m MODULE [ARG ...]")
    module, rest = args[1], args[2:]
    sys.argv = [module, *rest]
    sys.path[0] = os.getcwd()  # the measured checkout, not this script's folder
    switch_on, switch_off_and_write = switches(out)
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: switch_on())
    signal.signal(signal.SIGUSR2, lambda _signum, _frame: switch_off_and_write())
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
