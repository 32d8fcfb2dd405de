"""Coverage and generation binding, carried in the per-request transfer metadata.

Prefill writes an attestation into spare slots of the request's row of
``MetadataBuffers.bootstrap_room`` (uint64, 8 wide, slot 0 is SGLang's
bootstrap room). The row travels with the last KV chunk, and SGLang's
``clear_slot`` zeroes the whole row when the slot is freed, so a stale
attestation never survives into the next owner of the slot.

Decode reads it before ``DecodeTransferQueue._commit_transfer_to_req`` commits
the request and fails it with HTTP 500 unless prefill sent exactly the range
decode reserved, wrote all of it, and did so for this generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from sglang.srt.disaggregation.utils import _is_fake_transfer, prepare_abort
from sglang.srt.managers.schedule_batch import FINISH_ABORT

from engine_patch import page_tags
from engine_patch.events import DECISIONS
from engine_patch.identity import generation_fingerprint, generation_of
from engine_patch.settings import EngineSettings

SLOT_MAGIC = 1
SLOT_WRITTEN_END = 2
SLOT_SENT_FROM = 3
SLOT_SENT_END = 4
SLOT_GENERATION = 5
# "ISOGATT1": marks a row as carrying an attestation (0 = prefill wrote none).
ATTESTATION_MAGIC = 0x4953_4F47_4154_5431


@dataclass(frozen=True)
class Attestation:
    """What prefill claims about one request's KV handoff, in token positions."""

    written_end: int  # KV of [0, written_end) exists on prefill (cache hit + forward)
    sent_from: int  # first position prefill sent (decode holds the prefix before it)
    sent_end: int  # prefill sent [sent_from, sent_end)
    generation: int  # fingerprint of the generation it was written for


def attestation_for(req: Any) -> Attestation:
    """Prefill side: the same range ``_send_kv_chunk`` sends on the last chunk."""
    written_end = int(req.extend_end or 0)
    return Attestation(
        written_end=written_end,
        sent_from=int(req.disagg_decode_prefix_len or 0),
        sent_end=min(written_end, len(req.origin_input_ids)),
        generation=generation_fingerprint(generation_of(req)),
    )


def write_attestation(metadata_buffers: Any, index: int, attestation: Attestation) -> None:
    row = metadata_buffers.bootstrap_room[index]
    row[SLOT_WRITTEN_END] = attestation.written_end
    row[SLOT_SENT_FROM] = attestation.sent_from
    row[SLOT_SENT_END] = attestation.sent_end
    row[SLOT_GENERATION] = attestation.generation
    # Last, so a half-written row never reads as attested.
    row[SLOT_MAGIC] = ATTESTATION_MAGIC


def read_attestation(metadata_buffers: Any, index: int) -> Attestation | None:
    values = [int(v) for v in metadata_buffers.bootstrap_room[index].tolist()]
    if values[SLOT_MAGIC] != ATTESTATION_MAGIC:
        return None
    return Attestation(
        written_end=values[SLOT_WRITTEN_END],
        sent_from=values[SLOT_SENT_FROM],
        sent_end=values[SLOT_SENT_END],
        generation=values[SLOT_GENERATION],
    )


def coverage_problem(
    attestation: Attestation | None,
    *,
    reserved_end: int,
    decode_prefix_len: int,
    generation: int,
) -> tuple[str, str] | None:
    """(reason, detail) when decode must not read what it received, else None."""
    if attestation is None:
        return (
            "no_attestation",
            "prefill sent no isogate attestation (engine_patch not loaded on prefill?)",
        )
    if attestation.generation != generation:
        return (
            "foreign_generation",
            f"metadata was written for generation fingerprint {attestation.generation:#x}, "
            f"this request is {generation:#x}",
        )
    if attestation.sent_end != reserved_end:
        return (
            "coverage_mismatch",
            f"decode reserved {reserved_end} tokens, prefill sent up to {attestation.sent_end}",
        )
    if attestation.written_end < attestation.sent_end:
        return (
            "coverage_mismatch",
            f"prefill sent up to {attestation.sent_end} but wrote only {attestation.written_end}",
        )
    if attestation.sent_from > decode_prefix_len:
        return (
            "coverage_gap",
            f"prefill sent from {attestation.sent_from}, decode holds only {decode_prefix_len}",
        )
    return None


def attest_after_set_buf(result: Any, metadata_buffers: Any, req: Any) -> Any:
    """AFTER MetadataBuffers.set_buf (prefill, last chunk): write the attestation."""
    write_attestation(metadata_buffers, req.metadata_buffer_index, attestation_for(req))
    return result


def verify_before_commit(
    settings: EngineSettings, original: Any, transfer_queue: Any, decode_req: Any
) -> None:
    """AROUND DecodeTransferQueue._commit_transfer_to_req (decode)."""
    req = decode_req.req
    if _is_fake_transfer(req):
        original(transfer_queue, decode_req)  # returns None
        return None
    attestation = read_attestation(
        transfer_queue.metadata_buffers, decode_req.metadata_buffer_index
    )
    if settings.coverage_check:
        problem = coverage_problem(
            attestation,
            reserved_end=int(req.kv.kv_committed_len),
            decode_prefix_len=int(req.kv.cache_protected_len),
            generation=generation_fingerprint(generation_of(req)),
        )
        if problem is not None:
            reason, detail = problem
            fail_request(req, reason, detail)
            # As SGLang's own metadata-corruption abort does: pop_transferred
            # then streams the error and releases the pages and the slot.
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None
            return None
    original(transfer_queue, decode_req)
    if isinstance(req.finished_reason, FINISH_ABORT):
        return None
    if settings.page_check and attestation is not None:
        page_tags.mark_transferred(
            transfer_queue.scheduler, req, attestation.sent_from, attestation.sent_end
        )
    req.isogate_pages_checked = False
    # With the check on, coverage_problem refused a missing attestation above.
    if settings.coverage_check and attestation is not None:
        req.isolation_verified = True
        DECISIONS.record_verified(
            req.rid,
            f"coverage=[{attestation.sent_from},{attestation.sent_end}) "
            f"reserved={req.kv.kv_committed_len}",
        )
    return None


def fail_request(req: Any, reason: str, detail: str) -> None:
    """Abort with a server error: SGLang answers status_code=None aborts with 200."""
    prepare_abort(
        req,
        f"isolation check failed ({reason}): {detail}",
        status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
    )
    DECISIONS.record_refused(reason, req.rid, detail)
