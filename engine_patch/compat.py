"""Does this SGLang have what the plugin hooks, and the upstream admission fix?

Checked by ``register()`` before any hook is registered. A plugin that cannot
hook where it means to would run as a silent no-op, so a problem here stops
the process instead (SGLang only logs an exception raised by a plugin).
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any

SUPPORTED_SGLANG_VERSIONS = frozenset({"0.5.23"})

ADMISSION_FIX = "sglang.srt.disaggregation.utils.is_unadmitted_reject"
# The fix is used by name at the two PD doors; a vendor build that dropped it
# from either module would leave that door open.
ADMISSION_FIX_USERS = (
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
)


@dataclass(frozen=True)
class HookTarget:
    """A dotted SGLang path the plugin relies on, and the leading parameters it expects."""

    path: str
    parameters: tuple[str, ...] = ()
    is_callable: bool = True


TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"

INIT_REQ_STATE = HookTarget(f"{TOKENIZER}._init_req_state", ("self", "obj", "request"))
CREATE_TOKENIZED = HookTarget(f"{TOKENIZER}._create_tokenized_object", ("self", "obj"))
VALIDATE_ONE = HookTarget(f"{TOKENIZER}._validate_one_request", ("self", "obj", "input_ids"))
UPDATE_META_INFO = HookTarget(
    f"{TOKENIZER}.update_request_meta_info",
    ("self", "meta_info", "state", "customized_info", "index", "finish_reason"),
)
CREATE_REQ = HookTarget(f"{SCHEDULER}._create_generation_req", ("self", "recv_req"))
INIT_INFO = HookTarget(f"{SCHEDULER}.get_init_info", ("self",))
BUILD_EXTRA_INFO = HookTarget(f"{STREAMER}.build_additional_customized_info", ("self", "reqs"))
EXTRA_INFO_SWITCH = HookTarget(f"{STREAMER}.has_additional_customized_info", is_callable=False)
SET_BUF = HookTarget("sglang.srt.disaggregation.utils.MetadataBuffers.set_buf", ("self", "req"))
CLEAR_SLOT = HookTarget(
    "sglang.srt.disaggregation.utils.MetadataBuffers.clear_slot", ("self", "idx")
)
COMMIT = HookTarget(
    "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
    ("self", "decode_req"),
)
VERIFY_CHECKSUMS = HookTarget(
    "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
    ("self", "batch"),
)
PREPARE_DECODE = HookTarget(
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", ("self",)
)
WORKER_INFO = HookTarget("sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info", ("self",))
SET_STARTUP_TIME = HookTarget(
    "sglang.srt.entrypoints.engine.Engine._set_startup_time",
    ("tokenizer_manager", "scheduler_init_result", "startup_tic"),
)
# A decode retraction's host backup (``cpu_tensor``) and its restore.
OFFLOAD_KV = HookTarget(
    "sglang.srt.managers.schedule_batch.Req.offload_kv_cache",
    ("self", "req_to_token_pool", "token_to_kv_pool_allocator"),
)
LOAD_KV = HookTarget(
    "sglang.srt.managers.schedule_batch.Req.load_kv_cache",
    ("self", "req_to_token_pool", "token_to_kv_pool_allocator"),
)
PREPARE_ABORT = HookTarget(
    "sglang.srt.disaggregation.utils.prepare_abort", ("req", "error_message", "status_code")
)

REQUIRED_TARGETS = (
    INIT_REQ_STATE,
    CREATE_TOKENIZED,
    VALIDATE_ONE,
    UPDATE_META_INFO,
    CREATE_REQ,
    INIT_INFO,
    BUILD_EXTRA_INFO,
    EXTRA_INFO_SWITCH,
    SET_BUF,
    CLEAR_SLOT,
    COMMIT,
    VERIFY_CHECKSUMS,
    PREPARE_DECODE,
    OFFLOAD_KV,
    LOAD_KV,
    WORKER_INFO,
    SET_STARTUP_TIME,
    PREPARE_ABORT,
    HookTarget("sglang.srt.managers.io_struct.hook_custom_types"),
    HookTarget("sglang.srt.managers.io_struct.TokenizedGenerateReqInput"),
    HookTarget("sglang.srt.mem_cache.common.release_kv_cache", ("req", "tree_cache")),
)


def _resolve(path: str) -> Any:
    return pkgutil.resolve_name(path)


def target_problems(targets: tuple[HookTarget, ...] = REQUIRED_TARGETS) -> list[str]:
    problems = []
    for target in targets:
        try:
            resolved = _resolve(target.path)
        except (ImportError, AttributeError, ValueError) as error:
            problems.append(f"hook target {target.path} is missing ({error})")
            continue
        if not target.is_callable:
            continue
        if not callable(resolved):
            problems.append(f"hook target {target.path} is not callable")
            continue
        if target.parameters and not isinstance(resolved, type):
            names = tuple(inspect.signature(resolved).parameters)
            if names[: len(target.parameters)] != target.parameters:
                problems.append(
                    f"hook target {target.path} takes {names}, expected {target.parameters} first"
                )
    return problems


def admission_fix_problems() -> list[str]:
    try:
        fix = _resolve(ADMISSION_FIX)
    except (ImportError, AttributeError, ValueError):
        return [
            f"this SGLang lacks the upstream admission fix {ADMISSION_FIX} "
            "(rejected requests would reach PD bootstrap); upgrade to 0.5.23"
        ]
    problems = []
    for module_path in ADMISSION_FIX_USERS:
        module = _resolve(module_path)
        if getattr(module, "is_unadmitted_reject", None) is not fix:
            problems.append(
                f"{module_path} does not use the upstream admission fix is_unadmitted_reject"
            )
    return problems


def version_problems() -> list[str]:
    from sglang.version import __version__

    if __version__ not in SUPPORTED_SGLANG_VERSIONS:
        return [
            f"sglang {__version__} is not a version this plugin was verified against "
            f"({sorted(SUPPORTED_SGLANG_VERSIONS)})"
        ]
    return []


def compatibility_problems() -> list[str]:
    return version_problems() + admission_fix_problems() + target_problems()
