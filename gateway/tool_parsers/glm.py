"""GLM-4.5 / 4.6 and GLM-4.7 / 5: each call ``<tool_call>NAME`` then
``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`` pairs, then ``</tool_call>``; 4.5 puts a
newline after the name and between pairs, 4.7 nothing. Values are text: one the function's
schema types as a string stays text, any other is read as JSON where it is JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .base import Split, ToolFormat
from .types import Function, Functions, make_call

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_45 = re.compile(r"(.*?)(?:\\n|\n)(.*)", re.DOTALL)
_NAME_47 = re.compile(r"(.*?)(<arg_key>.*)?$", re.DOTALL)


class GLMFormat(ToolFormat):
    start = START

    def __init__(self, name_pattern: re.Pattern[str], keeps_text_between: bool) -> None:
        self._name = name_pattern
        self._keeps_text = keeps_text_between

    def split(self, part: str, functions: Functions, final: bool) -> Split:
        calls = []
        texts = []
        position = 0
        for block in _BLOCK.finditer(part):
            texts.append(part[position : block.start()])
            position = block.end()
            head = self._name.match(block.group(1))
            if head is None:
                continue
            name = head.group(1).strip()
            arguments = _arguments(_PAIR.findall(head.group(2) or ""), functions.get(name))
            call = make_call(name, arguments, functions)
            if call is not None:
                calls.append(call)
        texts.append(part[position:])
        text = "".join(texts) if final and self._keeps_text else ""
        return Split(calls, text if START not in text else "")


def _arguments(pairs: list[tuple[str, str]], function: Function | None) -> dict[str, Any]:
    properties: Mapping[str, Any] = {}
    if function is not None:
        found = function.parameters.get("properties")
        properties = found if isinstance(found, Mapping) else {}
    arguments: dict[str, Any] = {}
    for raw_key, value in pairs:
        key = raw_key.strip()
        schema = properties.get(key)
        kind = schema.get("type") if isinstance(schema, Mapping) else None
        arguments[key] = _value(value, kind)
    return arguments


def _value(text: str, kind: Any) -> Any:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return text  # not JSON: the text as written
    if kind == "string":
        if isinstance(parsed, str):
            return parsed
        return json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict | list) else text
    return parsed


def glm45() -> ToolFormat:
    return GLMFormat(_NAME_45, keeps_text_between=False)


def glm47() -> ToolFormat:
    return GLMFormat(_NAME_47, keeps_text_between=True)
