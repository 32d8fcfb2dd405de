"""The value types every tool-call and reasoning parser speaks (no imports of the gateway)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Function:
    """A function the request offers the model: its name and its parameters' JSON schema."""

    name: str
    parameters: Mapping[str, Any]


Functions = Mapping[str, Function]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(slots=True)
class Parsed:
    """What a piece of model output adds: answer text and complete calls."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class InvalidToolOutput(Exception):
    """Output that constrained decoding promised to be calls, and is not."""


def make_call(name: str, arguments: Any, functions: Functions) -> ToolCall | None:
    """A call to an offered function, its arguments serialised as JSON (non-ASCII kept, so a
    scan of the text sees what the model wrote); None for a function nobody offered."""
    name = name.strip()
    if name not in functions:
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def call_of_object(obj: Any, functions: Functions) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments"|"parameters": {...}}``; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("parameters") or obj.get("arguments") or {}
    return make_call(obj["name"], arguments, functions)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a strict start of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def json_items(text: str, start: int) -> tuple[list[Any], bool, int]:
    """The complete items of a JSON array opening at ``text[start]`` (``[``): the items, whether
    the array was closed, and where it ended (or where parsing stopped)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    position = start + 1
    length = len(text)
    while True:
        while position < length and text[position].isspace():
            position += 1
        if position >= length:
            return items, False, position
        if text[position] == "]":
            return items, True, position + 1
        if items:
            if text[position] != ",":
                return items, False, position
            position += 1
            while position < length and text[position].isspace():
                position += 1
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return items, False, position
        items.append(item)
