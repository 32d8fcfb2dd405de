"""An engine's whole answer parsed without holding the loop for as long as the answer is long.

A whole answer's log probabilities, and a scored prompt's, grow with its tokens times the
alternatives asked for: a prompt of tens of thousands of tokens with five alternatives each is
megabytes of small JSON lists, and ``orjson.loads`` builds every one of them in one call, the
GIL held throughout (a thread would hold the loop just the same). So an answer of at least
``SCAN_FROM_BYTES`` is scanned instead: its log-probability lists keep one raw JSON value per
position (``RawPositions``), found by a scan that builds no object for what is inside them, and
whoever checks the positions parses them a slice at a time (``RawPositions.parse``), with the
loop free between two slices. Everything else in the answer is parsed as ``orjson`` would.

A position still raw is no log-probability entry: a check that reads one before it is parsed
fails closed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

# Answers smaller than this are parsed in one call: it takes about as long as the scan.
SCAN_FROM_BYTES = 256 * 1024

# The lists of SGLang's ``meta_info`` with one item per token.
PER_TOKEN_FIELDS = frozenset(
    {"output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"}
)

_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_POSITIONS = msgspec.json.Decoder(list[msgspec.Raw])
_ANY = msgspec.json.Decoder()


class RawPositions(list[Any]):
    """A per-token list of an engine's answer whose items stay raw JSON until ``parse``d."""

    def parse(self, positions: range) -> None:
        """The items at ``positions`` parsed (those parsed already are left as they are)."""
        decode = _ANY.decode
        for position in positions:
            if position >= len(self):
                break  # a list shorter than asked for: its check says so
            item = self[position]
            if isinstance(item, msgspec.Raw):
                self[position] = decode(item)

    def release(self, positions: range) -> None:
        """The items at ``positions`` (a run of them) replaced by ``None``."""
        stop = min(positions.stop, len(self))
        if positions.start < stop:
            self[positions.start : stop] = [None] * (stop - positions.start)


def parse_positions(meta: Any, fields: tuple[str, ...], positions: range) -> None:
    """``meta``'s ``fields`` parsed at ``positions``, where they are ``RawPositions``."""
    for values in _raw_lists(meta, fields):
        values.parse(positions)


def release_positions(meta: Any, fields: tuple[str, ...], positions: range) -> None:
    """``meta``'s ``fields`` let go at ``positions``, where they are ``RawPositions``, once
    whoever checked them has read them: parsed, each is a few small lists, which the cyclic GC
    walks at every full collection for as long as the answer lives. A position let go is
    ``None``: no entry, so a check that reads it again fails closed."""
    for values in _raw_lists(meta, fields):
        values.release(positions)


def _raw_lists(meta: Any, fields: tuple[str, ...]) -> list[RawPositions]:
    if not isinstance(meta, dict):
        return []
    return [values for field in fields if isinstance(values := meta.get(field), RawPositions)]


def parse_answer(body: bytes) -> Any:
    """The engine's answer ``body``, as ``orjson.loads`` gives it but for the per-token lists
    of a large one's ``meta_info`` (``RawPositions``); raises ``orjson.JSONDecodeError`` for
    what is not JSON."""
    if len(body) < SCAN_FROM_BYTES:
        return orjson.loads(body)
    try:
        fields = _FIELDS.decode(body)
        return {
            name: _meta(value) if name == "meta_info" else _ANY.decode(value)
            for name, value in fields.items()
        }
    except msgspec.MsgspecError:  # not an object, or not JSON: whatever orjson makes of it
        return orjson.loads(body)


def _meta(raw: msgspec.Raw) -> Any:
    try:
        fields = _FIELDS.decode(raw)
    except msgspec.ValidationError:  # not an object: the checks say what is wrong with it
        return _ANY.decode(raw)
    return {
        name: _per_token(value) if name in PER_TOKEN_FIELDS else _ANY.decode(value)
        for name, value in fields.items()
    }


def _per_token(raw: msgspec.Raw) -> Any:
    try:
        return RawPositions(_POSITIONS.decode(raw))
    except msgspec.ValidationError:  # not a list (null, when none were asked for)
        return _ANY.decode(raw)
