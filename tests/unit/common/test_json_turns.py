"""``JSONList``: a JSON list written a piece at a time reads as the list ``orjson`` writes whole,
and, once read, takes no more (what was written out must be all there is)."""

from __future__ import annotations

import orjson
import pytest

from gateway.common.json_turns import JSONList


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
