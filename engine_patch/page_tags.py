"""Written-by page tags on the decode worker.

For every KV page, which generation (and tenant) last wrote it: a verified
transfer tags the range prefill sent, each decode step tags the page its new
token lands in. Before a request's first decode step every page it is about to
read is checked: the transferred part must carry its own generation, a prefix
reused from decode's radix cache must carry its own tenant. Anything else --
a page never written for it, or overwritten since -- fails the request.

A request retracted (decode's KV pool ran out; with priority scheduling, the
lowest priority goes first) is checked the same way on its way out and back:
the pages copied to its host backup must be its own, the pages its backup is
restored into are tagged as its own, and it is checked again before its first
decode step after the restore. A backup of pages that were not its own fails
it there.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal, overload

import torch
from sglang.srt.disaggregation.utils import _is_fake_transfer, prepare_abort
from sglang.srt.mem_cache.common import release_kv_cache

from engine_patch.events import DECISIONS, LOG_PREFIX, logger
from engine_patch.identity import req_fingerprints

_TABLE_ATTRIBUTE = "isogate_page_owners"


class PageOwnerTable:
    """Two int64 entries per page: generation and tenant fingerprint (0 = none)."""

    def __init__(self, num_pages: int, device: Any = "cpu") -> None:
        self.generation = torch.zeros(num_pages, dtype=torch.int64, device=device)
        self.tenant = torch.zeros(num_pages, dtype=torch.int64, device=device)

    def _fit(self, pages: torch.Tensor) -> None:
        needed = int(pages.max().item()) + 1
        if needed > self.generation.numel():
            grow = needed - self.generation.numel()
            self.generation = torch.cat([self.generation, self.generation.new_zeros(grow)])
            self.tenant = torch.cat([self.tenant, self.tenant.new_zeros(grow)])

    def mark(self, pages: torch.Tensor, generation: int, tenant: int) -> None:
        if pages.numel() == 0:
            return
        self._fit(pages)
        self.generation[pages] = generation
        self.tenant[pages] = tenant

    def mark_each(
        self, pages: torch.Tensor, generations: torch.Tensor, tenants: torch.Tensor
    ) -> None:
        if pages.numel() == 0:
            return
        self._fit(pages)
        self.generation[pages] = generations
        self.tenant[pages] = tenants

    def pages_not_written_by(self, pages: torch.Tensor, generation: int) -> int:
        if pages.numel() == 0:
            return 0
        self._fit(pages)
        return int((self.generation[pages] != generation).sum().item())

    def pages_not_of_tenant(self, pages: torch.Tensor, tenant: int) -> int:
        if pages.numel() == 0:
            return 0
        self._fit(pages)
        return int((self.tenant[pages] != tenant).sum().item())


@overload
def table_for(allocator: Any, *, create: Literal[True]) -> PageOwnerTable: ...
@overload
def table_for(allocator: Any, *, create: bool) -> PageOwnerTable | None: ...
def table_for(allocator: Any, *, create: bool) -> PageOwnerTable | None:
    """The table of one KV pool, kept on its allocator; created by decode only."""
    table: PageOwnerTable | None = getattr(allocator, _TABLE_ATTRIBUTE, None)
    if table is None and create:
        page_size = int(allocator.page_size)
        table = PageOwnerTable(int(allocator.size) // page_size + 2, device=allocator.device)
        setattr(allocator, _TABLE_ATTRIBUTE, table)
    return table


def _pages(scheduler: Any, req: Any, start: int, end: int) -> torch.Tensor:
    return _pages_in(
        scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator, req, start, end
    )


def _pages_in(
    req_to_token_pool: Any, allocator: Any, req: Any, start: int, end: int
) -> torch.Tensor:
    page_size = int(allocator.page_size)
    slots: torch.Tensor = req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end]
    return slots.to(torch.int64) // page_size


def mark_transferred(scheduler: Any, req: Any, sent_from: int, sent_end: int) -> None:
    """After a verified commit: the pages prefill sent were written for this request."""
    end = min(sent_end, int(req.kv.kv_committed_len))
    if end <= sent_from:
        return
    table = table_for(scheduler.token_to_kv_pool_allocator, create=True)
    generation, tenant = req_fingerprints(req)
    table.mark(_pages(scheduler, req, sent_from, end), generation, tenant)


def mark_decode_writes(result: Any, batch: Any) -> Any:
    """AFTER ScheduleBatch.prepare_for_decode: each new token's page is this request's."""
    allocator = batch.token_to_kv_pool_allocator
    table = table_for(allocator, create=False)
    out_cache_loc = batch.out_cache_loc
    if table is None or out_cache_loc is None or out_cache_loc.numel() != len(batch.reqs):
        # No table: not a decode worker. Other shapes: speculative steps, not tagged.
        return result
    fingerprints = [req_fingerprints(req) for req in batch.reqs]
    generations = torch.tensor(
        [f[0] for f in fingerprints], dtype=torch.int64, device=table.generation.device
    )
    tenants = torch.tensor(
        [f[1] for f in fingerprints], dtype=torch.int64, device=table.tenant.device
    )
    table.mark_each(out_cache_loc.to(torch.int64) // int(allocator.page_size), generations, tenants)
    return result


def foreign_page_problem(scheduler: Any, req: Any, table: PageOwnerTable | None) -> str | None:
    """Why ``req`` must not read its pages, or None when every page is its own."""
    return _problem(
        scheduler.req_to_token_pool,
        scheduler.token_to_kv_pool_allocator,
        req,
        table,
        int(req.kv.kv_committed_len),
    )


def _problem(
    req_to_token_pool: Any, allocator: Any, req: Any, table: PageOwnerTable | None, seq_len: int
) -> str | None:
    """Why the pages of ``req``'s positions [0, seq_len) are not all its own, or None."""
    prefix_len = min(int(req.kv.cache_protected_len), seq_len)
    if table is None:
        return f"no page was tagged on this worker, {seq_len} positions unverified"
    generation, tenant = req_fingerprints(req)
    pages = _pages_in(req_to_token_pool, allocator, req, prefix_len, seq_len)
    foreign = table.pages_not_written_by(pages, generation)
    if foreign:
        return (
            f"{foreign} of the positions [{prefix_len},{seq_len}) sit in pages last written by "
            "another generation"
        )
    prefix = _pages_in(req_to_token_pool, allocator, req, 0, prefix_len)
    other_tenant = table.pages_not_of_tenant(prefix, tenant)
    if other_tenant:
        return f"{other_tenant} reused prefix positions sit in pages of another tenant"
    return None


