"""The engine-bounds table against SGLang 0.5.23's own code, on the CPU (engine venv only).

Run them in the engine venv: ``.venv-engine/bin/python -m pytest tests/engine_bounds``. In the
gateway venv (no torch, no sglang) the whole directory is skipped.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
