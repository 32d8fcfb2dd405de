"""Hermes and Qwen 2.5 / Qwen 3: each call a JSON object inside its own tags,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen puts a newline inside each
tag). Text after the calls is dropped, as SGLang's detectors do."""

from __future__ import annotations

import json

from .base import Split, ToolFormat
from .types import Functions, call_of_object


class TaggedJSONFormat(ToolFormat):
    def __init__(self, start: str, end: str) -> None:
        self.start = start
        self.end = end

    def split(self, part: str, functions: Functions, final: bool) -> Split:
        calls = []
        position = 0
        while (opened := part.find(self.start, position)) != -1:
            body_start = opened + len(self.start)
            closed = part.find(self.end, body_start)
            if closed == -1 and not final:
                break
            body = part[body_start:] if closed == -1 else part[body_start:closed]
            try:
                parsed = json.loads(body.strip())
            except json.JSONDecodeError:
                parsed = None  # a malformed block is no call (and never text)
            for obj in parsed if isinstance(parsed, list) else [parsed]:
                call = call_of_object(obj, functions)
                if call is not None:
                    calls.append(call)
            if closed == -1:
                break
            position = closed + len(self.end)
        return Split(calls)


def hermes() -> ToolFormat:
    return TaggedJSONFormat("<tool_call>", "</tool_call>")


def qwen25() -> ToolFormat:
    return TaggedJSONFormat("<tool_call>\n", "\n</tool_call>")
