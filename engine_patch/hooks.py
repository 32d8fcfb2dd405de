"""Where each check attaches: the one list of hooks the plugin registers."""

from __future__ import annotations

from functools import partial

from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from engine_patch import capacity, compat, coverage, page_tags, tags
from engine_patch.settings import EngineSettings


def install_hooks(settings: EngineSettings) -> None:
    register = HookRegistry.register
    # Tags: headers -> tokenized request -> Req -> meta_info.
    register(compat.INIT_REQ_STATE.path, partial(tags.read_request_tags, settings), HookType.BEFORE)
    register(compat.CREATE_TOKENIZED.path, tags.carry_tags_to_scheduler, HookType.AFTER)
    register(compat.CREATE_REQ.path, tags.tag_req, HookType.AFTER)
    register(compat.BUILD_EXTRA_INFO.path, tags.echo_tags, HookType.REPLACE)
    register(compat.UPDATE_META_INFO.path, tags.place_echo_in_meta_info, HookType.AROUND)
    # SGLang's switch for the extra-output extension point is a class flag.
    SchedulerOutputStreamer.has_additional_customized_info = True
    # Coverage and binding.
    register(compat.SET_BUF.path, coverage.attest_after_set_buf, HookType.AFTER)
    register(compat.COMMIT.path, partial(coverage.verify_before_commit, settings), HookType.AROUND)
    # Written-by page tags.
    if settings.page_check:
        register(
            compat.VERIFY_CHECKSUMS.path, page_tags.check_pages_before_first_decode, HookType.AROUND
        )
        register(compat.PREPARE_DECODE.path, page_tags.mark_decode_writes, HookType.AFTER)
        # Retraction: the backup must be the request's own pages, the restore is tagged.
        register(compat.OFFLOAD_KV.path, page_tags.check_before_backup, HookType.AROUND)
        register(compat.LOAD_KV.path, page_tags.mark_restored, HookType.AFTER)
    # Pool against context length.
    if settings.startup_gate:
        register(
            compat.WORKER_INFO.path,
            partial(capacity.gate_after_worker_info, settings),
            HookType.AFTER,
        )
    register(compat.INIT_INFO.path, capacity.report_in_init_info, HookType.AFTER)
    register(compat.SET_STARTUP_TIME.path, capacity.apply_clamp_in_tokenizer, HookType.AFTER)
    if settings.prompt_guard:
        register(compat.VALIDATE_ONE.path, capacity.guard_before_validation, HookType.BEFORE)
