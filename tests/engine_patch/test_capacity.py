"""Start-up gate, clamp and the per-request over-pool guard."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.tp_worker import TpModelWorker

from engine_patch.capacity import (
    INFO_CLAMPED_CONTEXT,
    PoolSmallerThanContextError,
    apply_clamp_in_tokenizer,
    gate_after_worker_info,
    guard_before_validation,
    report_in_init_info,
)
from engine_patch.events import DECISIONS
from engine_patch.settings import EngineSettings
from tests.engine_patch.realparts import make_kv_pools


@dataclass
class ModelRunnerPoolStandIn:
    """The two pool facts get_worker_info reads from a model runner (a real one loads a model)."""

    effective_logical_max_total_num_tokens: int
    token_to_kv_pool_allocator: Any


def worker(pool_tokens: int, context_len: int) -> TpModelWorker:
    tp_worker = TpModelWorker.__new__(TpModelWorker)
    _, allocator = make_kv_pools(tokens=64)
    tp_worker._model_runner = ModelRunnerPoolStandIn(pool_tokens, allocator)
    tp_worker.model_config = SimpleNamespace(context_len=context_len)
    return tp_worker


def test_worker_whose_pool_holds_its_context_starts():
    result = ("worker", "info")
    assert gate_after_worker_info(EngineSettings(), result, worker(8192, 8192)) is result


def test_worker_whose_pool_is_below_its_context_refuses_to_start_with_a_clear_message():
    with pytest.raises(PoolSmallerThanContextError) as raised:
        gate_after_worker_info(EngineSettings(), None, worker(681_280, 1_048_576))
    message = str(raised.value)
    assert "KV pool holds 681280 tokens, fewer than the context length 1048576" in message
    assert "ISOGATE_ENGINE_CLAMP_CONTEXT=1" in message


def test_clamp_reports_the_pool_as_context_length_to_the_main_process():
    tp_worker = worker(1024, 4096)
    gate_after_worker_info(EngineSettings(clamp_context=True), None, tp_worker)
    info = report_in_init_info({"max_req_input_len": 1018}, SimpleNamespace(tp_worker=tp_worker))
    assert info["context_length"] == 1024 and info[INFO_CLAMPED_CONTEXT] == 1024

    manager = TokenizerManager.__new__(TokenizerManager)
    manager.context_len = 4096
    manager.model_config = SimpleNamespace(context_len=4096)
    apply_clamp_in_tokenizer(None, manager, SimpleNamespace(scheduler_infos=[info]), 0.0)
    assert manager.context_len == 1024 and manager.model_config.context_len == 1024


def test_no_clamp_leaves_the_tokenizer_alone():
    manager = TokenizerManager.__new__(TokenizerManager)
    manager.context_len = 4096
    apply_clamp_in_tokenizer(
        None, manager, SimpleNamespace(scheduler_infos=[{"max_req_input_len": 10}]), 0.0
    )
    assert manager.context_len == 4096


def tokenizer_with_limit(max_req_input_len: int) -> TokenizerManager:
    manager = TokenizerManager.__new__(TokenizerManager)
    manager.max_req_input_len = max_req_input_len  # what the scheduler reported at start-up
    return manager


def test_over_pool_prompt_is_refused_before_the_scheduler_as_a_400():
    obj = GenerateReqInput(input_ids=list(range(1018)), rid="gen_long")
    refused_before = DECISIONS.refused["over_pool"]
    with pytest.raises(ValueError, match="does not fit this worker's KV pool"):
        guard_before_validation(tokenizer_with_limit(1018), obj, list(range(1018)))
    assert DECISIONS.refused["over_pool"] == refused_before + 1


def test_prompt_that_fits_passes_the_guard():
    obj = GenerateReqInput(input_ids=list(range(1017)), rid="gen_fits")
    assert guard_before_validation(tokenizer_with_limit(1018), obj, list(range(1017))) is None
