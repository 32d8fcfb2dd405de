"""Refusing to load on an SGLang without the admission fix or with moved hook targets."""

from __future__ import annotations

import subprocess
from pathlib import Path

from engine_patch.compat import HookTarget, compatibility_problems, target_problems
from tests.engine_patch.fresh_interpreter import run_script


def test_installed_sglang_0_5_23_is_compatible():
    assert compatibility_problems() == []


def test_a_moved_hook_target_is_a_problem():
    problems = target_problems(
        (
            HookTarget(
                "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_moved_elsewhere"
            ),
            HookTarget(
                "sglang.srt.disaggregation.utils.MetadataBuffers.set_buf", ("self", "request")
            ),
        )
    )
    assert len(problems) == 2
    assert "missing" in problems[0]
    assert "expected ('self', 'request')" in problems[1]


def run_load_plugins(prelude: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Load the plugin through SGLang's own load_plugins, in a fresh interpreter."""
    script = (
        f"{prelude}\n"
        "from sglang.srt.plugins import load_plugins\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "load_plugins()\n"
        "print('PATCHED', len(HookRegistry._patched))\n"
    )
    return run_script(script, {"SGLANG_PLUGINS": "isogate"}, tmp_path)


def test_plugin_loads_through_sglang_and_applies_its_hooks(tmp_path: Path) -> None:
    done = run_load_plugins("", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PATCHED 15" in done.stdout  # 13, and the retraction backup and restore


def test_plugin_refuses_to_load_when_a_pd_door_lost_the_admission_fix(tmp_path: Path) -> None:
    done = run_load_plugins(
        "import sglang.srt.disaggregation.prefill as prefill\n"
        "prefill.is_unadmitted_reject = lambda req: False\n",
        tmp_path,
    )
    assert done.returncode != 0
    assert "PATCHED" not in done.stdout
    assert "refusing to load" in done.stderr
    assert (
        "sglang.srt.disaggregation.prefill does not use the upstream admission fix" in done.stderr
    )


def test_plugin_refuses_to_load_without_is_unadmitted_reject(tmp_path: Path) -> None:
    done = run_load_plugins(
        "import sglang.srt.disaggregation.utils as utils\ndel utils.is_unadmitted_reject\n",
        tmp_path,
    )
    assert done.returncode != 0
    assert "lacks the upstream admission fix" in done.stderr
