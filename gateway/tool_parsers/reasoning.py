"""Reasoning output: the thinking part of an answer, between ``<think>`` and ``</think>``.

DeepSeek-R1 thinks from the first token (its template opens the block), so everything up to
``</think>`` is reasoning; Qwen3 and GLM-4.5+ think only when the output opens with
``<think>``, and a ``<tool_call>`` ends the thinking too (the call itself is then the answer's).
``ReasoningStream`` splits a stream as it comes, holding back only what could still be a
marker; ``split_reasoning`` is the same stream fed the whole text at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import partial_suffix


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    # Reasoning from the first token, without an opening marker.
    forced: bool = False
    # A marker that ends the reasoning and begins the answer (kept in the answer).
    answer_start: str | None = None


@dataclass(slots=True)
class Reasoned:
    reasoning: str = ""
    text: str = ""


class ReasoningStream:
    def __init__(self, format_: ReasoningFormat) -> None:
        self._format = format_
        self._text = ""
        self._position = 0  # everything before it has been handed out (or dropped)
        self._state = "reasoning" if format_.forced else "undecided"

    def feed(self, delta: str) -> Reasoned:
        self._text += delta
        out = Reasoned()
        at_start = self._state == "undecided" or (
            self._state == "reasoning" and self._position == 0
        )
        if at_start and not self._skip_start():
            return out
        if self._state == "reasoning":
            self._reason(out, final=False)
        if self._state == "answer":
            out.text += self._text[self._position :]
            self._position = len(self._text)
        return out

    def finish(self) -> Reasoned:
        out = Reasoned()
        if self._state == "undecided":
            self._state = "answer"
        if self._state == "reasoning":
            self._reason(out, final=True)
        out.text += self._text[self._position :]
        self._position = len(self._text)
        return out

    def _skip_start(self) -> bool:
        """Past the opening markers at the start; False while the text could still be one."""
        start, text = self._format.start, self._text
        position = self._position
        while text.startswith(start, position):
            position += len(start)
        rest = text[position:]
        if (rest and start.startswith(rest)) or (not rest and position == 0):
            return False  # too short to tell
        if self._state == "undecided":
            self._state = "reasoning" if position > 0 else "answer"
        self._position = position
        return True

    def _reason(self, out: Reasoned, final: bool) -> None:
        format_, text = self._format, self._text
        ends = [(text.find(format_.end, self._position), len(format_.end))]
        if format_.answer_start:
            ends.append((text.find(format_.answer_start, self._position), 0))
        found = [(index, skip) for index, skip in ends if index != -1]
        if found:
            index, skip = min(found)
            out.reasoning += text[self._position : index]
            self._position = index + skip
            self._state = "answer"
            return
        if final:
            out.reasoning += text[self._position :]
            self._position = len(text)
            return
        markers = [format_.end, *([format_.answer_start] if format_.answer_start else [])]
        safe = len(text) - max(partial_suffix(text, marker) for marker in markers)
        if safe > self._position:
            out.reasoning += text[self._position : safe]
            self._position = safe


def split_reasoning(format_: ReasoningFormat, text: str) -> Reasoned:
    stream = ReasoningStream(format_)
    first, last = stream.feed(text), stream.finish()
    return Reasoned(first.reasoning + last.reasoning, first.text + last.text)
