"""Decode's stream read a chunk's new part at a time, however the engine sends it.

SGLang started with ``--incremental-streaming-output`` sends what each chunk adds; without it,
every chunk repeats the whole output so far. ``CheckedStream`` reads both as what each chunk
adds (``IncrementalChunks``), so the checks of one step cost what it adds: checking every
chunk whole made a long stream with ``top_logprobs`` cost the loop tens of milliseconds per
token near its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from gateway.common.errors import APIError
from gateway.core.generation import CheckedStream, Choice, StreamEnd
from gateway.dev.model import ensure_tiny_model
from gateway.openai.tokenize import ModelTokenizer
from gateway.verification import verify
from gateway.verification.verify import Expectation, IsolationFailure, NoScanner, StreamGuard
from gateway.workers.capacity import parse_worker_state
from gateway.workers.dispatch import EngineRequest

GID = "gen_01JTESTTESTTESTTESTTESTTES"
TOP = 3
VOCAB = 1000
EXPECTED = Expectation(GID, "acme", 3, 64, require_tags=False, top_logprobs=TOP, vocab_size=VOCAB)
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(ensure_tiny_model())


def entry(token: int) -> list[Any]:
    return [-0.5, token, None]


def chunks(*, repeated: bool, per_chunk: int = 1) -> list[dict[str, Any]]:
    """The stream of ``TOKENS`` (text: one letter per token), ``per_chunk`` tokens a chunk,
    each chunk whole so far (``repeated``) or only what it adds."""
    out = []
    for end in range(per_chunk, len(TOKENS) + 1, per_chunk):
        start = 0 if repeated else end - per_chunk
        tokens = TOKENS[start:end]
        meta = {
            "id": GID,
            "prompt_tokens": 3,
            "completion_tokens": end,
            "finish_reason": {"type": "length"} if end == len(TOKENS) else None,
            "output_token_logprobs": [entry(t) for t in tokens],
            "output_top_logprobs": [[entry(t + k) for k in range(TOP)] for t in tokens],
        }
        out.append({"text": "abcdefgh"[start:end], "meta_info": meta})
    return out


async def batches_of(batches: list[list[dict[str, Any]]]) -> AsyncGenerator[list[dict[str, Any]]]:
    for batch in batches:
        yield batch


def read(
    stream_chunks: list[dict[str, Any]],
    tokenizer: ModelTokenizer,
    *,
    repeated: bool,
    together: int = 1,
) -> tuple[str, list[str], StreamEnd]:
    """The text and log-probability tokens a client gets, and the stream's end; chunks
    ``together`` to a batch."""
    request = EngineRequest(
        generation_id=GID, tenant_id="acme", input_ids=[1, 2, 3], sampling_params={}, cache_salt="s"
    )
    batches = [stream_chunks[i : i + together] for i in range(0, len(stream_chunks), together)]

    async def collect() -> tuple[str, list[str], StreamEnd]:
        stream = CheckedStream(
            Choice(0, 0, request, EXPECTED),
            batches_of(batches[1:]),
            StreamGuard(NoScanner(), "acme"),
            tokenizer,
            engine_repeats_output=repeated,
        )
        stream.take_first(batches[0])
        text, tokens = "", []
        async for step in stream.steps():
            text += step.delta
            tokens += [t.token for t in step.logprobs or []]
        end = stream.finish()
        tokens += [t.token for t in end.logprobs or []]
        return text + end.tail, tokens, end

    return asyncio.run(collect())


@pytest.mark.parametrize("together", [1, 3])
@pytest.mark.parametrize("per_chunk", [1, 2])
def test_an_incremental_engine_and_a_repeating_one_stream_the_same_answer(
    tokenizer: ModelTokenizer, per_chunk: int, together: int
) -> None:
    repeated = read(chunks(repeated=True, per_chunk=per_chunk), tokenizer, repeated=True)
    added = read(
        chunks(repeated=False, per_chunk=per_chunk), tokenizer, repeated=False, together=together
    )
    assert added[0] == repeated[0] == "abcdefgh"
    assert added[1] == repeated[1] == [tokenizer.token_text(t) for t in TOKENS]
    assert added[2].completion_tokens == repeated[2].completion_tokens == len(TOKENS)
    assert added[2].finish_reason == repeated[2].finish_reason == "length"


def test_each_log_probability_entry_is_checked_once_wherever_the_stream_is(
    tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[Any] = []
    real = verify._check_logprob_entry
    monkeypatch.setattr(
        verify, "_check_logprob_entry", lambda e, v: (checked.append(e), real(e, v))[1]
    )
    for repeated in (True, False):
        checked.clear()
        read(chunks(repeated=repeated), tokenizer, repeated=repeated)
        # One entry and TOP alternatives per token: not the whole stream again for every chunk.
        assert len(checked) == len(TOKENS) * (1 + TOP)


def test_a_chunk_whose_log_probabilities_are_not_its_new_tokens_fails_closed(
    tokenizer: ModelTokenizer,
) -> None:
    stream = chunks(repeated=False)
    # The third chunk carries the whole output so far, as if the engine repeated it after all.
    stream[2]["meta_info"]["output_token_logprobs"] = [entry(t) for t in TOKENS[:3]]
    with pytest.raises(IsolationFailure, match="3 log-probability entries for 1 new tokens"):
        read(stream, tokenizer, repeated=False)


def test_a_repeating_engine_that_drops_an_entry_fails_closed(tokenizer: ModelTokenizer) -> None:
    stream = chunks(repeated=True)
    del stream[4]["meta_info"]["output_token_logprobs"][2]
    with pytest.raises(IsolationFailure, match="log-probability entries"):
        read(stream, tokenizer, repeated=True)


def test_a_worker_says_whether_its_streams_carry_only_what_each_chunk_adds() -> None:
    loads = {"loads": [{"max_total_num_tokens": 4096, "num_used_tokens": 0}]}
    for flag, expected in ((True, True), (False, False), (None, False)):
        info = {} if flag is None else {"incremental_streaming_output": flag}
        state = parse_worker_state("http://w", "decode", info, loads, 0.0)
        assert state.incremental_streams is expected


def abort_chunk(text: str, prompt_tokens: int = 3, verified: bool = False) -> dict[str, Any]:
    """Decode's last chunk when it refused the request (its grammar did not compile), before
    the KV transfer it would have verified: tags echoed, coverage not verified."""
    meta = {
        "id": GID,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 0,
        "isolation_generation": GID,
        "isolation_tenant": "acme",
        "isolation_verified": verified,
        "finish_reason": {"type": "abort", "status_code": 400, "message": "grammar error"},
    }
    return {"text": text, "meta_info": meta}


def first_and_end(chunk: dict[str, Any]) -> None:
    """Open a stream on ``chunk`` (tags required) and end it."""
    request = EngineRequest(
        generation_id=GID, tenant_id="acme", input_ids=[1, 2, 3], sampling_params={}, cache_salt="s"
    )
    expected = Expectation(GID, "acme", 3, 64, require_tags=True)
    stream = CheckedStream(
        Choice(0, 0, request, expected),
        batches_of([]),
        StreamGuard(NoScanner(), "acme"),
        None,
        engine_repeats_output=False,
    )
    stream.take_first([chunk])
    stream.finish()


# Found by the real-engine fuzzing: a streamed chat whose grammar SGLang could not compile got
# 502 isolation_check_failed. Its abort said "not verified" (seed 2179449493), and in another
# run counted 1 prompt token of 14 (seed 4035335039): where in the engine the request was
# refused decides both.
@pytest.mark.parametrize("prompt_tokens", [3, 1])
def test_an_abort_before_any_output_is_the_engines_refusal_not_an_isolation_alarm(
    prompt_tokens: int,
) -> None:
    with pytest.raises(APIError) as refused:
        first_and_end(abort_chunk("", prompt_tokens))
    assert (refused.value.status, refused.value.code) == (400, "engine_rejected")


def test_output_counted_against_another_prompt_still_fails_closed_even_with_an_abort() -> None:
    with pytest.raises(IsolationFailure, match="prompt tokens"):
        first_and_end(abort_chunk("text of another prompt", prompt_tokens=1, verified=True))


def test_unverified_output_still_fails_closed_even_with_an_abort() -> None:
    with pytest.raises(IsolationFailure, match="did not verify"):
        first_and_end(abort_chunk("text from pages nobody verified"))
