"""scripts/gpu-check, the parts that need no GPU: it writes its results to $OUT whatever
happens, refuses to run where there is no GPU, and makes the GPU-sized tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from gateway.dev.model import ensure_tiny_model
from tests.harness import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu-check"


def test_without_a_gpu_it_fails_preflight_and_says_so_in_out(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        import pytest

        pytest.skip("this machine has nvidia-smi")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    report = json.loads((out / "results.json").read_text())
    assert report["ok"] is False
    assert (
        report["stages"][0]["name"] == "preflight" and "nvidia-smi" in report["stages"][0]["detail"]
    )
    assert "preflight" in (out / "gpu-check.log").read_text()


def test_the_gpu_model_shares_the_dev_tokenizer_has_gpu_friendly_heads_and_no_weights(
    tmp_path: Path,
) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-only", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 64
    assert config["torch_dtype"] == "bfloat16"
    ours = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    dev = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    text = "Tenants share the machines but never each other's pages."
    assert ours.encode(text).ids == dev.encode(text).ids
    assert (tmp_path / "m" / "tokenizer_config.json").is_file()
    # Served with dummy weights: a weights file here would be the CPU model's, of other shapes.
    assert not list((tmp_path / "m").glob("*.safetensors"))
