"""DeepSeek V3 and V3.1: calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``,
each ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``. V3 writes
``function<｜tool▁sep｜>NAME`` then the arguments in a fenced json block; V3.1 writes
``NAME<｜tool▁sep｜>ARGUMENTS``. Text after the calls is dropped, as SGLang's detectors do."""

from __future__ import annotations

import json
import re

from .base import Split, ToolFormat
from .types import Functions, make_call

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_V3_CALL = re.compile(
    re.escape(CALL_BEGIN)
    + r"(?P<kind>.*?)"
    + re.escape(SEP)
    + r"(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
    + re.escape(CALL_END),
    re.DOTALL,
)
_V31_CALL = re.compile(
    re.escape(CALL_BEGIN)
    + r"(?P<name>.*?)"
    + re.escape(SEP)
    + r"(?P<args>.*?)"
    + re.escape(CALL_END),
    re.DOTALL,
)


class DeepSeekFormat(ToolFormat):
    start = CALLS_BEGIN

    def __init__(self, call: re.Pattern[str]) -> None:
        self._call = call

    def split(self, part: str, functions: Functions, final: bool) -> Split:
        calls = []
        for match in self._call.finditer(part):
            try:
                arguments = json.loads(match.group("args"))
            except json.JSONDecodeError:
                continue  # a malformed call is no call (and never text)
            call = make_call(match.group("name"), arguments, functions)
            if call is not None:
                calls.append(call)
        return Split(calls)


def deepseek_v3() -> ToolFormat:
    return DeepSeekFormat(_V3_CALL)


def deepseek_v31() -> ToolFormat:
    return DeepSeekFormat(_V31_CALL)
