"""Log probabilities of a whole answer, and a scored prompt (``echo``), are checked and read a
slice at a time.

Checking and reading the scores of a prompt of 16k tokens with five alternatives each, whole,
held the gateway's loop for about 0.13 s, and 1,024 output tokens with 20 alternatives each
tens of milliseconds: every other tenant's requests waited. Between two slices
(``positions_per_turn``) the loop is free; a slice that fails a check still fails the whole
answer closed.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.generation import (
    checked_logprobs,
    checked_prompt_scores,
    positions_per_turn,
)
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ModelTokenizer
from gateway.verification.verify import Expectation, IsolationFailure
from tests.loop_turns import with_turns

GID = "gen_01JTESTTESTTESTTESTTESTTES"
TOP = 2
EXPECTED = Expectation(GID, "acme", 0, 1, require_tags=False, top_logprobs=TOP, vocab_size=1000)
PER_TURN = positions_per_turn(EXPECTED.top_logprobs)
LENGTH = 2 * PER_TURN + 100  # three slices
INPUT_IDS = [3 + position % 400 for position in range(LENGTH)]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(ensure_tiny_model())


def prefill_meta() -> dict[str, Any]:
    return {
        "id": GID,
        "input_token_logprobs": [
            [None if p == 0 else -0.5, token, None] for p, token in enumerate(INPUT_IDS)
        ],
        "input_top_logprobs": [None]
        + [[[-0.5 - k, 10 + k, None] for k in range(TOP)] for _ in INPUT_IDS[1:]],
    }


def scored_with_turns(
    meta: dict[str, Any], tokenizer: ModelTokenizer, *, prompt: bool = True
) -> tuple[Any, int]:
    """What ``checked_prompt_scores`` (or, not ``prompt``, ``checked_logprobs``) returns (or
    raises), and how many times another task ran while it did."""

    async def read() -> Any:
        try:
            if prompt:
                return await checked_prompt_scores(meta, INPUT_IDS, EXPECTED, tokenizer)
            return await checked_logprobs(meta, EXPECTED, tokenizer)
        except IsolationFailure as failure:
            return failure

    return with_turns(read())


def test_a_long_scored_prompt_leaves_the_loop_free_between_slices(
    tokenizer: ModelTokenizer,
) -> None:
    scores, turns = scored_with_turns(prefill_meta(), tokenizer)
    assert turns >= 2  # one between each two of the three slices
    assert scores.first_token == tokenizer.token_text(INPUT_IDS[0])
    assert [s.token for s in scores.rest] == [tokenizer.token_text(t) for t in INPUT_IDS[1:]]
    assert all(len(s.top) == TOP for s in scores.rest)


@pytest.mark.parametrize("position", [1, PER_TURN, LENGTH - 1])
def test_a_wrong_score_in_any_slice_fails_the_answer_closed(
    tokenizer: ModelTokenizer, position: int
) -> None:
    meta = prefill_meta()
    meta["input_token_logprobs"][position][1] += 1  # a token that is not the prompt's
    failure, _ = scored_with_turns(meta, tokenizer)
    assert isinstance(failure, IsolationFailure) and "not the prompt's" in failure.reason


def test_a_wrong_alternative_in_the_last_slice_fails_the_answer_closed(
    tokenizer: ModelTokenizer,
) -> None:
    meta = prefill_meta()
    meta["input_top_logprobs"][LENGTH - 1] = meta["input_top_logprobs"][LENGTH - 1][:1]
    failure, _ = scored_with_turns(meta, tokenizer)
    assert isinstance(failure, IsolationFailure) and "top log probabilities" in failure.reason


def answer_meta() -> dict[str, Any]:
    """A whole answer of LENGTH tokens, as prefill and decode return it (shape checked)."""
    return {
        "output_token_logprobs": [[-0.5, token, None] for token in INPUT_IDS],
        "output_top_logprobs": [[[-0.5 - k, 10 + k, None] for k in range(TOP)] for _ in INPUT_IDS],
    }


def test_a_long_answers_log_probabilities_leave_the_loop_free_between_slices(
    tokenizer: ModelTokenizer,
) -> None:
    logprobs, turns = scored_with_turns(answer_meta(), tokenizer, prompt=False)
    assert turns >= 2
    assert [t.token for t in logprobs] == [tokenizer.token_text(t) for t in INPUT_IDS]


@pytest.mark.parametrize("position", [0, PER_TURN, LENGTH - 1])
def test_a_token_outside_the_vocabulary_in_any_slice_fails_the_answer_closed(
    tokenizer: ModelTokenizer, position: int
) -> None:
    meta = answer_meta()
    meta["output_top_logprobs"][position][1][1] = 10**6
    failure, _ = scored_with_turns(meta, tokenizer, prompt=False)
    assert isinstance(failure, IsolationFailure) and "outside the vocabulary" in failure.reason
