"""Long work done a slice at a time, the event loop free between two slices (``in_turns``);
long JSON lists written that way (``json_in_turns``), and documents whose one list holds large
items (``json_pieces_in_turns``).

A whole answer's log probabilities grow with its tokens times the alternatives asked for:
built as Python objects and written in one go, those of a few thousand tokens held the loop for
a tenth of a second and more, most of it in the collections of the cyclic GC that so many new
objects set off, and every other tenant's requests waited. Written a slice at a time, only
bytes outlive a slice, and the pieces join into one ``orjson.Fragment``, which ``orjson``
writes into the answer as it is (``JSONList``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeVar

import orjson

T = TypeVar("T")


async def in_turns(total: int, per_turn: int) -> AsyncGenerator[range]:
    """``range(total)`` in slices of ``per_turn`` positions, the loop free between two."""
    for start in range(0, total, per_turn):
        if start:
            await asyncio.sleep(0)
        yield range(start, min(total, start + per_turn))


async def json_in_turns(
    items: Sequence[T], to_json: Callable[[T], Any], per_turn: int
) -> orjson.Fragment:
    """``[to_json(item) for item in items]`` as JSON, written ``per_turn`` items at a time."""
    written = JSONList()
    async for slice_ in in_turns(len(items), per_turn):
        written.add(orjson.dumps([to_json(item) for item in items[slice_.start : slice_.stop]]))
    return written.fragment()


# Where a document's list goes while the rest of it is written: orjson writes a NUL inside a
# string as \u0000, so this one byte can only be the mark.
_LIST_MARK = b"\x00"


async def json_pieces_in_turns(document: dict[str, Any], key: str) -> list[bytes]:
    """``document`` as JSON, in pieces to send one after the other, its list ``key`` written an
    item at a time with the loop free between two: a whole answer's choices, each of which may
    carry megabytes of log probabilities."""
    items = document[key]
    if len(items) < 2:
        return [orjson.dumps(document)]
    head, mark, tail = orjson.dumps({**document, key: orjson.Fragment(_LIST_MARK)}).partition(
        _LIST_MARK
    )
    assert mark and _LIST_MARK not in tail, "the mark is the one NUL byte orjson wrote"
    pieces = [head + b"["]
    for index, item in enumerate(items):
        if index:
            await asyncio.sleep(0)
            pieces.append(b",")
        pieces.append(orjson.dumps(item))
    pieces.append(b"]" + tail)
    return pieces


class JSONList:
    """A JSON list written a piece at a time: each piece a list ``orjson`` wrote, its items
    copied in as the piece comes, so that the whole is never joined in one go (a join of
    megabytes holds the loop for milliseconds, most of it faulting in fresh pages)."""

    __slots__ = ("_fragment", "_written")

    def __init__(self) -> None:
        self._written = bytearray(b"[")
        self._fragment: orjson.Fragment | None = None

    def add(self, written: bytes) -> None:
        """The items of ``written``, a JSON list, after those added so far."""
        if self._fragment is not None:
            raise RuntimeError("the list was read: nothing more can be added")
        if len(written) > 2:  # not []
            if len(self._written) > 1:
                self._written += b","
            self._written += memoryview(written)[1:-1]

    def fragment(self) -> orjson.Fragment:
        """The list, which ``orjson`` writes into a document as it is; nothing can be added
        after."""
        if self._fragment is None:
            self._written += b"]"
            # orjson takes bytes, not a bytearray: the one copy of the whole.
            self._fragment = orjson.Fragment(bytes(self._written))
            self._written = bytearray()
        return self._fragment
