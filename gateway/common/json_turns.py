"""Long JSON lists written a slice at a time, the event loop free between two slices.

A whole answer's log probabilities grow with its tokens times the alternatives asked for:
built as Python objects and written in one go, those of a few thousand tokens held the loop for
a tenth of a second and more, most of it in the collections of the cyclic GC that so many new
objects set off, and every other tenant's requests waited. Written a slice at a time, only
bytes outlive a slice, and the pieces join into one ``orjson.Fragment``, which ``orjson``
writes into the answer as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson

T = TypeVar("T")


async def json_in_turns(
    items: Sequence[T], to_json: Callable[[T], Any], per_turn: int
) -> orjson.Fragment:
    """``[to_json(item) for item in items]`` as JSON, written ``per_turn`` items at a time."""
    pieces = []
    for start in range(0, len(items), per_turn):
        if start:
            await asyncio.sleep(0)
        pieces.append(orjson.dumps([to_json(item) for item in items[start : start + per_turn]]))
    return json_array(pieces)


def json_array(lists: list[bytes]) -> orjson.Fragment:
    """The JSON lists ``lists``, each written by ``orjson``, as one list."""
    # Each list's items without its brackets, as views: no copy but the one join makes.
    items = [memoryview(written)[1:-1] for written in lists if written != b"[]"]
    return orjson.Fragment(b"".join((b"[", b",".join(items), b"]")))
