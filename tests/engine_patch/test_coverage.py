"""Coverage and generation binding through the real MetadataBuffers and the real commit."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from sglang.srt.disaggregation.decode import DecodeTransferQueue
from sglang.srt.disaggregation.utils import is_unadmitted_reject
from sglang.srt.managers.schedule_batch import FINISH_ABORT

from engine_patch.coverage import (
    attest_after_set_buf,
    coverage_problem,
    read_attestation,
    verify_before_commit,
)
from engine_patch.identity import generation_fingerprint
from engine_patch.settings import EngineSettings
from tests.engine_patch.realparts import (
    DecodeSchedulerStandIn,
    make_decode_request,
    make_kv_pools,
    make_metadata_buffers,
    make_req,
    make_transfer_queue,
    preallocate,
    ship_metadata_row,
)

REAL_COMMIT = DecodeTransferQueue._commit_transfer_to_req
SETTINGS = EngineSettings()
PREFILL_SLOT, DECODE_SLOT = 1, 2


def prefill_sends(prefill_req, *, written: int, output_token: int = 77):
    """The prefill side of a last chunk: a forward wrote `written` tokens, set_buf runs, hooked."""
    buffers = make_metadata_buffers()
    prefill_req.metadata_buffer_index = PREFILL_SLOT
    prefill_req.extend_end = written
    prefill_req.output_ids.append(output_token)
    buffers.set_buf(prefill_req)
    attest_after_set_buf(None, buffers, prefill_req)
    return buffers


def decode_commits(
    decode_req_obj, prefill_buffers, *, reserved: int, settings: EngineSettings = SETTINGS
):
    scheduler = DecodeSchedulerStandIn(*make_kv_pools())
    preallocate(scheduler, decode_req_obj, reserved)
    decode_buffers = make_metadata_buffers()
    ship_metadata_row(prefill_buffers, decode_buffers, PREFILL_SLOT, DECODE_SLOT)
    queue = make_transfer_queue(scheduler, decode_buffers)
    decode_req = make_decode_request(decode_req_obj, DECODE_SLOT)
    verify_before_commit(settings, REAL_COMMIT, queue, decode_req)
    return decode_req, scheduler


def assert_failed_with_500(decode_req, reason_word: str) -> None:
    finished = decode_req.req.finished_reason
    assert isinstance(finished, FINISH_ABORT)
    assert finished.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert reason_word in finished.message
    assert decode_req.kv_receiver is None  # released like SGLang's own corruption abort
    assert list(decode_req.req.output_ids) == []  # nothing committed


def test_valid_request_is_committed_and_marked_verified():
    prefill_req = make_req("gen_valid", 40)
    buffers = prefill_sends(prefill_req, written=40)
    decode_req, _ = decode_commits(make_req("gen_valid", 40), buffers, reserved=40)
    assert decode_req.req.finished_reason is None
    assert list(decode_req.req.output_ids) == [77]
    assert decode_req.req.isolation_verified is True


def test_incident_stub_short_transfer_fails_with_500():
    # The September shape: prefill rejected the prompt at intake and replaced it
    # by a one-token stub; decode reserved the whole prompt.
    prefill_req = make_req("gen_incident", 2000)
    prefill_req.set_finish_with_abort("Input length exceeds the pool")
    assert is_unadmitted_reject(prefill_req)  # what 0.5.23's fix would have caught
    buffers = prefill_sends(prefill_req, written=1)
    decode_req, _ = decode_commits(make_req("gen_incident", 2000), buffers, reserved=2000)
    assert_failed_with_500(decode_req, "coverage_mismatch")
    assert "reserved 2000 tokens, prefill sent up to 1" in decode_req.req.finished_reason.message


def test_short_transfer_of_a_chunked_prefill_fails():
    prefill_req = make_req("gen_short", 64)
    buffers = prefill_sends(prefill_req, written=48)  # stopped one chunk short
    decode_req, _ = decode_commits(make_req("gen_short", 64), buffers, reserved=64)
    assert_failed_with_500(decode_req, "coverage_mismatch")


def test_metadata_of_a_foreign_generation_fails_even_with_the_same_room():
    buffers = prefill_sends(make_req("gen_other", 40, bootstrap_room=9), written=40)
    decode_req, _ = decode_commits(make_req("gen_mine", 40, bootstrap_room=9), buffers, reserved=40)
    assert_failed_with_500(decode_req, "foreign_generation")


def test_prefill_without_the_plugin_fails_closed():
    prefill_req = make_req("gen_plain", 40)
    buffers = make_metadata_buffers()
    prefill_req.metadata_buffer_index = PREFILL_SLOT
    prefill_req.output_ids.append(5)
    buffers.set_buf(prefill_req)  # SGLang's own set_buf, no attestation
    decode_req, _ = decode_commits(make_req("gen_plain", 40), buffers, reserved=40)
    assert_failed_with_500(decode_req, "no_attestation")


def test_freed_metadata_slot_carries_no_stale_attestation():
    prefill_req = make_req("gen_slot", 40)
    buffers = prefill_sends(prefill_req, written=40)
    assert read_attestation(buffers, PREFILL_SLOT) is not None
    buffers.clear_slot(PREFILL_SLOT)  # what pop_transferred does before freeing the slot
    assert read_attestation(buffers, PREFILL_SLOT) is None


def test_rebootstrapped_request_that_reenters_is_committed():
    # PD true-retraction: the request re-enters, prefill recomputes prompt + emitted
    # tokens, and decode reserves exactly that (DecodePreallocQueue._pre_alloc_fill_len).
    prompt, emitted = 30, 5
    prefill_req = make_req("gen_reenter", prompt + emitted)
    buffers = prefill_sends(prefill_req, written=prompt + emitted)
    decode_req_obj = make_req("gen_reenter", prompt)
    decode_req_obj.output_ids.extend([11, 12, 13, 14, 15])
    decode_req_obj.pd_rebootstrap_in_progress = True
    decode_req_obj.is_retracted = True
    decode_req, _ = decode_commits(decode_req_obj, buffers, reserved=prompt + emitted)
    assert decode_req.req.finished_reason is None
    assert decode_req.req.isolation_verified is True


def test_resource_holding_request_with_a_pending_abort_is_not_dropped_by_the_plugin():
    # "Abort method 3" marks a running request with to_finish; its queue owns the
    # release. The plugin judges the transfer, not the abort marker.
    prefill_req = make_req("gen_holding", 40)
    buffers = prefill_sends(prefill_req, written=40)
    decode_req_obj = make_req("gen_holding", 40)
    decode_req_obj.set_finish_with_abort("client went away")
    decode_req_obj.origin_input_ids = make_req("gen_holding", 40).origin_input_ids
    decode_req_obj.metadata_buffer_index = DECODE_SLOT
    assert not is_unadmitted_reject(decode_req_obj)  # holds a metadata slot
    decode_req, _ = decode_commits(decode_req_obj, buffers, reserved=40)
    assert decode_req.req.finished_reason is None  # the pending abort is SGLang's to finish
    assert decode_req.req.isolation_verified is True


def test_untagged_request_is_bound_by_its_rid():
    buffers = prefill_sends(make_req("plain-rid", 20, tenant=None), written=20)
    decode_req, _ = decode_commits(make_req("plain-rid", 20, tenant=None), buffers, reserved=20)
    assert decode_req.req.finished_reason is None


@pytest.mark.parametrize(
    ("sent_from", "sent_end", "written_end", "reserved", "prefix", "reason"),
    [
        (0, 40, 40, 40, 0, None),
        (16, 40, 40, 40, 16, None),  # decode held a 16-token prefix of its own
        (0, 1, 1, 2000, 0, "coverage_mismatch"),
        (0, 40, 32, 40, 0, "coverage_mismatch"),  # sent KV it never wrote
        (24, 40, 40, 40, 16, "coverage_gap"),  # [16, 24) written by nobody
        (0, 41, 41, 40, 0, "coverage_mismatch"),
    ],
)
def test_coverage_rule(sent_from, sent_end, written_end, reserved, prefix, reason):
    from engine_patch.coverage import Attestation

    generation = generation_fingerprint("gen_rule")
    attestation = Attestation(
        written_end=written_end, sent_from=sent_from, sent_end=sent_end, generation=generation
    )
    problem = coverage_problem(
        attestation, reserved_end=reserved, decode_prefix_len=prefix, generation=generation
    )
    assert (problem[0] if problem else None) == reason


def test_untagged_pd_halves_with_separate_rids_share_a_generation_by_bootstrap_room() -> None:
    """sglang_router mints one rid per worker; prefill and decode must still agree on who wrote."""
    from types import SimpleNamespace

    from engine_patch.identity import generation_of

    prefill_side = SimpleNamespace(rid="prefill-made-this", bootstrap_room=4242)
    decode_side = SimpleNamespace(rid="decode-made-that", bootstrap_room=4242)
    other_request = SimpleNamespace(rid="decode-made-that", bootstrap_room=4243)
    assert generation_of(prefill_side) == generation_of(decode_side)
    assert generation_of(decode_side) != generation_of(other_request)
    tagged = SimpleNamespace(rid="gen_x", bootstrap_room=1, isolation_generation="gen_x")
    assert generation_of(tagged) == "gen_x"
