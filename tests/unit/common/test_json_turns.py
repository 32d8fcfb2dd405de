"""``JSONList``: a JSON list written a piece at a time reads as the list ``orjson`` writes whole,
and, once read, takes no more (what was written out must be all there is).
``json_pieces_in_turns``: a document whose list is written an item at a time, the loop free
between two, is the document ``orjson`` writes whole, whatever its other fields hold."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.common.json_turns import JSONList, json_pieces_in_turns
from tests.loop_turns import with_turns


def test_pieces_written_apart_read_as_the_list_written_whole() -> None:
    pieces: list[list[object]] = [[1, "a"], [], [{"b": [2.5, None]}], [], ["é"]]
    written = JSONList()
    for piece in pieces:
        written.add(orjson.dumps(piece))
    whole = [value for piece in pieces for value in piece]
    assert orjson.loads(orjson.dumps({"list": written.fragment()})) == {"list": whole}


def test_a_list_of_no_pieces_or_only_empty_ones_is_empty() -> None:
    nothing, empties = JSONList(), JSONList()
    empties.add(b"[]")
    empties.add(b"[]")
    assert orjson.dumps([nothing.fragment(), empties.fragment()]) == b"[[],[]]"


def test_a_list_once_read_takes_nothing_more_and_reads_the_same() -> None:
    written = JSONList()
    written.add(b"[1]")
    first = orjson.dumps(written.fragment())
    with pytest.raises(RuntimeError):
        written.add(b"[2]")
    assert orjson.dumps(written.fragment()) == first == b"[1]"


def test_a_document_written_an_item_of_its_list_at_a_time_is_the_whole_document() -> None:
    # A tenant's model name may hold a NUL: the list's mark must not be taken for it.
    choices = [{"index": n, "logprobs": orjson.Fragment(b"[1,2]")} for n in range(4)]
    document = {"id": "x", "model": "m\x00\u0000", "choices": choices, "usage": {"n": 4}}
    pieces, turns = with_turns(json_pieces_in_turns(document, "choices"))
    assert b"".join(pieces) == orjson.dumps(document)
    assert len(pieces) == 2 + 2 * len(choices) - 1  # head, items and commas, tail
    assert turns >= len(choices) - 1  # the loop ran other work between two items


@pytest.mark.parametrize("count", [0, 1])
def test_a_document_with_one_item_or_none_is_written_in_one_go(count: int) -> None:
    document = {"choices": [{"index": n} for n in range(count)], "model": "m"}
    pieces = asyncio.run(json_pieces_in_turns(document, "choices"))
    assert pieces == [orjson.dumps(document)]
