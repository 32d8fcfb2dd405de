"""Tenant and generation tags: request headers -> Req on every worker -> meta_info.

The gateway sends ``X-Isolation-Tenant`` and ``X-Isolation-Generation``. They are
read where the HTTP request is still in hand (``TokenizerManager._init_req_state``),
carried to the scheduler in a subclass of ``TokenizedGenerateReqInput`` (the IPC
message), set on ``Req`` when the scheduler creates it, and echoed from the Req
in every output's ``meta_info`` -- so their return proves they reached the worker
that produced the output (decode, in PD mode).
"""

from __future__ import annotations

import re
from typing import Any

from sglang.srt.managers.io_struct import (
    GenerateReqInput,
    TokenizedGenerateReqInput,
    hook_custom_types,
)

from engine_patch.events import DECISIONS
from engine_patch.settings import EngineSettings

TENANT_HEADER = "x-isolation-tenant"
GENERATION_HEADER = "x-isolation-generation"

META_TENANT = "isolation_tenant"
META_GENERATION = "isolation_generation"
META_VERIFIED = "isolation_verified"
ECHO_KEYS = (META_TENANT, META_GENERATION, META_VERIFIED)

# Printable, no whitespace, bounded: a tag is an identifier, not a payload.
_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


# SGLang is untyped (Any base); kw_only is a msgspec.Struct class option mypy cannot see.
class TaggedGenerateReqInput(TokenizedGenerateReqInput, kw_only=True):  # type: ignore[misc, call-arg]
    """The scheduler-bound request, with the isolation tags appended.

    A tail-appended msgspec subclass: registered with SGLang's IPC decoder in
    every process that loads the plugin."""

    isolation_tenant: str | None = None
    isolation_generation: str | None = None


hook_custom_types(TaggedGenerateReqInput)


class TagError(ValueError):
    """A malformed or inconsistent isolation tag; SGLang answers a ValueError with 400."""

    status_code = 400


def tags_from_headers(headers: Any) -> tuple[str | None, str | None]:
    """(tenant, generation) from request headers, validated; (None, None) if untagged."""
    tenant = headers.get(TENANT_HEADER) if headers is not None else None
    generation = headers.get(GENERATION_HEADER) if headers is not None else None
    if tenant is None and generation is None:
        return None, None
    if tenant is None or generation is None:
        raise TagError(
            f"isolation tags come in pairs: send both {TENANT_HEADER} and {GENERATION_HEADER}"
        )
    for name, value in ((TENANT_HEADER, tenant), (GENERATION_HEADER, generation)):
        if not _TAG_PATTERN.match(value):
            raise TagError(f"{name} is not a valid isolation tag")
    return tenant, generation


def read_request_tags(
    settings: EngineSettings, tokenizer_manager: Any, obj: Any, request: Any = None
) -> None:
    """BEFORE TokenizerManager._init_req_state: read and check the tags, keep them on obj."""
    if not isinstance(obj, GenerateReqInput):
        return None
    headers = request.headers if request is not None else None
    try:
        tenant, generation = tags_from_headers(headers)
        if generation is None:
            if settings.require_tags and not _is_internal(obj):
                raise TagError(
                    "this worker requires isolation tags on every request "
                    f"({TENANT_HEADER}, {GENERATION_HEADER})"
                )
            return None
        if not obj.is_single:
            raise TagError("isolation-tagged requests must be single, not batched")
        if obj.rid != generation:
            raise TagError(f"rid must equal {GENERATION_HEADER} on an isolation-tagged request")
    except TagError as error:
        DECISIONS.record_refused("bad_tags", _rid_text(obj), str(error))
        raise
    obj.isogate_tenant = tenant
    obj.isogate_generation = generation
    return None


def _is_internal(obj: Any) -> bool:
    # SGLang's own health probe generates through the same path, untagged.
    rid = obj.rid if isinstance(obj.rid, str) else ""
    return rid.startswith("HEALTH_CHECK")


def _rid_text(obj: Any) -> str | None:
    return obj.rid if isinstance(obj.rid, str) else None


def carry_tags_to_scheduler(
    result: Any, tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any
) -> Any:
    """AFTER TokenizerManager._create_tokenized_object: re-type a tagged request.

    Only tagged requests change type, so untagged and batched traffic keeps
    SGLang's own message untouched."""
    generation = getattr(obj, "isogate_generation", None)
    if generation is None or type(result) is not TokenizedGenerateReqInput:
        return result
    fields = {name: getattr(result, name) for name in result.__struct_fields__}
    return TaggedGenerateReqInput(
        **fields,
        isolation_tenant=obj.isogate_tenant,
        isolation_generation=generation,
    )


def tag_req(result: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler._create_generation_req: copy the tags onto the Req."""
    result.isolation_tenant = getattr(recv_req, "isolation_tenant", None)
    result.isolation_generation = getattr(recv_req, "isolation_generation", None)
    result.isolation_verified = False
    return result


EchoInfo = dict[str, list[list[str]] | list[list[bool]]]


def echo_tags(streamer: Any, reqs: list[Any]) -> EchoInfo:
    """REPLACE SchedulerOutputStreamer.build_additional_customized_info.

    SGLang's extension point for per-request output fields: one entry per
    emitted request, attached to every output batch (each stream chunk too)."""
    tenants: list[list[str]] = []
    generations: list[list[str]] = []
    verified: list[list[bool]] = []
    for req in reqs:
        generation = getattr(req, "isolation_generation", None)
        if generation is None:
            tenants.append([])
            generations.append([])
            verified.append([])
            continue
        tenants.append([req.isolation_tenant])
        generations.append([generation])
        verified.append([bool(getattr(req, "isolation_verified", False))])
    return {META_TENANT: tenants, META_GENERATION: generations, META_VERIFIED: verified}


def place_echo_in_meta_info(
    original: Any,
    tokenizer_manager: Any,
    meta_info: dict[str, Any],
    state: Any,
    customized_info: dict[str, list[Any]],
    index: int,
    finish_reason: Any,
) -> None:
    """AROUND TokenizerManager.update_request_meta_info.

    The echo keys are request-level scalars: set them as plain values on each
    chunk instead of letting SGLang accumulate them into growing lists."""
    passthrough: dict[str, list[Any]] = {}
    for key, values in customized_info.items():
        if key in ECHO_KEYS:
            value = values[index]
            if value:
                meta_info[key] = value[0]
        else:
            passthrough[key] = values
    if passthrough:
        original(tokenizer_manager, meta_info, state, passthrough, index, finish_reason)
    return None
