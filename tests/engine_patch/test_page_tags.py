"""Written-by page tags on real KV pools (ReqToTokenPool, TokenToKVPoolAllocator)."""

from __future__ import annotations

import torch
from sglang.srt.disaggregation.decode import DecodeTransferQueue
from sglang.srt.managers.schedule_batch import ScheduleBatch

from engine_patch.coverage import attest_after_set_buf, verify_before_commit
from engine_patch.page_tags import (
    PageOwnerTable,
    foreign_page_problem,
    mark_decode_writes,
    mark_transferred,
    table_for,
)
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


def decode_worker() -> DecodeSchedulerStandIn:
    return DecodeSchedulerStandIn(*make_kv_pools())


def test_pages_written_by_a_verified_transfer_pass():
    scheduler = decode_worker()
    req = make_req("gen_own", 32)
    preallocate(scheduler, req, 32)
    mark_transferred(scheduler, req, 0, 32)
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    assert foreign_page_problem(scheduler, req, table) is None


def test_pages_reused_from_a_finished_generation_fail():
    # The incident: decode reserved pages another generation had written, and
    # the transfer for this one covered only the first.
    scheduler = decode_worker()
    earlier = make_req("gen_earlier", 64, tenant="tenant-a")
    slots = preallocate(scheduler, earlier, 64)
    mark_transferred(scheduler, earlier, 0, 64)
    scheduler.token_to_kv_pool_allocator.free(slots)
    scheduler.req_to_token_pool.free(earlier)

    victim = make_req("gen_victim", 64, tenant="tenant-b")
    preallocate(scheduler, victim, 64)
    mark_transferred(scheduler, victim, 0, 1)  # one token actually sent
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    problem = foreign_page_problem(scheduler, victim, table)
    assert problem is not None and "63 of the positions [0,64)" in problem


def test_a_page_overwritten_after_the_transfer_fails():
    scheduler = decode_worker()
    req = make_req("gen_a", 16)
    slots = preallocate(scheduler, req, 16)
    mark_transferred(scheduler, req, 0, 16)
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    table.mark(slots[5:6].to(torch.int64), 12345, 678)  # a write by someone else
    assert "1 of the positions" in foreign_page_problem(scheduler, req, table)


def test_reused_prefix_must_belong_to_the_same_tenant():
    scheduler = decode_worker()
    req = make_req("gen_prefix", 32, tenant="tenant-a")
    slots = preallocate(scheduler, req, 32)
    req.kv.cache_protected_len = 16  # decode's radix cache supplied [0, 16)
    table = table_for(scheduler.token_to_kv_pool_allocator, create=True)
    same_tenant_writer = make_req("gen_writer", 16, tenant="tenant-a")
    from engine_patch.identity import req_fingerprints

    generation, tenant = req_fingerprints(same_tenant_writer)
    table.mark(slots[:16].to(torch.int64), generation, tenant)
    mark_transferred(scheduler, req, 16, 32)
    assert foreign_page_problem(scheduler, req, table) is None

    other_tenant_writer = make_req("gen_other_tenant", 16, tenant="tenant-b")
    generation, tenant = req_fingerprints(other_tenant_writer)
    table.mark(slots[:4].to(torch.int64), generation, tenant)
    assert "of another tenant" in foreign_page_problem(scheduler, req, table)


def test_a_worker_that_never_tagged_fails_closed():
    scheduler = decode_worker()
    req = make_req("gen_untagged_worker", 8)
    preallocate(scheduler, req, 8)
    assert "no page was tagged" in foreign_page_problem(scheduler, req, None)


def test_commit_hook_tags_the_transferred_range_so_the_check_passes_end_to_end():
    scheduler = decode_worker()
    prefill_req = make_req("gen_flow", 24)
    prefill_buffers = make_metadata_buffers()
    prefill_req.metadata_buffer_index = 1
    prefill_req.extend_end = 24
    prefill_req.output_ids.append(9)
    prefill_buffers.set_buf(prefill_req)
    attest_after_set_buf(None, prefill_buffers, prefill_req)

    decode_req_obj = make_req("gen_flow", 24)
    preallocate(scheduler, decode_req_obj, 24)
    decode_buffers = make_metadata_buffers()
    ship_metadata_row(prefill_buffers, decode_buffers, 1, 2)
    queue = make_transfer_queue(scheduler, decode_buffers)
    verify_before_commit(
        EngineSettings(),
        DecodeTransferQueue._commit_transfer_to_req,
        queue,
        make_decode_request(decode_req_obj, 2),
    )
    assert decode_req_obj.isogate_pages_checked is False  # the page check is still due
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    assert foreign_page_problem(scheduler, decode_req_obj, table) is None


def test_decode_steps_tag_the_page_of_each_new_token():
    scheduler = decode_worker()
    allocator = scheduler.token_to_kv_pool_allocator
    table = table_for(allocator, create=True)
    reqs = [make_req("gen_step_a", 4), make_req("gen_step_b", 4, tenant="tenant-b")]
    batch = ScheduleBatch(reqs=reqs, token_to_kv_pool_allocator=allocator)
    batch.out_cache_loc = allocator.alloc(2)
    mark_decode_writes(None, batch)
    from engine_patch.identity import req_fingerprints

    pages = batch.out_cache_loc.to(torch.int64)
    assert table.generation[pages].tolist() == [req_fingerprints(r)[0] for r in reqs]
    assert table.tenant[pages].tolist() == [req_fingerprints(r)[1] for r in reqs]


def test_table_grows_for_pages_past_its_initial_size():
    table = PageOwnerTable(4)
    table.mark(torch.tensor([10]), 7, 8)
    assert table.pages_not_written_by(torch.tensor([10]), 7) == 0
    assert table.pages_not_written_by(torch.tensor([3, 10]), 7) == 1


def test_preempted_request_resumed_into_new_pages_is_not_failed_and_a_fresh_one_is_checked():
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin

    from engine_patch.page_tags import check_pages_before_first_decode

    scheduler = decode_worker()
    # Passed its check before its first decode step, then was retracted and
    # restored from the host backup into pages nobody tagged.
    resumed = make_req("gen_resumed", 16)
    preallocate(scheduler, resumed, 16)
    resumed.isogate_pages_checked = True
    resumed.is_retracted = True
    fresh = make_req("gen_fresh", 16)
    preallocate(scheduler, fresh, 16)
    mark_transferred(scheduler, fresh, 0, 16)
    fresh.isogate_pages_checked = False

    batch = ScheduleBatch(
        reqs=[resumed, fresh], token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator
    )
    check_pages_before_first_decode(
        SchedulerDisaggregationDecodeMixin._verify_kv_checksums, scheduler, batch
    )
    assert [req.rid for req in batch.reqs] == ["gen_resumed", "gen_fresh"]
    assert resumed.finished_reason is None and fresh.finished_reason is None
    assert fresh.isogate_pages_checked is True  # checked once, not again after a retraction


def test_a_request_failed_before_its_first_decode_step_streams_no_token():
    from engine_patch.page_tags import _withdraw_uncommitted_output

    req = make_req("gen_withdrawn", 8)
    req.output_ids.append(485)  # the handoff token committed from prefill's metadata
    req.return_logprob = True
    req.logprob.output_token_logprobs_val = [-0.5]
    req.logprob.output_token_logprobs_idx = [485]
    _withdraw_uncommitted_output(req)
    assert list(req.output_ids) == []
    assert (
        req.logprob.output_token_logprobs_val == [] and req.logprob.output_token_logprobs_idx == []
    )
