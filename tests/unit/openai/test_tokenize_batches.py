"""``ModelTokenizer.encode_texts`` and ``decode_lists``: a request's many prompts (or id lists)
get exactly what one call per prompt gives, and when they are long together they are encoded
(checked and decoded) in one call on another thread, never on the event loop's."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from gateway.common.errors import APIError
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ControlText, ModelTokenizer

THREAD_MIN_CHARS = 64
TEXTS = ["hello", "plain words <|eos|> with a control text", "ünïcödé ✓ " * 20, "x"]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(ensure_tiny_model(), thread_min_chars=THREAD_MIN_CHARS)


class Recorded:
    """The tokenizer library's object, with the threads its batch calls ran on."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.threads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name.endswith("_batch") or name.endswith("_batch_fast"):

            def recorded(*args: Any, **kwargs: Any) -> Any:
                self.threads.append(threading.get_ident())
                return attribute(*args, **kwargs)

            return recorded
        return attribute


async def _each(
    tokenizer: ModelTokenizer, texts: list[str], add: bool, control: ControlText
) -> list[list[int]]:
    return [
        await tokenizer.encode_text(text, add_special_tokens=add, control_text=control)
        for text in texts
    ]


@pytest.mark.parametrize("control", ["recognise", "plain"])
@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("texts", [TEXTS[:2], TEXTS], ids=["short", "long"])
def test_a_batch_is_what_one_call_per_text_gives(
    tokenizer: ModelTokenizer, texts: list[str], add: bool, control: ControlText
) -> None:
    async def both() -> tuple[list[list[int]], list[list[int]]]:
        batch = await tokenizer.encode_texts(texts, add_special_tokens=add, control_text=control)
        return batch, await _each(tokenizer, texts, add, control)

    batch, each = asyncio.run(both())
    assert batch == each


@pytest.mark.parametrize("texts", [TEXTS[:2], TEXTS], ids=["short", "long"])
def test_control_text_refused_in_any_text_of_a_batch(
    tokenizer: ModelTokenizer, texts: list[str]
) -> None:
    with pytest.raises(APIError) as refused:
        asyncio.run(tokenizer.encode_texts(texts, control_text="refuse"))
    assert (refused.value.code, refused.value.param) == ("control_token_in_text", "prompt")


def test_a_long_batch_is_encoded_in_one_call_off_the_loop(
    tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = Recorded(tokenizer._tokenizer)
    monkeypatch.setattr(tokenizer, "_tokenizer", recorded)
    texts = ["word " * 10] * 8  # 400 characters together: past the threshold

    async def encode() -> int:
        await tokenizer.encode_texts(texts)
        return threading.get_ident()

    loop_thread = asyncio.run(encode())
    assert len(recorded.threads) == 1 and recorded.threads[0] != loop_thread


def test_lists_decode_to_what_one_call_each_gives(tokenizer: ModelTokenizer) -> None:
    lists = [asyncio.run(tokenizer.encode_text(text)) for text in TEXTS]

    async def both() -> tuple[list[str], list[str]]:
        batch = await tokenizer.decode_lists(lists, skip_special_tokens=False)
        return batch, [await tokenizer.decode(ids, skip_special_tokens=False) for ids in lists]

    batch, each = asyncio.run(both())
    assert batch == each
    assert sum(map(len, lists)) >= THREAD_MIN_CHARS  # the long path was taken


@pytest.mark.parametrize("length", [1, THREAD_MIN_CHARS], ids=["short", "long"])
def test_an_id_outside_the_vocabulary_is_refused_in_any_list(
    tokenizer: ModelTokenizer, length: int
) -> None:
    lists = [[1] * length, [2, tokenizer.vocab_size]]
    with pytest.raises(APIError) as refused:
        asyncio.run(tokenizer.decode_lists(lists))
    assert (refused.value.status, refused.value.param) == (400, "tokens")


def test_long_lists_are_checked_and_decoded_off_the_loop(
    tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = Recorded(tokenizer._tokenizer)
    monkeypatch.setattr(tokenizer, "_tokenizer", recorded)

    async def decode() -> int:
        await tokenizer.decode_lists([[42] * THREAD_MIN_CHARS, [42]])
        return threading.get_ident()

    loop_thread = asyncio.run(decode())
    assert len(recorded.threads) == 1 and recorded.threads[0] != loop_thread
