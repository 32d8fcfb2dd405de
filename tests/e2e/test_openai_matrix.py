"""The OpenAI request surface end to end, with the official SDK, on the real CPU PD pair: each
field through the gateway and, in the same run, through sglang_router to the same workers.

Greedy requests must give the same text and the same prompt token count both ways; where the
peer cannot serve a request the difference is named here (and in docs/operations.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import openai
import pytest

from gateway.dev.cluster import RouterProcess
from gateway.dev.harness import GatewayProcess
from tests.conftest import MODEL

pytestmark = pytest.mark.engine

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about the weather."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ours(gateway: GatewayProcess, tenant: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key=tenant[1], max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def peer(pd_router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=pd_router.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    fields.setdefault("messages", MESSAGES)
    fields.setdefault("max_tokens", 8)
    fields.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, **fields)


def completion(client: openai.OpenAI, **fields: Any) -> Any:
    fields.setdefault("prompt", "The weather today is")
    fields.setdefault("max_tokens", 8)
    fields.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, **fields)


# Greedy chat requests that must give the same answer through both.
CHAT_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "explicit nulls": {"top_p": None, "seed": None, "stop": None, "logprobs": None, "n": None},
    "top_p and seed": {"top_p": 0.5, "seed": 11},
    "stop": {"stop": ["\n", "."]},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "SGLang extensions": {
        "extra_body": {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2}
    },
    "ignore_eos": {"extra_body": {"ignore_eos": True}},
    "text parts": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more."}],
            }
        ]
    },
    "documented, ignored for this model": {
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "user": "u-1",
        "parallel_tool_calls": None,
        "tools": None,
    },
}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_a_greedy_chat_request_answers_alike_through_both(
    ours: openai.OpenAI, peer: openai.OpenAI, case: str
) -> None:
    fields = CHAT_CASES[case]
    # sglang_router refuses an explicit null where it expects a value ("logprobs: invalid
    # type: null, expected a boolean"), so the peer gets the nulls left out.
    mine = chat(ours, **fields)
    theirs = chat(peer, **{key: value for key, value in fields.items() if value is not None})
    assert mine.choices[0].message.content == theirs.choices[0].message.content
    assert mine.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert mine.usage.completion_tokens == theirs.usage.completion_tokens


def test_chat_log_probabilities_match_the_peers(ours: openai.OpenAI, peer: openai.OpenAI) -> None:
    mine = chat(ours, logprobs=True, top_logprobs=3)
    theirs = chat(peer, logprobs=True, top_logprobs=3)
    entries = mine.choices[0].logprobs.content
    assert len(entries) == mine.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 for entry in entries)
    peer_entries = theirs.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in peer_entries]
    for a, b in zip(entries, peer_entries, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_streamed_log_probabilities_add_up_to_the_whole_answers(ours: openai.OpenAI) -> None:
    whole = chat(ours, logprobs=True, top_logprobs=1)
    stream = chat(ours, logprobs=True, top_logprobs=1, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]


def test_completion_log_probabilities(ours: openai.OpenAI, peer: openai.OpenAI) -> None:
    mine = completion(ours, logprobs=2)
    logprobs = mine.choices[0].logprobs
    assert len(logprobs.tokens) == mine.usage.completion_tokens == len(logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == mine.choices[0].text
    theirs = completion(peer, logprobs=2)
    assert mine.choices[0].text == theirs.choices[0].text


def test_n_choices_come_back_each_with_its_index(ours: openai.OpenAI) -> None:
    # sglang_router in PD mode does not answer n > 1 (it waits for a second transfer that never
    # comes), so this is the gateway's alone.
    reply = chat(ours, n=3, temperature=1.0, seed=None)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert 3 <= reply.usage.completion_tokens <= 3 * 8
    greedy = chat(ours, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_a_list_of_prompts_is_one_choice_each(ours: openai.OpenAI, peer: openai.OpenAI) -> None:
    prompts = ["The weather today is", "My favourite colour is"]
    mine = completion(ours, prompt=prompts)
    alone = [completion(ours, prompt=p).choices[0].text for p in prompts]
    assert [c.text for c in sorted(mine.choices, key=lambda c: c.index)] == alone


def test_bench_serving_fields_are_served(ours: openai.OpenAI) -> None:
    # What sglang.bench_serving sends: best_of on completions, ignore_eos on chat.
    reply = completion(ours, best_of=1, extra_body={"ignore_eos": True}, max_tokens=6)
    assert reply.usage.completion_tokens == 6
    reply = chat(ours, extra_body={"ignore_eos": True}, max_tokens=6)
    assert reply.usage.completion_tokens == 6


def structured(reply: Any) -> Any:
    return reply.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
                }
            },
            lambda text: jsonschema.validate(json.loads(text), SCHEMA),
        ),
        ({"response_format": {"type": "json_object"}}, lambda text: json.loads(text)),
        (
            {"extra_body": {"regex": "(yes|no)"}},
            lambda text: text in ("yes", "no") or pytest.fail(text),
        ),
    ],
)
def test_constrained_output_follows_its_grammar(
    ours: openai.OpenAI, fields: dict[str, Any], check: Callable[[str], Any]
) -> None:
    # The dev model's weights favour closing a structure (gateway/dev/model.py), so the output
    # is complete within a small max_tokens, not cut off.
    reply = chat(ours, max_tokens=64, **fields)
    assert reply.choices[0].finish_reason == "stop", structured(reply)
    check(structured(reply))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_the_engine_cannot_compile_is_refused_with_the_compilers_verdict(
    ours: openai.OpenAI, peer: openai.OpenAI, stream: bool
) -> None:
    # The gateway cannot compile grammars (gateway.workers.refusals): a worker refuses it, and
    # the client is told the compiler's verdict, as the peer passes it on, without the
    # compiler's source position. A stream is a 400, or (where the refusal came after the
    # stream's first event, as the peer's always does) an error event.
    verdict = "Regex parsing error at position 10: The parenthesis is not closed"
    errors = []
    for client in (ours, peer):
        with pytest.raises(openai.BadRequestError if not stream else openai.APIError) as refused:
            reply = chat(client, stream=stream, extra_body={"regex": "(unclosed"})
            if stream:
                list(reply)
        errors.append(refused.value)
    mine, theirs = errors
    assert verdict in theirs.message and ".cc:" in theirs.message  # SGLang's words, as they are
    assert verdict in mine.message and ".cc:" not in mine.message, mine.message
    assert mine.code == "engine_rejected"


def test_echo_answers_alike_and_the_prompt_is_scored_where_the_peer_scores_none(
    ours: openai.OpenAI, peer: openai.OpenAI
) -> None:
    # The same text through both; sglang_router in PD mode returns the completion's log
    # probabilities only (the prompt's are prefill's) and refuses max_tokens 0 with 400.
    mine = completion(ours, echo=True, logprobs=1, max_tokens=4)
    theirs = completion(peer, echo=True, logprobs=1, max_tokens=4)
    assert mine.choices[0].text == theirs.choices[0].text
    assert mine.choices[0].text.startswith("The weather today is")
    ours_lp, theirs_lp = mine.choices[0].logprobs, theirs.choices[0].logprobs
    prompt_tokens = mine.usage.prompt_tokens
    assert len(ours_lp.tokens) == prompt_tokens + len(theirs_lp.tokens)
    assert ours_lp.tokens[prompt_tokens:] == theirs_lp.tokens
    assert ours_lp.token_logprobs[prompt_tokens:] == pytest.approx(
        theirs_lp.token_logprobs, abs=1e-3
    )
    scored = completion(ours, echo=True, logprobs=1, max_tokens=0)
    assert scored.choices[0].text == "The weather today is"
    assert scored.choices[0].logprobs.tokens == ours_lp.tokens[:prompt_tokens]
    with pytest.raises(openai.BadRequestError):
        completion(peer, echo=True, logprobs=1, max_tokens=0)
