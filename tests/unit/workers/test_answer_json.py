"""A large engine answer is scanned, and its per-token lists are parsed a slice at a time.

``orjson.loads`` of a scored prompt of tens of thousands of tokens (five alternatives each)
builds every small list in one call and holds the loop meanwhile. ``parse_answer`` keeps each
position of such a list as raw JSON until the slice that checks it parses it; the answer it
gives, once parsed, must be the very answer ``orjson`` gives, and a position still raw must
never pass for an entry.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.core.generation import checked_logprobs, checked_prompt_scores
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ModelTokenizer
from gateway.verification.verify import Expectation, IsolationFailure, check_logprob_entries
from gateway.workers.answer_json import (
    PER_TOKEN_FIELDS,
    SCAN_FROM_BYTES,
    RawPositions,
    parse_answer,
    parse_positions,
)

GID = "gen_01JTESTTESTTESTTESTTESTTES"
TOP = 5
TOKENS = 3000  # with five alternatives each, an answer of more than SCAN_FROM_BYTES
EXPECTED = Expectation(
    GID, "acme", TOKENS, TOKENS, require_tags=False, top_logprobs=TOP, vocab_size=1000
)


def answer(tokens: int = TOKENS) -> dict[str, Any]:
    """An SGLang answer of ``tokens`` tokens with TOP alternatives each, its prompt of as
    many scored too."""
    ids = [3 + n % 900 for n in range(tokens)]
    top = [[[-1.5 - k / 8, 10 + k, None] for k in range(TOP)] for _ in ids]
    return {
        "text": "x" * tokens,
        "output_ids": ids,
        "meta_info": {
            "id": GID,
            "finish_reason": {"type": "length", "length": tokens},
            "prompt_tokens": tokens,
            "completion_tokens": tokens,
            "output_token_logprobs": [[-0.25, token, None] for token in ids],
            "output_top_logprobs": top,
            "input_token_logprobs": [[None, ids[0], None]]
            + [[-0.5, token, None] for token in ids[1:]],
            "input_top_logprobs": [None, *top[1:]],
        },
    }


def fully_parsed(parsed: dict[str, Any]) -> dict[str, Any]:
    meta = parsed["meta_info"]
    for field in PER_TOKEN_FIELDS:
        parse_positions(meta, (field,), range(len(meta[field])))
        meta[field] = list(meta[field])
    return parsed


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(ensure_tiny_model())


def test_a_large_answer_once_parsed_is_what_orjson_gives() -> None:
    body = orjson.dumps(answer())
    assert len(body) >= SCAN_FROM_BYTES
    parsed = parse_answer(body)
    assert all(isinstance(parsed["meta_info"][f], RawPositions) for f in PER_TOKEN_FIELDS)
    assert fully_parsed(parsed) == orjson.loads(body)


def test_a_small_answer_is_parsed_in_one_call() -> None:
    parsed = parse_answer(orjson.dumps(answer(10)))
    assert parsed == answer(10)
    assert not isinstance(parsed["meta_info"]["output_token_logprobs"], RawPositions)


def test_a_position_still_raw_fails_its_check_closed() -> None:
    meta = parse_answer(orjson.dumps(answer()))["meta_info"]
    parse_positions(meta, ("output_token_logprobs", "output_top_logprobs"), range(10))
    check_logprob_entries(meta, EXPECTED, range(10))
    with pytest.raises(IsolationFailure, match="malformed"):
        check_logprob_entries(meta, EXPECTED, range(10, 11))


@pytest.mark.parametrize(
    "meta",
    [
        None,
        [1, 2],
        {"output_token_logprobs": None, "output_top_logprobs": "no", "pad": "x" * SCAN_FROM_BYTES},
    ],
)
def test_whatever_is_not_a_per_token_list_is_parsed_as_orjson_parses_it(meta: Any) -> None:
    value = {"text": "x" * SCAN_FROM_BYTES, "meta_info": meta}
    assert parse_answer(orjson.dumps(value)) == value


@pytest.mark.parametrize("body", [b"[" * SCAN_FROM_BYTES, b'{"text": "' + b"x" * SCAN_FROM_BYTES])
def test_a_large_body_that_is_not_json_is_orjsons_error(body: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        parse_answer(body)


def test_the_checked_slices_parse_what_they_read(tokenizer: ModelTokenizer) -> None:
    whole = answer()
    meta = parse_answer(orjson.dumps(whole))["meta_info"]
    ids = whole["output_ids"]

    async def read() -> tuple[Any, Any]:
        return (
            await checked_logprobs(meta, EXPECTED, tokenizer),
            await checked_prompt_scores(meta, ids, EXPECTED, tokenizer),
        )

    logprobs, scores = asyncio.run(read())
    assert len(logprobs) == TOKENS and len(scores.rest) == TOKENS - 1
    original = whole["meta_info"]

    async def read_original() -> tuple[Any, Any]:
        return (
            await checked_logprobs(original, EXPECTED, tokenizer),
            await checked_prompt_scores(original, ids, EXPECTED, tokenizer),
        )

    assert (logprobs, scores) == asyncio.run(read_original())


def test_the_checked_slices_let_go_what_they_read_and_a_second_read_fails_closed(
    tokenizer: ModelTokenizer,
) -> None:
    # Parsed, each position is a few small lists the GC walks for as long as the answer lives.
    meta = parse_answer(orjson.dumps(answer()))["meta_info"]
    logprobs = asyncio.run(checked_logprobs(meta, EXPECTED, tokenizer))
    assert len(logprobs) == TOKENS
    for field in ("output_token_logprobs", "output_top_logprobs"):
        assert len(meta[field]) == TOKENS and set(meta[field]) == {None}
    with pytest.raises(IsolationFailure, match="malformed"):
        check_logprob_entries(meta, EXPECTED, range(1))
