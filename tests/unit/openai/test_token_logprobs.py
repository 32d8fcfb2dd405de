"""``TokenLogprobs``: a whole answer's log probabilities in columns read as the list of
``TokenLogprob`` they stand for, and hold no object per token or alternative that the cyclic GC
would walk (or that would be freed one by one when the answer has gone)."""

from __future__ import annotations

import gc

import pytest

from gateway.openai.protocol import TokenLogprob, TokenLogprobs


def entries(count: int, first: int = 0) -> list[TokenLogprob]:
    # Alternatives of different counts, none for some tokens.
    return [
        TokenLogprob(f"t{n}", -0.5 - n, [(f"a{n}.{k}", -1.0 - k) for k in range(n % 4)])
        for n in range(first, first + count)
    ]


def test_columns_read_as_the_entries_they_were_made_of() -> None:
    listed = entries(9)
    columns = TokenLogprobs.of(listed)
    assert len(columns) == 9 and list(columns) == listed and columns == listed
    assert columns[0] == listed[0] and columns[-1] == listed[-1] and columns[5] == listed[5]
    with pytest.raises(IndexError):
        columns[9]
    for part in (slice(2, 7), slice(None, 3), slice(6, None), slice(1, 8, 3), slice(4, 4)):
        assert isinstance(columns[part], TokenLogprobs) and list(columns[part]) == listed[part]
    assert columns.tokens == [entry.token for entry in listed]
    assert list(columns.logprobs) == [entry.logprob for entry in listed]


def test_runs_joined_keep_each_tokens_own_alternatives() -> None:
    first, second = entries(5), entries(6, first=5)
    joined = TokenLogprobs.of(TokenLogprobs.of(first), second)
    assert list(joined) == first + second
    grown = TokenLogprobs.of(first)
    grown.extend(TokenLogprobs.of(second)[1:])
    assert list(grown) == first + second[1:]


def test_an_answers_worth_of_columns_is_a_handful_of_objects_for_the_gc() -> None:
    listed = entries(2000)
    gc.disable()
    try:
        before = len(gc.get_objects())
        columns = TokenLogprobs.of(listed)
        tracked = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert len(columns) == 2000
    # The same entries as objects are an object and a list per token (and a tuple per
    # alternative until a collection untracks it): thousands.
    assert tracked < 10
