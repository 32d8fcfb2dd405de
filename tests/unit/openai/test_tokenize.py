"""The gateway's tokenizer: exact counts, a valid byte bound, and long prompts off the event
loop."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from tokenizers import Tokenizer

from gateway.common.errors import APIError
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ChatTurn, ModelTokenizer


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(ensure_tiny_model(), thread_min_chars=1000)


def test_text_counts_equal_the_models_own_tokenizer(tokenizer: ModelTokenizer) -> None:
    reference = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    for text in ("hello", "The quick brown fox.", "ünïcödé ✓ " * 50, "x" * 5000):
        assert asyncio.run(tokenizer.encode_text(text)) == reference.encode(text).ids


@pytest.mark.parametrize(
    "text", ["a", "hello world", "ünïcödé ✓ 漢字", "x" * 3000, "🙂" * 700, "<|eos|>" * 40]
)
def test_the_byte_bound_never_exceeds_the_real_count(tokenizer: ModelTokenizer, text: str) -> None:
    real = len(asyncio.run(tokenizer.encode_text(text)))
    assert tokenizer.min_tokens_for_bytes(len(text.encode("utf-8"))) <= real


def test_chat_template_renders_roles_and_the_generation_prompt(tokenizer: ModelTokenizer) -> None:
    # The tiny model's template, written out: BOS, then "<role>: <content>" and EOS per turn,
    # each on its line, then the assistant's prompt, open for the answer.
    config = json.loads((ensure_tiny_model() / "tokenizer_config.json").read_text())
    bos, eos = config["bos_token"], config["eos_token"]
    turns = [ChatTurn("system", "be brief"), ChatTurn("user", "hi there")]
    expected = f"{bos}system: be brief{eos}\nuser: hi there{eos}\nassistant:"
    assert tokenizer.render_chat(turns) == expected
    ids = asyncio.run(tokenizer.encode_chat(turns))
    model = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    assert ids == model.encode(expected, add_special_tokens=False).ids


def test_token_ids_outside_the_vocabulary_are_refused(tokenizer: ModelTokenizer) -> None:
    assert tokenizer.check_token_ids([0, 1, tokenizer.vocab_size - 1]) == [
        0,
        1,
        tokenizer.vocab_size - 1,
    ]
    with pytest.raises(APIError) as refused:
        tokenizer.check_token_ids([1, tokenizer.vocab_size])
    assert refused.value.status == 400 and refused.value.param == "prompt"


def test_a_long_prompt_does_not_block_the_event_loop(tokenizer: ModelTokenizer) -> None:
    text = "hello world this is a long prompt " * 30000

    async def scenario() -> tuple[int, float]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        started = time.perf_counter()
        await tokenizer.encode_text(text)
        elapsed = time.perf_counter() - started
        done.set()
        await task
        return ticks, elapsed

    ticks, elapsed = asyncio.run(scenario())
    # If encoding held the loop, the ticker could not run at all while it lasted.
    assert ticks >= max(5, int(elapsed * 1000 * 0.05)), (ticks, elapsed)


# -- prompts of one loop turn are encoded together ------------------------------------------


def test_prompts_submitted_together_each_get_their_own_ids() -> None:
    tokenizer = ModelTokenizer(ensure_tiny_model())
    reference = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    texts = [f"prompt number {n}: " + "abc " * n for n in range(40)]

    async def all_at_once() -> list[list[int]]:
        return await asyncio.gather(*(tokenizer.encode_text(text) for text in texts))

    assert asyncio.run(all_at_once()) == [reference.encode(text).ids for text in texts]


def _count_turns(tokenizer: ModelTokenizer) -> list[int]:
    """Records, for each callback that encodes, how many prompts were waiting for it."""
    batch = tokenizer._turn_batch
    waiting: list[int] = []
    encode_pending = batch._encode_pending

    def counting(loop: asyncio.AbstractEventLoop) -> None:
        waiting.append(len(batch._pending))
        encode_pending(loop)

    batch._encode_pending = counting  # type: ignore[method-assign]  # a counting stand-in
    return waiting


def test_the_prompts_of_one_turn_are_encoded_in_one_callback() -> None:
    tokenizer = ModelTokenizer(ensure_tiny_model())
    waiting = _count_turns(tokenizer)

    async def eight_requests() -> None:
        await asyncio.gather(*(tokenizer.encode_text(f"request {n}") for n in range(8)))

    asyncio.run(eight_requests())
    assert waiting == [8]


def test_a_cancelled_request_is_not_encoded_and_the_others_are() -> None:
    tokenizer = ModelTokenizer(ensure_tiny_model())
    reference = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))

    async def one_gives_up() -> list[object]:
        tasks = [asyncio.ensure_future(tokenizer.encode_text(f"request {n}")) for n in range(3)]
        await asyncio.sleep(0)  # all three have submitted their prompt
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, second, third = asyncio.run(one_gives_up())
    assert first == reference.encode("request 0").ids and third == reference.encode("request 2").ids
    assert isinstance(second, asyncio.CancelledError)


def test_a_burst_of_long_prompts_lets_the_loop_run_between_turns() -> None:
    tokenizer = ModelTokenizer(ensure_tiny_model(), thread_min_chars=20_000)
    waiting = _count_turns(tokenizer)
    ticks: list[int] = []

    async def burst() -> None:
        async def ticker() -> None:
            while True:
                ticks.append(len(waiting))
                await asyncio.sleep(0)

        running = asyncio.ensure_future(ticker())
        await asyncio.gather(*(tokenizer.encode_text("ab " * 5_000) for _ in range(10)))
        running.cancel()

    asyncio.run(burst())
    # 10 prompts of 15,000 characters: five fill a turn's 65,536, the rest wait for the next.
    assert waiting == [10, 5]
    assert 1 in ticks, "the loop did not run between the two turns"
