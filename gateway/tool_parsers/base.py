"""What every tool-call format shares: where its calls start, and a stream that emits text
until then and each call once its block is complete.

A format only says where its tool-call part begins (``find_start``) and which calls the part
holds so far (``split``: the calls of complete blocks, and at the end the text it leaves).
``ToolCallStream`` turns that into a streaming parser, and ``parse`` is that stream fed the
whole text at once, so the streamed and the whole answer cannot disagree. A call is emitted
only whole (its arguments complete JSON), never a fragment of a tag.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from .types import Functions, Parsed, ToolCall, partial_suffix


@dataclass(slots=True)
class Split:
    calls: list[ToolCall] = field(default_factory=list)
    # Text of the tool-call part that is not a call (only asked for at the end).
    text: str = ""


class ToolFormat(ABC):
    """One model family's way of writing tool calls in its output."""

    # The marker that opens the tool-call part of an output.
    start: str

    def find_start(self, text: str) -> int:
        """Where the tool-call part begins in ``text``, or -1."""
        return text.find(self.start)

    def holdback(self, text: str) -> int:
        """How many characters at the end of ``text`` could still become the start marker."""
        return partial_suffix(text, self.start)

    @abstractmethod
    def split(self, part: str, functions: Functions, final: bool) -> Split:
        """The calls in ``part`` (which begins at the start marker) whose blocks are complete;
        with ``final``, also what an unclosed last block holds, and the leftover text."""


class ToolCallStream:
    """A format's streaming parser for one output: ``feed`` each new piece, then ``finish``."""

    def __init__(self, format_: ToolFormat, functions: Functions) -> None:
        self._format = format_
        self._functions = functions
        self._text = ""
        self._start = -1
        self._text_sent = 0
        self._calls_sent = 0

    def feed(self, delta: str) -> Parsed:
        self._text += delta
        text = self._text
        if self._start < 0:
            self._start = self._format.find_start(text)
            if self._start < 0:
                safe = len(text) - self._format.holdback(text)
                out = text[self._text_sent : safe]
                self._text_sent = max(self._text_sent, safe)
                return Parsed(out)
            out = text[self._text_sent : self._start]
            self._text_sent = self._start
            return Parsed(out, self._new_calls(final=False).calls)
        return Parsed("", self._new_calls(final=False).calls)

    def finish(self) -> Parsed:
        if self._start < 0:
            out = self._text[self._text_sent :]
            self._text_sent = len(self._text)
            return Parsed(out)
        split = self._new_calls(final=True)
        return Parsed(split.text, split.calls)

    @property
    def calls_sent(self) -> int:
        return self._calls_sent

    def _new_calls(self, final: bool) -> Split:
        split = self._format.split(self._text[self._start :], self._functions, final)
        fresh = split.calls[self._calls_sent :]
        self._calls_sent = max(self._calls_sent, len(split.calls))
        return Split(fresh, split.text)


def parse(format_: ToolFormat, text: str, functions: Functions) -> Parsed:
    """The whole output at once: the answer text (trimmed where calls follow it) and calls."""
    stream = ToolCallStream(format_, functions)
    head = stream.feed(text)
    tail = stream.finish()
    calls = head.calls + tail.calls
    if format_.find_start(text) < 0:
        return Parsed(head.text + tail.text, calls)
    return Parsed(_join(head.text, tail.text), calls)


def _join(head: str, tail: str) -> str:
    head, tail = head.strip(), tail.strip()
    return f"{head} {tail}" if head and tail else head or tail
