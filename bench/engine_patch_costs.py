"""What the plugin's hooks cost on SGLang's real classes (originals, ``Req``, ``MetadataBuffers``,
pools), run in ``.venv-engine`` (section 3, or ``python -m bench.engine_patch_costs``): each
figure is the plugin's extra microseconds (hooked minus SGLang's own where a hook wraps an
original), the median of ``repeats`` runs."""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


def _median_us(run: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def measure_costs(
    prompt_tokens: int = 2048, decode_batch: int = 32, repeats: int = 200
) -> dict[str, float]:
    """Microseconds of plugin work, per request and per decode step."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0)

    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from engine_patch import coverage, page_tags, tags
    from engine_patch.settings import EngineSettings

    settings = EngineSettings()
    pool_tokens = prompt_tokens * (decode_batch + 4)
    req_to_token_pool = ReqToTokenPool(decode_batch + 4, prompt_tokens + 64, "cpu", False)
    allocator = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", None, False)

    no_reasoning = {"_maybe_update_reasoning_tokens": lambda self, req, tok: None}
    scheduler = SimpleNamespace(  # the attributes of a decode Scheduler the hooks read
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        kv_checksum_computer=None,
        batch_result_processor=type("_NoReasoning", (), no_reasoning)(),
    )

    def new_req(rid: str) -> Req:
        prompt, params = array("q", range(3, 3 + prompt_tokens)), SamplingParams(max_new_tokens=16)
        req = Req(rid, "", prompt, params, bootstrap_host="127.0.0.1", bootstrap_room=77)
        req.isolation_tenant, req.isolation_generation = "tenant-bench", rid
        return req

    # Tokenizer side: headers -> tagged IPC message.
    from sglang.srt.managers.io_struct import GenerateReqInput
    from starlette.datastructures import Headers

    headers = Headers({tags.TENANT_HEADER: "tenant-bench", tags.GENERATION_HEADER: "gen_bench"})
    headers_request = SimpleNamespace(headers=headers)
    message = TokenizedGenerateReqInput(
        input_text="", input_ids=array("q", range(prompt_tokens)), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
        stream=False, rid="gen_bench",
    )  # fmt: skip

    def tokenizer_side() -> None:
        obj = GenerateReqInput(input_ids=[1], rid="gen_bench")
        obj.is_single = True
        tags.read_request_tags(settings, None, obj, headers_request)
        tags.carry_tags_to_scheduler(message, None, obj)

    # Prefill attestation after set_buf.
    buffers = MetadataBuffers(4, 8, torch.float32, max_sampling_mask_tokens=4)
    prefill_req = new_req("gen_prefill")
    prefill_req.metadata_buffer_index, prefill_req.extend_end = 1, prompt_tokens
    prefill_req.output_ids.append(5)
    buffers.set_buf(prefill_req)

    # Decode commit: SGLang's commit alone versus the hooked commit.
    queue = DecodeTransferQueue.__new__(DecodeTransferQueue)
    queue.metadata_buffers, queue.scheduler = buffers, scheduler
    queue.spec_algorithm, queue.tree_cache = SpeculativeAlgorithm.NONE, None
    decode_req_obj = new_req("gen_prefill")
    req_to_token_pool.alloc([decode_req_obj])
    slots = allocator.alloc(prompt_tokens)
    req_to_token_pool.write((decode_req_obj.kv.req_pool_idx, slice(0, prompt_tokens)), slots)
    decode_req_obj.kv.kv_committed_len = prompt_tokens
    coverage.attest_after_set_buf(None, buffers, prefill_req)

    receiver = SimpleNamespace(clear=lambda: None)
    original = DecodeTransferQueue._commit_transfer_to_req

    def commit(hooked: bool) -> None:
        decode_req_obj.output_ids = array("q")
        decode_req = DecodeRequest(
            req=decode_req_obj, kv_receiver=receiver, metadata_buffer_index=1
        )
        if hooked:
            coverage.verify_before_commit(settings, original, queue, decode_req)
        else:
            original(queue, decode_req)

    table = page_tags.table_for(allocator, create=True)

    def page_check() -> None:
        assert page_tags.foreign_page_problem(scheduler, decode_req_obj, table) is None

    # Decode step: tag a batch's new tokens.
    batch_reqs = [new_req(f"gen_step_{i}") for i in range(decode_batch)]
    batch = ScheduleBatch(reqs=batch_reqs, token_to_kv_pool_allocator=allocator)
    batch.out_cache_loc = allocator.alloc(decode_batch)

    sglang_commit = _median_us(lambda: commit(False), repeats)
    hooked_commit = _median_us(lambda: commit(True), repeats)
    attest = lambda: coverage.attest_after_set_buf(None, buffers, prefill_req)  # noqa: E731
    return {
        "prompt_tokens": float(prompt_tokens),
        "decode_batch": float(decode_batch),
        "tokenizer_tags_us": _median_us(tokenizer_side, repeats),
        "prefill_attestation_us": _median_us(attest, repeats),
        "decode_commit_sglang_us": sglang_commit,
        "decode_commit_plugin_extra_us": hooked_commit - sglang_commit,
        "first_decode_page_check_us": _median_us(page_check, repeats),
        "decode_step_page_tagging_us": _median_us(
            lambda: page_tags.mark_decode_writes(None, batch), repeats
        ),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(measure_costs(), indent=2))
