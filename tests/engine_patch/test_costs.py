"""measure_costs() runs on the real classes and reports every figure the bench suite reads.

What it times must be the plugin's work, not a path around it: each hooked commit it times
is one the plugin verified (its coverage check ran and passed), and none was refused. The
figures themselves are timings, for ``make bench``; here they need only be there.
"""

from __future__ import annotations

import math

from bench.engine_patch_costs import measure_costs
from engine_patch.events import DECISIONS

FIGURES = {
    "prompt_tokens",
    "decode_batch",
    "tokenizer_tags_us",
    "prefill_attestation_us",
    "decode_commit_sglang_us",
    "decode_commit_plugin_extra_us",
    "first_decode_page_check_us",
    "decode_step_page_tagging_us",
}


def test_measure_costs_times_each_hook_on_the_real_classes_and_reports_every_figure():
    repeats = 3
    verified, refused = DECISIONS.verified, sum(DECISIONS.refused.values())
    costs = measure_costs(prompt_tokens=64, decode_batch=4, repeats=repeats)
    assert DECISIONS.verified - verified == repeats, "a timed commit was not verified"
    assert sum(DECISIONS.refused.values()) == refused, DECISIONS.refused
    assert set(costs) == FIGURES
    assert all(isinstance(v, float) and math.isfinite(v) for v in costs.values()), costs
    assert costs["prompt_tokens"] == 64 and costs["decode_batch"] == 4