def problem_before_first_decode(
    scheduler: Any, req: Any, table: PageOwnerTable | None
) -> str | None:
    """Why ``req`` must not take its first decode step (after its transfer, or after a
    restore from its retraction backup), or None."""
    backup_problem: str | None = getattr(req, "isogate_backup_problem", None)
    return backup_problem or foreign_page_problem(scheduler, req, table)


def check_before_backup(
    original: Any, req: Any, req_to_token_pool: Any, allocator: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND Req.offload_kv_cache (a decode retraction's host backup, ``cpu_tensor``).

    The positions it copies, [0, seqlen - 1), must still sit in the request's own pages: a
    backup of another generation's KV would come back as this one's on restore. A problem is
    kept on the request and fails it before its next decode step (the retraction itself is
    SGLang's to finish)."""
    table = table_for(allocator, create=False)
    if table is not None and not _is_fake_transfer(req):
        problem = _problem(req_to_token_pool, allocator, req, table, int(req.seqlen) - 1)
        if problem is not None:
            req.isogate_backup_problem = f"retraction backup: {problem}"
    return original(req, req_to_token_pool, allocator, *args, **kwargs)


def mark_restored(
    result: Any, req: Any, req_to_token_pool: Any, allocator: Any, *args: Any, **kwargs: Any
) -> Any:
    """AFTER Req.load_kv_cache (a retracted request resumed from its host backup): the pages
    the restore wrote, [0, seqlen - 1), hold this request's own KV; it is checked again
    before its next decode step, as a newly transferred one is."""
    table = table_for(allocator, create=False)
    if table is not None and not _is_fake_transfer(req):
        if getattr(req, "isogate_backup_problem", None) is None:
            generation, tenant = req_fingerprints(req)
            pages = _pages_in(req_to_token_pool, allocator, req, 0, int(req.seqlen) - 1)
            table.mark(pages, generation, tenant)
        req.isogate_pages_checked = False
        req.isogate_restored = True
    return result


def check_pages_before_first_decode(original: Any, scheduler: Any, batch: Any) -> None:
    """AROUND SchedulerDisaggregationDecodeMixin._verify_kv_checksums.

    SGLang verifies KV checksums of newly transferred requests there, after any
    host restore and before the prebuilt batch joins the running batch: the
    last point before their first decode step."""
    original(scheduler, batch)
    if batch.is_empty():
        return None
    table = table_for(scheduler.token_to_kv_pool_allocator, create=False)
    failed = [0] * len(batch.reqs)
    for i, req in enumerate(batch.reqs):
        if getattr(req, "isogate_pages_checked", False) or _is_fake_transfer(req):
            continue
        problem = problem_before_first_decode(scheduler, req, table)
        req.isogate_pages_checked = True
        if problem is not None:
            failed[i] = 1
            _fail_with_pages_released(scheduler, req, problem)
        elif getattr(req, "isogate_restored", False):
            # A line of its own, not a second count of verified requests.
            req.isogate_restored = False
            logger.info("%s reverified rid=%s after retraction", LOG_PREFIX, req.rid)
    if any(failed):
        batch.filter_batch(keep_indices=[i for i, bad in enumerate(failed) if not bad])
    return None


def _fail_with_pages_released(scheduler: Any, req: Any, problem: str) -> None:
    # The unwinding SGLang does for a KV checksum mismatch at this point, except
    # that the handoff token committed from prefill's metadata is withdrawn
    # first: otherwise a stream's abort event would still carry it as text.
    prepare_abort(
        req,
        f"isolation check failed (foreign_page): {problem}",
        status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
    )
    DECISIONS.record_refused("foreign_page", req.rid, problem)
    release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
    _withdraw_uncommitted_output(req)
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def _withdraw_uncommitted_output(req: Any) -> None:
    """Drop the tokens of a request failed before its first decode step (the handoff token)."""
    del req.output_ids[:]
    if req.return_logprob:
        logprob = req.logprob
        for name in (
            "output_token_logprobs_val",
            "output_token_logprobs_idx",
            "output_top_logprobs_val",
            "output_top_logprobs_idx",
        ):
            values = getattr(logprob, name, None)
            if values:
                del values[:]
