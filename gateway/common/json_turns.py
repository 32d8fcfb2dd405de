"""Long work done a slice at a time, the event loop free between two slices (``in_turns``);
long JSON lists written that way (``json_in_turns``).

A whole answer's log probabilities grow with its tokens times the alternatives asked for:
built as Python objects and written in one go, those of a few thousand tokens held the loop for
a tenth of a second and more, most of it in the collections of the cyclic GC that so many new
objects set off, and every other tenant's requests waited. Written a slice at a time, only
bytes outlive a slice, and the pieces join into one ``orjson.Fragment``, which ``orjson``
writes into the answer as it is.
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
    pieces = [
        orjson.dumps([to_json(item) for item in items[slice_.start : slice_.stop]])
        async for slice_ in in_turns(len(items), per_turn)
    ]
    return json_array(pieces)


def json_array(lists: list[bytes]) -> orjson.Fragment:
    """The JSON lists ``lists``, each written by ``orjson``, as one list."""
    # Each list's items without its brackets, as views: no copy but the one join makes.
    items = [memoryview(written)[1:-1] for written in lists if written != b"[]"]
    return orjson.Fragment(b"".join((b"[", b",".join(items), b"]")))
