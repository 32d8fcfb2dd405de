"""The test-only incident-replay plugin: inert by default, undoes exactly the named fixes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_patch.fresh_interpreter import run_script

isogate_incident_replay = pytest.importorskip("isogate_incident_replay")

PROBE = (
    "from sglang.srt.plugins import load_plugins\n"
    "import sglang.srt.disaggregation.prefill as prefill, "
    "sglang.srt.disaggregation.decode as decode\n"
    "import sglang.srt.disaggregation.utils as utils\n"
    # Kept in a dict: SGLang's registry rebinds every module global that holds the original.
    "saved = {'fix': utils.is_unadmitted_reject, 'aborted': utils.is_aborted}\n"
    "load_plugins()\n"
    "print('admission_undone', prefill.is_unadmitted_reject is not saved['fix'], "
    "decode.is_unadmitted_reject is not saved['fix'])\n"
    "print('retire_undone', prefill.is_aborted is not saved['aborted'], "
    "utils.is_aborted is saved['aborted'])\n"
)


def probe(env: dict[str, str], tmp_path: Path) -> str:
    done = run_script(PROBE, {"SGLANG_PLUGINS": "isogate_incident_replay", **env}, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_inactive_without_the_test_switch(tmp_path: Path) -> None:
    out = probe({}, tmp_path)
    assert "admission_undone False False" in out
    assert "retire_undone False True" in out


def test_undoes_the_admission_fix_at_both_doors_and_prefills_retire_only(tmp_path: Path) -> None:
    out = probe({"ISOGATE_TEST_UNDO_ADMISSION_FIX": "1"}, tmp_path)
    assert "admission_undone True True" in out
    assert "retire_undone True True" in out  # only prefill's binding; utils keeps SGLang's


def test_can_undo_the_admission_fix_alone(tmp_path: Path) -> None:
    out = probe(
        {"ISOGATE_TEST_UNDO_ADMISSION_FIX": "1", "ISOGATE_TEST_UNDO_FIXES": "admission"}, tmp_path
    )
    assert "admission_undone True True" in out
    assert "retire_undone False True" in out
