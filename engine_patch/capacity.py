"""Pool against context length: the start-up gate and the per-request guard.

Start-up: SGLang computes the KV pool capacity in ``TpModelWorker.get_worker_info``
and only warns when it is below the context length. The plugin refuses to
start such a worker, or -- when the operator asks for it -- clamps the context
length it advertises (``/v1/models``, ``/server_info``) to the pool.

Per request: the tokenizer checks prompts against the context length only, so
a prompt under the context length but over the pool reached the scheduler,
which replaced it by a one-token stub. The guard refuses it at the tokenizer
with HTTP 400, before the scheduler sees it.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size

from engine_patch.events import DECISIONS, LOG_PREFIX
from engine_patch.settings import CLAMP_CONTEXT_ENV, EngineSettings

logger = logging.getLogger("isogate.engine")

# Reported by the scheduler in its init info (read by the main process).
INFO_KV_CAPACITY = "isogate_kv_capacity"
INFO_CLAMPED_CONTEXT = "isogate_clamped_context_length"
# Published in /server_info so a gateway can tell, before routing, that this worker runs the
# plugin (it refuses workers without it when the model requires engine tags).
INFO_MARKER = "isogate_engine_patch"
PLUGIN_VERSION = "0.1.0"


class PoolSmallerThanContextError(RuntimeError):
    """The worker's KV pool cannot hold one request of its advertised context length."""


def kv_capacity_of(worker: Any) -> int:
    """The same capacity ``get_worker_info`` computes (logical tokens, DCP-aware)."""
    runner = worker.model_runner
    return int(
        runner.effective_logical_max_total_num_tokens
        * page_interleave_shard_size(runner.token_to_kv_pool_allocator)
    )


def gate_message(kv_capacity: int, context_len: int) -> str:
    return (
        f"{LOG_PREFIX} refusing to start: the KV pool holds {kv_capacity} tokens, fewer than "
        f"the context length {context_len}. A prompt between the two would pass the "
        f"context check and not fit the pool (the September 2026 incident shape). "
        f"Lower --context-length to at most {kv_capacity}, raise --max-total-tokens or "
        f"--mem-fraction-static, or set {CLAMP_CONTEXT_ENV}=1 to advertise the pool size "
        f"as the context length."
    )


def gate_after_worker_info(settings: EngineSettings, result: Any, worker: Any) -> Any:
    """AFTER TpModelWorker.get_worker_info (scheduler process)."""
    kv_capacity = kv_capacity_of(worker)
    context_len = int(worker.model_config.context_len)
    worker.isogate_kv_capacity = kv_capacity
    if kv_capacity >= context_len:
        return result
    if not settings.clamp_context:
        message = gate_message(kv_capacity, context_len)
        logger.critical(message)
        raise PoolSmallerThanContextError(message)
    logger.warning(
        "%s clamping the advertised context length %d to the KV pool size %d (%s=1)",
        LOG_PREFIX,
        context_len,
        kv_capacity,
        CLAMP_CONTEXT_ENV,
    )
    worker.isogate_clamped_context_length = kv_capacity
    return result


def report_in_init_info(result: dict[str, Any], scheduler: Any) -> dict[str, Any]:
    """AFTER Scheduler.get_init_info: hand the capacity (and any clamp) to the main process.

    ``/server_info`` merges this dict over the server arguments, so a clamped
    ``context_length`` shows there as is."""
    result[INFO_MARKER] = PLUGIN_VERSION
    worker = scheduler.tp_worker
    capacity = getattr(worker, "isogate_kv_capacity", None)
    if capacity is not None:
        result[INFO_KV_CAPACITY] = capacity
    clamped = getattr(worker, "isogate_clamped_context_length", None)
    if clamped is not None:
        result[INFO_CLAMPED_CONTEXT] = clamped
        result["context_length"] = clamped
    return result


def apply_clamp_in_tokenizer(
    result: Any, tokenizer_manager: Any, scheduler_init_result: Any, startup_tic: float
) -> Any:
    """AFTER Engine._set_startup_time (main process, right after the schedulers are ready)."""
    infos = scheduler_init_result.scheduler_infos
    clamped = [info[INFO_CLAMPED_CONTEXT] for info in infos if INFO_CLAMPED_CONTEXT in info]
    if not clamped:
        return result
    context_len = min(clamped)
    tokenizer_manager.context_len = context_len
    tokenizer_manager.model_config.context_len = context_len
    logger.warning("%s advertised context length clamped to %d", LOG_PREFIX, context_len)
    return result


def over_pool_problem(prompt_tokens: int, max_req_input_len: int | None) -> str | None:
    # Same comparison as the scheduler's validate_input_length, which would
    # otherwise reject it only after admission, by stubbing the prompt.
    if max_req_input_len is None or prompt_tokens < max_req_input_len:
        return None
    return (
        f"The prompt ({prompt_tokens} tokens) does not fit this worker's KV pool: at most "
        f"{max_req_input_len - 1} prompt tokens are admitted."
    )


def guard_before_validation(tokenizer_manager: Any, obj: Any, input_ids: Any) -> None:
    """BEFORE TokenizerManager._validate_one_request: over-pool prompt -> HTTP 400."""
    if input_ids is None:
        return None
    problem = over_pool_problem(len(input_ids), tokenizer_manager.max_req_input_len)
    if problem is not None:
        rid = obj.rid if isinstance(obj.rid, str) else None
        DECISIONS.record_refused("over_pool", rid, problem)
        raise ValueError(problem)
    return None
