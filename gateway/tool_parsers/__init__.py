"""Tool calls and reasoning in model output, per model family, whole or streamed.

The gateway renders prompts and reads outputs itself (it never imports sglang), so it parses
what the model wrote the way SGLang's OpenAI server would: ``policies/models.yaml`` names a
model's ``tool_call_parser`` and ``reasoning_parser`` (SGLang's names), and ``OutputParser``
turns one choice's text into reasoning, answer text and calls. ``tests/engine_parity`` holds
every parser here to SGLang's detectors on the same outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .base import ToolCallStream, ToolFormat
from .deepseek import deepseek_v3, deepseek_v31
from .glm import glm45, glm47
from .hermes import hermes, qwen25
from .json_array import CallArrayStream, call_schema
from .llama3 import llama3
from .mistral import mistral
from .reasoning import ReasoningFormat, ReasoningStream
from .types import Function, Functions, InvalidToolOutput, Parsed, ToolCall

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "Function",
    "Functions",
    "InvalidToolOutput",
    "OutputParser",
    "OutputSpec",
    "ParsedOutput",
    "ToolCall",
    "call_schema",
]

# SGLang's ``--tool-call-parser`` names for the families parsed here.
TOOL_CALL_PARSERS: dict[str, Callable[[], ToolFormat]] = {
    "hermes": hermes,
    "qwen": qwen25,
    "qwen25": qwen25,
    "llama3": llama3,
    "mistral": mistral,
    "deepseekv3": deepseek_v3,
    "deepseekv31": deepseek_v31,
    "glm": glm45,
    "glm45": glm45,
    "glm47": glm47,
}

_THINK_THEN_TOOL = ReasoningFormat(answer_start="<tool_call>")
# SGLang's ``--reasoning-parser`` names for the families parsed here.
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(forced=True),
    "qwen3": _THINK_THEN_TOOL,
    "glm45": _THINK_THEN_TOOL,
}


@dataclass(slots=True)
class ParsedOutput:
    """What a piece of one choice's output adds, per field."""

    reasoning: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class OutputParser:
    """One choice's output: reasoning first (where the model has a reasoning parser), then
    calls in the answer (where the request offered tools), fed as it streams.

    With ``constrained``, the output was decoded under ``call_schema`` and is calls only.
    """

    def __init__(
        self,
        *,
        reasoning: str | None,
        tool_format: str | None,
        functions: Functions,
        constrained: bool = False,
    ) -> None:
        self._reasoning = (
            ReasoningStream(REASONING_PARSERS[reasoning])
            if reasoning is not None and not constrained
            else None
        )
        self._tools: ToolCallStream | CallArrayStream | None = None
        if constrained:
            self._tools = CallArrayStream(functions)
        elif tool_format is not None and functions:
            self._tools = ToolCallStream(TOOL_CALL_PARSERS[tool_format](), functions)

    def feed(self, delta: str) -> ParsedOutput:
        if self._reasoning is None:
            return self._answer("", delta, final=False)
        reasoned = self._reasoning.feed(delta)
        return self._answer(reasoned.reasoning, reasoned.text, final=False)

    def finish(self, cut: bool = False) -> ParsedOutput:
        """What the output's end adds. ``cut``: the engine stopped at a limit the client set
        (``max_tokens``, a stop sequence), so a constrained output may end unfinished."""
        reasoning, text = "", ""
        if self._reasoning is not None:
            reasoned = self._reasoning.finish()
            reasoning, text = reasoned.reasoning, reasoned.text
        return self._answer(reasoning, text, final=True, cut=cut)

    def parse(self, text: str, cut: bool = False) -> ParsedOutput:
        """The whole output at once."""
        first, last = self.feed(text), self.finish(cut)
        calls = first.calls + last.calls
        answer = first.text + last.text
        # Around calls, whitespace is the tags' layout, not the answer's (as SGLang trims it).
        return ParsedOutput(
            first.reasoning + last.reasoning, answer.strip() if calls else answer, calls
        )

    def _answer(self, reasoning: str, text: str, final: bool, cut: bool = False) -> ParsedOutput:
        if self._tools is None:
            return ParsedOutput(reasoning, text)
        parsed = self._tools.feed(text) if text else Parsed()
        if final:
            tools = self._tools
            last = tools.finish(cut) if isinstance(tools, CallArrayStream) else tools.finish()
            parsed = Parsed(parsed.text + last.text, parsed.calls + last.calls)
        return ParsedOutput(reasoning, parsed.text, parsed.calls)


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How a request's outputs are read: the model's parsers, the functions it may call, and
    whether decoding was constrained to calls."""

    reasoning: str | None
    tool_format: str | None
    functions: Functions
    constrained: bool = False
    # Streamed reasoning as it comes (SGLang's ``stream_reasoning``), or whole once it ends.
    stream_reasoning: bool = True

    def parser(self) -> OutputParser:
        return OutputParser(
            reasoning=self.reasoning,
            tool_format=self.tool_format,
            functions=self.functions,
            constrained=self.constrained,
        )
