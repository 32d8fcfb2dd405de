"""Several choices and log probabilities, inside the checks: each choice is its own PD request
(own generation ID, bootstrap room and tags), admitted as a whole and verified one by one; log
probabilities are counted and their token ids checked. A worker that lies about any of it gets
nothing of its answer to the client: 502 ``isolation_check_failed`` (streams: an error event).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from gateway.common.ids import bootstrap_room, is_generation_id
from tests.standin_worker import Behaviour, rid_offset
from tests.verification.stack import MODEL, POOL_TOKENS, LyingStack, lying_stack, sse_events

HONEST = ("Hello", " world")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingStack]:
    with lying_stack(tmp_path_factory.mktemp("choices")) as running:
        yield running


@pytest.fixture
def tenant_key(stack: LyingStack) -> str:
    return stack.gateway.create_tenant()[1]


@pytest.fixture(autouse=True)
def honest_by_default(stack: LyingStack) -> Iterator[None]:
    stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS)
    yield
    stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS)


def behave(stack: LyingStack, behaviour: Behaviour) -> None:
    stack.decode.behaviour = replace(behaviour, pool_tokens=POOL_TOKENS, text_chunks=HONEST)


def chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 4,
        **fields,
    }


def decode_requests_since(stack: LyingStack, before: int) -> list[dict[str, Any]]:
    return stack.decode.requests[before:]


def test_n_choices_are_separate_pd_requests_with_their_own_ids_and_rooms(
    stack: LyingStack, tenant_key: str
) -> None:
    before = len(stack.decode.requests)
    with stack.client(tenant_key) as client:
        response = client.post("/v1/chat/completions", json=chat(n=3))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "".join(HONEST) for c in answer["choices"])
    sent = decode_requests_since(stack, before)
    rids = [r["rid"] for r in sent]
    assert len(set(rids)) == 3 and all(is_generation_id(rid) for rid in rids)
    assert {r["bootstrap_room"] for r in sent} == {bootstrap_room(rid) for rid in rids}
    assert all(r["_headers"]["x-isolation-generation"] == r["rid"] for r in sent)
    assert answer["id"] in rids and response.headers["x-generation-id"] == answer["id"]
    one = sent[0]["input_ids"]
    assert answer["usage"]["prompt_tokens"] == 3 * len(one)
    assert answer["usage"]["completion_tokens"] == 3 * len(HONEST)
    assert answer["system_fingerprint"].startswith("fp_")


def test_a_stream_of_n_choices_carries_each_with_its_index_and_end(
    stack: LyingStack, tenant_key: str
) -> None:
    with (
        stack.client(tenant_key) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat(n=2, stream=True, stream_options={"include_usage": True}),
        ) as response,
    ):
        response.read()
        events = sse_events(response)
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    text = {0: "", 1: ""}
    finished = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"] is not None:
                finished[choice["index"]] = choice["finish_reason"]
    assert text == {0: "".join(HONEST), 1: "".join(HONEST)}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(HONEST)


def test_completions_take_a_list_of_prompts_one_choice_each(
    stack: LyingStack, tenant_key: str
) -> None:
    before = len(stack.decode.requests)
    with stack.client(tenant_key) as client:
        texts = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ["one", "two"], "max_tokens": 4, "n": 2},
        )
        assert texts.status_code == 200, texts.text
        assert [c["index"] for c in texts.json()["choices"]] == [0, 1, 2, 3]
        assert len(decode_requests_since(stack, before)) == 4
        before = len(stack.decode.requests)
        ids = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 4},
        )
    assert ids.status_code == 200, ids.text
    assert ids.json()["usage"]["prompt_tokens"] == 6
    sent = decode_requests_since(stack, before)
    assert sorted(r["input_ids"] for r in sent) == [[5, 6, 7, 8], [9, 10]]


def test_log_probabilities_have_one_entry_per_token_with_the_alternatives_asked_for(
    stack: LyingStack, tenant_key: str
) -> None:
    with stack.client(tenant_key) as client:
        response = client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2))
        legacy = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Say", "max_tokens": 4, "logprobs": 3},
        )
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(HONEST)
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert all(entry["logprob"] <= 0 for entry in content)
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in content)
    assert legacy.status_code == 200, legacy.text
    logprobs = legacy.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(HONEST)
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"])


LIES: dict[str, Behaviour] = {
    "one log-probability entry too many": Behaviour(logprob_entries_delta=1),
    "one log-probability entry missing": Behaviour(logprob_entries_delta=-1),
    "a token id outside the vocabulary": Behaviour(logprob_token=10**6),
}


@pytest.mark.parametrize("lie", list(LIES))
@pytest.mark.parametrize("stream", [False, True])
def test_lying_log_probabilities_are_withheld(
    stack: LyingStack, tenant_key: str, lie: str, stream: bool
) -> None:
    behave(stack, LIES[lie])
    with stack.client(tenant_key) as client:
        response = client.post(
            "/v1/chat/completions", json=chat(logprobs=True, top_logprobs=1, stream=stream)
        )
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "isolation_check_failed"
    assert "Hello" not in response.text


@pytest.mark.parametrize("stream", [False, True])
def test_choices_answered_with_each_others_ids_fail_the_whole_response(
    stack: LyingStack, tenant_key: str, stream: bool
) -> None:
    behave(stack, Behaviour(swap_with_previous=True))
    with stack.client(tenant_key) as client:
        response = client.post("/v1/chat/completions", json=chat(n=2, stream=stream))
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "isolation_check_failed"
    assert "Hello" not in response.text


def test_more_choices_than_one_request_may_hold_run_in_turns_or_a_stream_is_refused(
    stack: LyingStack, tenant_key: str
) -> None:
    """Each choice alone fits the pool; the eight together are past what one request may hold
    at once (the pool's max_request_share): a whole answer runs them in turns, a stream (whose
    choices all run at once) is refused before any worker is asked."""
    before = len(stack.decode.requests)
    with stack.client(tenant_key) as client:
        streamed = client.post("/v1/chat/completions", json=chat(n=8, max_tokens=1024, stream=True))
        assert len(stack.decode.requests) == before
        whole = client.post("/v1/chat/completions", json=chat(n=8, max_tokens=1024))
    assert streamed.status_code == 400, streamed.text
    assert streamed.json()["error"]["code"] == "request_too_large"
    assert whole.status_code == 200, whole.text
    assert len(whole.json()["choices"]) == 8
    assert len(stack.decode.requests) == before + 8


def test_answers_carry_openais_rate_limit_headers(stack: LyingStack, tenant_key: str) -> None:
    with stack.client(tenant_key) as client:
        first = client.post("/v1/chat/completions", json=chat())
        second = client.post("/v1/chat/completions", json=chat(stream=True))
    for response in (first, second):
        assert response.status_code == 200, response.text
        assert re.fullmatch(r"\d+ms", response.headers["x-ratelimit-reset-requests"])
        assert re.fullmatch(r"\d+ms", response.headers["x-ratelimit-reset-tokens"])
    rpm = int(first.headers["x-ratelimit-limit-requests"])
    tpm = int(first.headers["x-ratelimit-limit-tokens"])
    # A fresh tenant's bucket, less this request (a little refill between the two at most).
    assert int(first.headers["x-ratelimit-remaining-requests"]) == rpm - 1
    assert rpm - 2 <= int(second.headers["x-ratelimit-remaining-requests"]) <= rpm - 1
    # Tokens are reserved for prompt + max_tokens at admission.
    assert int(first.headers["x-ratelimit-remaining-tokens"]) <= tpm - 4


def test_best_of_returns_the_n_most_likely_candidates_per_token(
    stack: LyingStack, tenant_key: str
) -> None:
    def best_of(**fields: Any) -> tuple[Any, list[dict[str, Any]]]:
        before = len(stack.decode.requests)
        body = {"model": MODEL, "prompt": "Say", "max_tokens": 4, "n": 2, "best_of": 4}
        with stack.client(tenant_key) as client:
            response = client.post("/v1/completions", json={**body, **fields})
        assert response.status_code == 200, response.text
        return response.json(), decode_requests_since(stack, before)

    plain, candidates = best_of()
    assert len(candidates) == 4 and all(r["return_logprob"] for r in candidates)
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in plain["choices"])  # the client did not ask
    assert plain["usage"]["completion_tokens"] == 4 * len(HONEST)  # every candidate counts

    ranked, candidates = best_of(logprobs=1)
    # The stand-in makes every token of a request less likely by that request's offset: the
    # two chosen are the two candidates with the smallest offsets.
    chosen = sorted(-0.25 - c["logprobs"]["token_logprobs"][0] for c in ranked["choices"])
    smallest = sorted(rid_offset(r["rid"]) for r in candidates)[:2]
    assert chosen == pytest.approx(smallest)

    with stack.client(tenant_key) as client:
        streamed = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Say", "best_of": 2, "stream": True},
        )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"


def echo_request(stack: LyingStack, tenant_key: str, **fields: Any) -> Any:
    body = {"model": MODEL, "prompt": "Say something", "echo": True, "logprobs": 2, **fields}
    with stack.client(tenant_key) as client:
        return client.post("/v1/completions", json=body)


def test_an_echoed_prompt_is_scored_by_prefill_token_for_token(
    stack: LyingStack, tenant_key: str
) -> None:
    """What evaluation harnesses send to score a text: echo, logprobs, max_tokens 0."""
    # A PD pair decodes at least one token; the gateway asks for one and drops it.
    stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS, text_chunks=("Hello",))
    before = len(stack.prefill.requests)
    response = echo_request(stack, tenant_key, max_tokens=0)
    assert response.status_code == 200, response.text
    prefill_body = stack.prefill.requests[before]
    decode_body = stack.decode.requests[-1]
    # Only prefill runs the prompt through the model, so only prefill is asked to score it.
    assert prefill_body["logprob_start_len"] == 0 and decode_body["logprob_start_len"] == -1
    choice = response.json()["choices"][0]
    prompt_ids = prefill_body["input_ids"]
    logprobs = choice["logprobs"]
    assert choice["text"] == "Say something"
    assert len(logprobs["tokens"]) == len(prompt_ids)  # the prompt's tokens, nothing generated
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [-0.5 * i for i in range(1, len(prompt_ids))]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"][0] == 0
    assert response.json()["usage"]["completion_tokens"] == 0
    assert decode_body["sampling_params"]["max_new_tokens"] == 1


def test_an_echoed_prompt_is_followed_by_its_completion(stack: LyingStack, tenant_key: str) -> None:
    response = echo_request(stack, tenant_key, max_tokens=4)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    prompt_ids = stack.prefill.requests[-1]["input_ids"]
    assert choice["text"] == "Say something" + "".join(HONEST)
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids) + len(HONEST)


def test_prompt_scores_of_another_sequence_are_withheld(stack: LyingStack, tenant_key: str) -> None:
    stack.prefill.behaviour = Behaviour(pool_tokens=POOL_TOKENS, prompt_scores_shift=1)
    try:
        response = echo_request(stack, tenant_key, max_tokens=0)
    finally:
        stack.prefill.behaviour = Behaviour(pool_tokens=POOL_TOKENS)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "isolation_check_failed"
    assert "Say something" not in response.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"max_tokens": 0, "echo": False}, "max_tokens"), ({"stream": True}, "echo")],
)
def test_echo_refusals_say_which_field(
    stack: LyingStack, tenant_key: str, fields: dict[str, Any], param: str
) -> None:
    response = echo_request(stack, tenant_key, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
