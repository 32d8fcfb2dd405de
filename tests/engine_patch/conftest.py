"""Unit tests of engine_patch against the real SGLang 0.5.23 classes, on the CPU.

Run them in the engine venv: ``.venv-engine/bin/python -m pytest tests/engine_patch``.
In the gateway venv (no torch, no sglang) the whole directory is skipped.

The hooks are called directly with SGLang's real originals; nothing is
monkey-patched into SGLang in the test process (tests that need the plugin
loaded through SGLang's own ``load_plugins`` run it in a subprocess).
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sglang") is None:
    # The gateway venv: nothing here can run, and nothing here is collected.
    collect_ignore_glob = ["test_*.py"]
else:
    from sglang.srt.runtime_context import get_parallel

    # Req and the abort helpers read the tensor-parallel rank from SGLang's runtime
    # context; a lone test process is rank 0, as a single-GPU server is.
    get_parallel().override_permanently(tp_rank=0)
