"""A whole answer's log probabilities are written a slice of tokens at a time.

Built as Python objects and written in one go, the log probabilities of 4,096 tokens with 20
alternatives each held the gateway's loop for about a tenth of a second (most of it in the
collections of the cyclic GC that so many new objects set off): every other tenant's
requests waited. ``answers.whole_answer`` now writes them ``positions_per_turn`` tokens at a
time, with the loop free between two, and only bytes outlive a slice. What it writes must be
the very answer the one-go builders give (they still build a stream chunk's).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
import pytest

from gateway.api import answers
from gateway.core.generation import Completion, Trace, positions_per_turn
from gateway.openai import protocol
from tests.loop_turns import with_turns
from tests.schemas import validate_with_model

T = TypeVar("T")

TOP = 3
PER_TURN = positions_per_turn(TOP)
TOKENS = 2 * PER_TURN + 7  # three slices
TRACE = Trace("gen_01JDXYZ0000000000000000000", datetime.now(UTC), 0.0)
FP = answers.system_fingerprint("tiny-llama", "/models/tiny-llama")


def entries(count: int, first: int = 0) -> list[protocol.TokenLogprob]:
    # Tokens of different lengths (and one of two bytes), so that every text offset counts.
    return [
        protocol.TokenLogprob(
            "é" if n % 7 == 0 else "t" * (1 + n % 3),
            -0.5 - n / 1000,
            [(f"a{k}", -1.0 - k) for k in range(TOP)],
        )
        for n in range(first, first + count)
    ]


def completion(
    logprobs: list[protocol.TokenLogprob] | None,
    prompt: protocol.PromptLogprobs | None = None,
    index: int = 0,
) -> Completion:
    return Completion(
        index, "text", "length", 5, len(logprobs or ()), 0, logprobs, prompt_logprobs=prompt
    )


def written(answer: dict[str, Any]) -> Any:
    return orjson.loads(orjson.dumps(answer))


def test_a_whole_chat_answer_is_the_one_go_answer_written_a_slice_at_a_time() -> None:
    logprobs = entries(TOKENS)
    answer, turns = with_turns(
        answers.whole_answer("chat", TRACE, "tiny-llama", FP, [completion(logprobs)], [])
    )
    body = written(answer)
    assert body["choices"][0]["logprobs"] == answers.chat_logprobs(logprobs)
    assert turns >= 2  # the loop ran other work between the three slices
    validate_with_model(protocol.ChatCompletion, body)


def test_a_whole_completion_with_an_echoed_prompt_keeps_every_text_offset() -> None:
    prompt = protocol.PromptLogprobs("<s>", entries(PER_TURN + 3, first=1000))
    logprobs = entries(TOKENS)
    answer, turns = with_turns(
        answers.whole_answer(
            "completion", TRACE, "tiny-llama", FP, [completion(logprobs, prompt)], []
        )
    )
    body = written(answer)
    columns = body["choices"][0]["logprobs"]
    assert columns == answers.completion_logprobs(logprobs, 0, prompt)
    offsets = columns["text_offset"]
    assert offsets[0] == 0 and offsets[1] == len("<s>")
    tokens = columns["tokens"]
    assert all(offsets[n + 1] == offsets[n] + len(tokens[n]) for n in range(len(tokens) - 1))
    assert turns >= 3  # four slices: the prompt's tokens come first
    validate_with_model(protocol.Completion, body)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_no_log_probabilities_and_none_asked_for_stay_distinct(kind: answers.Kind) -> None:
    choices = [completion([], index=0), completion(None, index=1)]
    body = written(asyncio.run(answers.whole_answer(kind, TRACE, "m", FP, choices, choices)))
    first, second = body["choices"]
    assert second["logprobs"] is None
    if kind == "chat":
        assert first["logprobs"] == {"content": [], "refusal": None}
    else:
        columns = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        assert first["logprobs"] == {column: [] for column in columns}


def test_a_scored_prompt_alone_is_its_tokens_with_the_first_unscored() -> None:
    # echo with max_tokens 0: the prompt's scores and no completion token.
    prompt = protocol.PromptLogprobs("<s>", entries(3))
    answer = asyncio.run(
        answers.whole_answer("completion", TRACE, "m", FP, [completion([], prompt)], [])
    )
    columns = written(answer)["choices"][0]["logprobs"]
    assert columns["tokens"][0] == "<s>" and len(columns["tokens"]) == 4
    assert columns["token_logprobs"][0] is None and columns["top_logprobs"][0] is None
