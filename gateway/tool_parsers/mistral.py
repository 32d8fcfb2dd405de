"""Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or the compact form of
newer models, ``[TOOL_CALLS]name[ARGS]{...}`` once per call."""

from __future__ import annotations

import json

from .base import Split, ToolFormat
from .types import Functions, call_of_object, json_items, make_call

_ARGS = "[ARGS]"


class MistralFormat(ToolFormat):
    start = "[TOOL_CALLS]"

    def split(self, part: str, functions: Functions, final: bool) -> Split:
        body = part[len(self.start) :]
        stripped = body.lstrip()
        if stripped.startswith("["):
            offset = len(part) - len(stripped)
            items, _closed, end = json_items(part, offset)
            calls = [c for obj in items if (c := call_of_object(obj, functions)) is not None]
            return Split(calls, part[end:].strip() if final and _closed else "")
        return self._compact(part, functions, final)

    def _compact(self, part: str, functions: Functions, final: bool) -> Split:
        decoder = json.JSONDecoder()
        calls = []
        position = 0
        while part.startswith(self.start, position):
            name_start = position + len(self.start)
            args_at = part.find(_ARGS, name_start)
            if args_at == -1:
                break
            try:
                arguments, end = decoder.raw_decode(part, args_at + len(_ARGS))
            except json.JSONDecodeError:
                break
            call = make_call(part[name_start:args_at], arguments, functions)
            if call is not None:
                calls.append(call)
            position = end
            while position < len(part) and part[position].isspace():
                position += 1
        return Split(calls, part[position:].strip() if final else "")


def mistral() -> ToolFormat:
    return MistralFormat()
