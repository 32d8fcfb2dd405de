"""Real SGLang objects for the unit tests, built without a model.

SGLang's queues and scheduler need a loaded model to construct normally. As in
SGLang's own CPU unit tests, the queue is created with ``__new__`` and given
just the attributes the method under test reads; the objects it works on
(``Req``, ``MetadataBuffers``, ``DecodeRequest``, ``ReqToTokenPool``,
``TokenToKVPoolAllocator``) are real. Where SGLang needs a collaborator only a
running server has (the KV receiver's transport, the scheduler), a stand-in
says so in its name.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from engine_patch.tags import tag_req


def make_req(
    rid: str,
    prompt_len: int,
    *,
    tenant: str | None = "tenant-a",
    bootstrap_room: int = 4242,
    extra_key: str | None = None,
) -> Req:
    req = Req(
        rid,
        "",
        array("q", [3 + i % 500 for i in range(prompt_len)]),
        SamplingParams(max_new_tokens=8),
        bootstrap_host="127.0.0.1",
        bootstrap_port=30112,
        bootstrap_room=bootstrap_room,
        extra_key=extra_key,
    )
    if tenant is not None:
        recv = type("TaggedRecv", (), {"isolation_tenant": tenant, "isolation_generation": rid})()
        tag_req(req, None, recv)
    return req


def make_metadata_buffers(size: int = 4) -> MetadataBuffers:
    return MetadataBuffers(
        size=size,
        hidden_size=8,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=4,
    )


def ship_metadata_row(source: MetadataBuffers, target: MetadataBuffers, src: int, dst: int) -> None:
    """What the KV transfer does with the metadata: copy each buffer's row as bytes."""
    ptrs_src = source.get_buf_infos()
    for src_buf, dst_buf in zip(_buffers(source), _buffers(target), strict=True):
        dst_buf[dst].copy_(src_buf[src])
    assert ptrs_src  # the layout SGLang registers for transfer is non-empty


def _buffers(buffers: MetadataBuffers) -> list[torch.Tensor]:
    names = [
        "output_ids",
        "cached_tokens",
        "output_token_logprobs_val",
        "output_token_logprobs_idx",
        "output_top_logprobs_val",
        "output_top_logprobs_idx",
        "output_topk_p",
        "output_topk_index",
        "output_hidden_states",
        "bootstrap_room",
    ]
    return [getattr(buffers, name) for name in names]


class KVReceiverStandIn:
    """Stands in for a Mooncake receiver (needs a live transfer engine); records clear()."""

    def __init__(self) -> None:
        self.cleared = False

    def clear(self) -> None:
        self.cleared = True


class ReasoningCounterStandIn:
    """The scheduler's batch result processor needs the model config; nothing to count here."""

    def _maybe_update_reasoning_tokens(self, req: Req, token_id: int) -> None:
        return None


@dataclass
class DecodeSchedulerStandIn:
    """The attributes of a decode Scheduler the transfer queue and page tags read."""

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    kv_checksum_computer: Any = None
    batch_result_processor: Any = field(default_factory=ReasoningCounterStandIn)


def make_kv_pools(
    tokens: int = 4096, page_size: int = 1, rows: int = 8
) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator]:
    assert page_size == 1, "the plain token allocator is page size 1"
    req_to_token_pool = ReqToTokenPool(
        size=rows, max_context_len=tokens, device="cpu", enable_memory_saver=False
    )
    allocator = TokenToKVPoolAllocator(tokens, torch.float16, "cpu", None, False)
    return req_to_token_pool, allocator


def make_transfer_queue(
    scheduler: DecodeSchedulerStandIn, metadata_buffers: MetadataBuffers
) -> DecodeTransferQueue:
    queue = DecodeTransferQueue.__new__(DecodeTransferQueue)
    queue.queue = []
    queue.metadata_buffers = metadata_buffers
    queue.scheduler = scheduler
    queue.spec_algorithm = SpeculativeAlgorithm.NONE
    queue.tree_cache = None
    return queue


def preallocate(scheduler: DecodeSchedulerStandIn, req: Req, fill_len: int) -> torch.Tensor:
    """What DecodePreallocQueue._pre_alloc does for a request with no decode prefix."""
    assert scheduler.req_to_token_pool.alloc([req]) is not None  # sets req.kv.req_pool_idx
    row = req.kv.req_pool_idx
    slots = scheduler.token_to_kv_pool_allocator.alloc(fill_len)
    assert slots is not None
    scheduler.req_to_token_pool.write((row, slice(0, fill_len)), slots)
    req.kv.kv_committed_len = fill_len
    return slots


def make_decode_request(req: Req, metadata_index: int) -> DecodeRequest:
    decode_req = DecodeRequest(req=req, kv_receiver=KVReceiverStandIn())
    decode_req.metadata_buffer_index = metadata_index
    req.metadata_buffer_index = metadata_index
    return decode_req
