"""Llama 3.1 / 3.2 JSON: ``<|python_tag|>`` (or an output that begins with ``{``) then one or
more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``."""

from __future__ import annotations

import json

from .base import Split, ToolFormat
from .types import Functions, call_of_object

_SEPARATOR = ";"


class Llama3Format(ToolFormat):
    start = "<|python_tag|>"

    def find_start(self, text: str) -> int:
        return 0 if text.startswith("{") else text.find(self.start)

    def split(self, part: str, functions: Functions, final: bool) -> Split:
        position = len(self.start) if part.startswith(self.start) else 0
        decoder = json.JSONDecoder()
        calls = []
        while True:
            while position < len(part) and part[position].isspace():
                position += 1
            try:
                obj, end = decoder.raw_decode(part, position)
            except json.JSONDecodeError:
                break
            call = call_of_object(obj, functions)
            if call is not None:
                calls.append(call)
            position = end
            while position < len(part) and part[position].isspace():
                position += 1
            if not part.startswith(_SEPARATOR, position):
                break
            position += len(_SEPARATOR)
        return Split(calls, part[position:].strip() if final else "")


def llama3() -> ToolFormat:
    return Llama3Format()
