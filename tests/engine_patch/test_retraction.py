"""Page checks across a decode retraction and its restore, on SGLang's real Req, KV pool and
allocator: the host backup is SGLang's own ``Req.offload_kv_cache`` / ``load_kv_cache``, each
called through the plugin's hook as the scheduler would (``cpu_tensor`` backup, what decode
runs with priority preemption on)."""

from __future__ import annotations

import logging

import pytest
import torch
from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from engine_patch.identity import req_fingerprints
from engine_patch.page_tags import (
    check_before_backup,
    check_pages_before_first_decode,
    mark_restored,
    mark_transferred,
    problem_before_first_decode,
    table_for,
)
from tests.engine_patch.realparts import DecodeSchedulerStandIn, make_req, preallocate

TOKENS = 512


def decode_worker() -> DecodeSchedulerStandIn:
    """A decode worker's pools with a real (tiny) KV cache behind the allocator: the backup
    copies it to the host and the restore writes it back."""
    kv = MHATokenToKVPool(TOKENS, 1, torch.float32, 1, 4, 1, "cpu", False, enable_alt_stream=False)
    allocator = TokenToKVPoolAllocator(TOKENS, torch.float32, "cpu", kv, False)
    pool = ReqToTokenPool(size=8, max_context_len=TOKENS, device="cpu", enable_memory_saver=False)
    return DecodeSchedulerStandIn(pool, allocator)


def transferred_and_decoded(scheduler: DecodeSchedulerStandIn, rid: str, tenant: str) -> Req:
    """A request whose 24-token prompt was transferred and checked, then decoded 4 tokens (the
    KV of 3 of them written: the last one's is the next step's)."""
    req = make_req(rid, 24, tenant=tenant)
    preallocate(scheduler, req, 27)
    mark_transferred(scheduler, req, 0, 24)
    req.isogate_pages_checked = True
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    assert table is not None
    slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, 24:27]
    table.mark(slots.to(torch.int64), *req_fingerprints(req))  # three decode steps
    req.output_ids.extend([5, 6, 7, 8])
    return req


def retract(scheduler: DecodeSchedulerStandIn, req: Req) -> torch.Tensor:
    """What release_req does to a decode request: back it up, give its row and pages back."""
    pool, allocator = scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator
    check_before_backup(Req.offload_kv_cache, req, pool, allocator)
    slots = pool.req_to_token[req.kv.req_pool_idx, : req.seqlen - 1].clone()
    allocator.free(slots)
    pool.free(req)
    return slots


def resume(scheduler: DecodeSchedulerStandIn, req: Req) -> None:
    """What resume_retracted_reqs does: a new row and pages, then the restore."""
    pool, allocator = scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator
    preallocate(scheduler, req, req.seqlen - 1)
    mark_restored(Req.load_kv_cache(req, pool, allocator), req, pool, allocator)


def other_generation_takes(scheduler: DecodeSchedulerStandIn, slots: torch.Tensor) -> None:
    """Another tenant's transfer lands in ``slots`` (pages freed by the retraction)."""
    other = make_req("gen_other", len(slots), tenant="tenant-b")
    assert scheduler.req_to_token_pool.alloc([other]) is not None
    scheduler.req_to_token_pool.write((other.kv.req_pool_idx, slice(0, len(slots))), slots)
    other.kv.kv_committed_len = len(slots)
    mark_transferred(scheduler, other, 0, len(slots))


def first_decode_step(scheduler: DecodeSchedulerStandIn, req: Req) -> ScheduleBatch:
    batch = ScheduleBatch(
        reqs=[req], token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator
    )
    check_pages_before_first_decode(
        SchedulerDisaggregationDecodeMixin._verify_kv_checksums, scheduler, batch
    )
    return batch


def test_a_retracted_request_is_checked_again_after_its_restore_and_passes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = decode_worker()
    req = transferred_and_decoded(scheduler, "gen_retracted", "tenant-a")
    old_slots = retract(scheduler, req)
    # Its old pages go to another tenant's generation before it resumes elsewhere.
    other_generation_takes(scheduler, old_slots)
    resume(scheduler, req)
    assert req.isogate_pages_checked is False  # the check is due again
    assert not torch.equal(
        scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.seqlen - 1], old_slots
    )
    with caplog.at_level(logging.INFO, logger="isogate.engine"):
        batch = first_decode_step(scheduler, req)
    assert [r.rid for r in batch.reqs] == ["gen_retracted"] and req.finished_reason is None
    assert req.isogate_pages_checked is True
    assert "reverified rid=gen_retracted after retraction" in caplog.text
    # Its tags are the ones it came with.
    assert (req.isolation_tenant, req.isolation_generation) == ("tenant-a", "gen_retracted")


def test_a_page_overwritten_after_the_restore_still_fails_the_request() -> None:
    scheduler = decode_worker()
    req = transferred_and_decoded(scheduler, "gen_retracted", "tenant-a")
    retract(scheduler, req)
    resume(scheduler, req)
    # Before its first decode step after the restore, one of its pages is written for
    # another generation (what a page handed out twice would look like).
    page = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, 3:4]
    other_generation_takes(scheduler, page)
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    problem = problem_before_first_decode(scheduler, req, table)
    assert problem is not None and "1 of the positions [0,27)" in problem


def test_a_backup_of_pages_that_were_not_its_own_fails_the_request_after_the_restore() -> None:
    scheduler = decode_worker()
    req = transferred_and_decoded(scheduler, "gen_retracted", "tenant-a")
    # One of the pages it is about to back up was last written by another generation.
    other_generation_takes(
        scheduler, scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, 10:11]
    )
    retract(scheduler, req)
    resume(scheduler, req)  # the restore does not vouch for a backup that failed its check
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    problem = problem_before_first_decode(scheduler, req, table)
    assert problem is not None and problem.startswith("retraction backup: 1 of the positions")
