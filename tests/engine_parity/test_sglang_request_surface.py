"""Every field of SGLang's OpenAI request models has a decision here (engine venv).

The test walks the installed SGLang's ``ChatCompletionRequest`` and ``CompletionRequest``
(``sglang.srt.entrypoints.openai.protocol``) field by field: each is honoured as SGLang
honours it, accepted and ignored for a documented reason (``protocol.Ignored``), or refused
with a 400 that says why (isolation-reserved, dangerous, or not offered here). A field that an
SGLang upgrade adds has no entry below and fails here until someone decides; a decision that
changes in the gateway fails here too. Beside it, ``tests/unit/openai`` holds the OpenAI SDK's
fields and vLLM's extensions to the same rule.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic_core import PydanticUndefined

from gateway.openai import protocol
from tests.request_surface import (
    CHAT,
    CHAT_REQUIRED,
    COMPLETION,
    COMPLETION_REQUIRED,
    HONOURED,
    IGNORED,
    REFUSED,
    TOOLS,
    Decision,
    decision,
    parse,
)

sglang_protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")

# A value an SGLang client sends for each field, and what the gateway does with it.
SHARED: dict[str, tuple[Any, Decision]] = {
    # PD and DP routing, request identity, the prefix cache's key: the gateway's alone.
    "bootstrap_host": ("10.0.0.1", REFUSED),
    "bootstrap_port": (8998, REFUSED),
    "bootstrap_room": (7, REFUSED),
    "routed_dp_rank": (0, REFUSED),
    "disagg_prefill_dp_rank": (0, REFUSED),
    "data_parallel_rank": (0, REFUSED),
    "rid": ("mine", REFUSED),
    "extra_key": ("k", REFUSED),
    "cache_salt": ("salt", REFUSED),
    "priority": (1, REFUSED),
    "lora_path": ("adapter", REFUSED),
    "session_id": ("s", REFUSED),
    "session_params": ({"id": "s"}, REFUSED),
    # Code in the engine.
    "custom_logit_processor": ("serialized", REFUSED),
    "custom_params": ({"k": 1}, REFUSED),
    # OpenAI's fields, as the OpenAI SDK conformance test decides them.
    "model": ("m", HONOURED),
    "frequency_penalty": (0.5, HONOURED),
    "presence_penalty": (0.5, HONOURED),
    "logit_bias": ({"5": 1.0}, HONOURED),
    "max_tokens": (8, HONOURED),
    "n": (2, HONOURED),
    "seed": (7, HONOURED),
    "stop": (["\n"], HONOURED),
    "stream": (True, HONOURED),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, HONOURED),
    "temperature": (0.5, HONOURED),
    "top_p": (0.9, HONOURED),
    "user": ("u-1", HONOURED),
    "response_format": ({"type": "json_object"}, HONOURED),
    # SGLang's sampling extensions.
    "top_k": (5, HONOURED),
    "min_p": (0.1, HONOURED),
    "min_tokens": (2, HONOURED),
    "regex": ("[a-z]+", HONOURED),
    "ebnf": ('root ::= "a"', HONOURED),
    "repetition_penalty": (1.1, HONOURED),
    "stop_token_ids": ([3], HONOURED),
    "no_stop_trim": (True, HONOURED),
    "ignore_eos": (True, HONOURED),
    "skip_special_tokens": (False, HONOURED),
    "stop_regex": ("x+", REFUSED),
    "watermark": ({"enabled": True}, REFUSED),
    # The engine's internals in the answer.
    "return_hidden_states": (True, REFUSED),
    "return_routed_experts": (True, REFUSED),
    "routed_experts_start_len": (3, REFUSED),
    "return_cached_tokens_details": (True, REFUSED),
    "return_spec_tokens_details": (True, REFUSED),
    "return_token_ids": (True, REFUSED),
    # Multimodal input.
    "images_config": ({"max_pixels": 1024}, REFUSED),
    "mm_processor_kwargs": ({"k": 1}, REFUSED),
}
CHAT_ONLY: dict[str, tuple[Any, Decision]] = {
    "messages": (CHAT_REQUIRED["messages"], HONOURED),
    "logprobs": (True, HONOURED),
    "top_logprobs": (2, HONOURED),
    "max_completion_tokens": (8, HONOURED),
    "tools": (TOOLS, HONOURED),
    "tool_choice": ("auto", HONOURED),
    "parallel_tool_calls": (False, HONOURED),
    "reasoning_effort": ("low", HONOURED),
    "continue_final_message": (True, HONOURED),
    "separate_reasoning": (False, HONOURED),
    "stream_reasoning": (False, HONOURED),
    "chat_template_kwargs": ({"enable_thinking": False}, HONOURED),
    "thinking": ({"type": "adaptive"}, IGNORED),
    "task": ("title", IGNORED),
    "input_ids": ([1, 2], REFUSED),
    "return_prompt_token_ids": (True, REFUSED),
    "return_meta_info": (True, REFUSED),
    "return_input_ids_in_sglext": (True, REFUSED),
    "return_output_ids_in_sglext": (True, REFUSED),
    "return_sampling_mask": (True, REFUSED),
    "sampling_logprobs_mode": ("support", REFUSED),
    "return_flat_raw_output_top_logprobs": (True, REFUSED),
    "return_flat_raw_top_logprobs_b64": (False, REFUSED),
    "max_dynamic_patch": (4, REFUSED),
    "min_dynamic_patch": (1, REFUSED),
    "use_audio_in_video": (True, REFUSED),
    "video_config": ({"fps": 1}, REFUSED),
}
COMPLETION_ONLY: dict[str, tuple[Any, Decision]] = {
    "prompt": ("Hi", HONOURED),
    "best_of": (2, HONOURED),
    "echo": (True, HONOURED),
    "logprobs": (2, HONOURED),
    "suffix": ("end", REFUSED),
    "json_schema": ('{"type": "object"}', HONOURED),
    "custom_labels": ({"team": "a"}, IGNORED),
}
MODELS = [
    pytest.param(
        sglang_protocol.ChatCompletionRequest,
        CHAT,
        CHAT_REQUIRED,
        {**SHARED, **CHAT_ONLY},
        id="chat",
    ),
    pytest.param(
        sglang_protocol.CompletionRequest,
        COMPLETION,
        COMPLETION_REQUIRED,
        {**SHARED, **COMPLETION_ONLY},
        id="completion",
    ),
]
# SGLang defaults that OpenAI's rules (which the gateway keeps) refuse on their own: SGLang
# replaces tool_choice "auto" by "none" when no tools are given; OpenAI refuses it.
DEFAULT_REFUSED_BY_OPENAI_RULES = {"tool_choice"}


@pytest.mark.parametrize(("sglang_model", "schema", "required", "table"), MODELS)
def test_every_sglang_field_has_a_decision(
    sglang_model: Any,
    schema: type[protocol._Request],
    required: dict[str, Any],
    table: dict[str, tuple[Any, Decision]],
) -> None:
    undecided = set(sglang_model.model_fields) - set(table)
    assert not undecided, (
        f"new SGLang fields: honour, ignore or refuse each, saying why: {undecided}"
    )


@pytest.mark.parametrize(("sglang_model", "schema", "required", "table"), MODELS)
def test_each_sglang_field_is_honoured_ignored_or_refused_as_decided_and_says_why(
    sglang_model: Any,
    schema: type[protocol._Request],
    required: dict[str, Any],
    table: dict[str, tuple[Any, Decision]],
) -> None:
    wrong = {}
    for field in sorted(sglang_model.model_fields):
        value, decided = table[field]
        made, reason = decision(schema, {**required}, field, value)
        if made != decided:
            wrong[field] = (decided, made, reason)
        elif made != HONOURED:
            assert len(reason) > 10, (field, reason)
    assert not wrong, wrong


@pytest.mark.parametrize(("sglang_model", "schema", "required", "table"), MODELS)
def test_sglangs_own_defaults_and_null_ask_for_nothing_and_are_accepted(
    sglang_model: Any,
    schema: type[protocol._Request],
    required: dict[str, Any],
    table: dict[str, tuple[Any, Decision]],
) -> None:
    """A client that sends SGLang's defaults explicitly (a request model dumped whole) is
    served; only the reserved fields are refused even at their default."""
    refused = {}
    for field, info in sglang_model.model_fields.items():
        if field in required or field in DEFAULT_REFUSED_BY_OPENAI_RULES:
            continue
        reserved = field in protocol.RESERVED_FIELDS
        default = info.default
        for value in [None] if default in (None, PydanticUndefined) else [None, default]:
            error = parse(schema, {**required, field: value})
            if (error is not None) != reserved:
                refused[(field, value)] = error.message if error else "accepted"
    assert not refused, refused
