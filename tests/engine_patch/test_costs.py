"""measure_costs() runs on the real classes and reports every figure the bench suite reads."""

from __future__ import annotations

from bench.engine_patch_costs import measure_costs


def test_measure_costs_reports_positive_timings_for_each_hook():
    costs = measure_costs(prompt_tokens=64, decode_batch=4, repeats=3)
    for key in (
        "tokenizer_tags_us",
        "prefill_attestation_us",
        "decode_commit_sglang_us",
        "first_decode_page_check_us",
        "decode_step_page_tagging_us",
    ):
        assert costs[key] > 0, key
    assert costs["prompt_tokens"] == 64 and costs["decode_batch"] == 4
