"""A scored prompt (``echo`` with log probabilities) is checked and read a slice at a time.

Checking and reading the scores of a prompt of 16k tokens with five alternatives each, whole,
held the gateway's loop for about 0.13 s: every other tenant's requests waited. Between two
slices of ``PROMPT_SCORES_PER_TURN`` positions the loop is free; a slice that fails a check
still fails the whole answer closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.core.generation import PROMPT_SCORES_PER_TURN, checked_prompt_scores
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ModelTokenizer
from gateway.verification.verify import Expectation, IsolationFailure

GID = "gen_01JTESTTESTTESTTESTTESTTES"
TOP = 2
LENGTH = 2 * PROMPT_SCORES_PER_TURN + 100  # three slices
INPUT_IDS = [3 + position % 400 for position in range(LENGTH)]
EXPECTED = Expectation(
    GID, "acme", LENGTH, 1, require_tags=False, top_logprobs=TOP, vocab_size=1000
)


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


def scored_with_turns(meta: dict[str, Any], tokenizer: ModelTokenizer) -> tuple[Any, int]:
    """What ``checked_prompt_scores`` returns (or raises), and how many times another task ran
    while it did."""

    async def run() -> tuple[Any, int]:
        turns = 0
        done = False

        async def other_tenant() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        other = asyncio.create_task(other_tenant())
        await asyncio.sleep(0)
        turns = 0
        try:
            result: Any = await checked_prompt_scores(meta, INPUT_IDS, EXPECTED, tokenizer)
        except IsolationFailure as failure:
            result = failure
        done = True
        await other
        return result, turns

    return asyncio.run(run())


def test_a_long_scored_prompt_leaves_the_loop_free_between_slices(
    tokenizer: ModelTokenizer,
) -> None:
    scores, turns = scored_with_turns(prefill_meta(), tokenizer)
    assert turns >= 2  # one between each two of the three slices
    assert scores.first_token == tokenizer.token_text(INPUT_IDS[0])
    assert [s.token for s in scores.rest] == [tokenizer.token_text(t) for t in INPUT_IDS[1:]]
    assert all(len(s.top) == TOP for s in scores.rest)


@pytest.mark.parametrize("position", [1, PROMPT_SCORES_PER_TURN, LENGTH - 1])
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
