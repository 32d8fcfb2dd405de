"""``GET /v1/models/{id}``, ``/health``, ``POST /v1/tokenize`` and ``/v1/detokenize``, end to end.

A real gateway process (``isogate serve``) in front of stand-in workers: the stand-in decode
echoes ``prompt_tokens`` as the length of the ``input_ids`` it was sent, and the gateway checks
that echo against its own count, so a chat completion's ``usage.prompt_tokens`` and the ids the
stand-in recorded are what the gateway counted for a generation. The model's name has a "/" in
it, as Hugging Face ids do.

The policy's ``max_context_tokens`` (4096) is the tightest bound here, so a pair's prompt limit
for ``max_tokens`` m is exactly ``4096 - m``, well inside the stand-ins' 8192-token pools: a
request at the limit fits the pools now too, and gate 1's decision is the only one in play.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from gateway.api.tokenize_routes import DetokenizeResponse, TokenizeResponse
from gateway.dev.harness import GatewayProcess
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from gateway.openai.protocol import ErrorResponse, ModelCard
from tests.harness import PoolSpec, write_policies
from tests.reliability.stack import range_port
from tests.schemas import assert_conforms
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "isogate-test/tiny-llama"
MAX_CONTEXT = 4096
MAX_OUTPUT = 1024
BODY_CAP = 1024 * 1024
CLE = "context_length_exceeded"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Say hello "},
            {"type": "text", "text": "to the world."},
        ],
    },
]


def _policies(work: Path, prefill: str, decode: str) -> Path:
    return write_policies(
        work / "policies",
        model_name=MODEL,
        tokenizer_dir=ensure_tiny_model(DEFAULT_MODEL_DIR),
        pools=[PoolSpec("shared", ((prefill, range_port()),), (decode,))],
        max_context_tokens=MAX_CONTEXT,
        max_output_tokens=MAX_OUTPUT,
    )


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[StandInWorker, StandInWorker]]:
    with (
        StandInWorker("prefill", port=range_port()) as prefill,
        # One token per answer: honest for any max_tokens >= 1.
        StandInWorker("decode", Behaviour(text_chunks=("Hi",)), port=range_port()) as decode,
    ):
        yield prefill, decode


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, workers: tuple[StandInWorker, StandInWorker]
) -> Iterator[GatewayProcess]:
    work = tmp_path_factory.mktemp("tokenize")
    prefill, decode = workers
    env = {"ISOGATE_MAX_BODY_BYTES": str(BODY_CAP)}
    with GatewayProcess(
        _policies(work, prefill.url, decode.url), work, env=env, port=range_port()
    ) as process:
        yield process


@pytest.fixture(scope="module")
def key(gateway: GatewayProcess) -> str:
    return gateway.create_tenant()[1]


@pytest.fixture(scope="module")
def api(gateway: GatewayProcess, key: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def reference() -> Tokenizer:
    return Tokenizer.from_file(str(ensure_tiny_model(DEFAULT_MODEL_DIR) / "tokenizer.json"))


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert_conforms(ErrorResponse, response.json())
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    return error


def _long_messages(words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "word " * words}]


# ---- GET /v1/models/{id} -------------------------------------------------------------------


def test_a_model_is_retrieved_with_the_card_the_list_gives(
    gateway: GatewayProcess, key: str
) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)
    listed = next(m for m in client.models.list().data if m.id == MODEL)
    retrieved = client.models.retrieve(MODEL)  # the SDK's own path: /v1/models/{id}
    assert retrieved.model_dump() == listed.model_dump()
    assert_conforms(
        ModelCard,
        httpx.get(
            f"{gateway.url}/v1/models/{MODEL}", headers={"Authorization": f"Bearer {key}"}
        ).json(),
    )
    assert (retrieved.model_extra or {})["max_context_tokens"] == MAX_CONTEXT
    assert (retrieved.model_extra or {})["max_context_bound"] == "policy max_context_tokens"


def test_an_unknown_model_is_a_404_model_not_found(
    gateway: GatewayProcess, key: str, api: httpx.Client
) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    error = _error(raised.value.response, 404, "model_not_found")
    assert error["type"] == "invalid_request_error" and error["param"] == "model"
    # Neither a prefix of a real name nor a name under it is that model.
    for name in ("isogate-test", MODEL + "/x", ""):
        _error(api.get(f"/v1/models/{name}"), 404, "model_not_found")


def test_retrieving_a_model_needs_a_key(gateway: GatewayProcess) -> None:
    response = httpx.get(f"{gateway.url}/v1/models/{MODEL}", timeout=10)
    assert _error(response, 401, "invalid_api_key")["type"] == "authentication_error"


# ---- /health --------------------------------------------------------------------------------


def test_health_is_200_while_the_gateway_can_serve(gateway: GatewayProcess) -> None:
    response = httpx.get(gateway.url + "/health", timeout=10)  # no key: a probe's call
    assert response.status_code == 200, response.text
    assert response.json() == httpx.get(gateway.url + "/readyz", timeout=10).json()


def test_health_is_503_once_no_worker_is_fresh_and_tokenize_then_has_no_limit(
    tmp_path: Path, reference: Tokenizer
) -> None:
    prefill = StandInWorker("prefill", port=range_port()).start()
    decode = StandInWorker("decode", port=range_port()).start()
    try:
        env = {"ISOGATE_CAPACITY_STALE_AFTER_S": "1.5"}
        with GatewayProcess(
            _policies(tmp_path, prefill.url, decode.url), tmp_path, env=env, port=range_port()
        ) as gateway:
            assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
            decode.stop()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                response = httpx.get(gateway.url + "/health", timeout=10)
                if response.status_code == 503:
                    break
                time.sleep(0.2)
            assert response.status_code == 503, response.text
            assert response.json() == {
                "status": "unready",
                "problems": {MODEL: ["no decode worker answering"]},
            }
            # Tokenizing needs no worker; the limit as of now is unknown, and says so.
            _, key = gateway.create_tenant()
            answer = httpx.post(
                gateway.url + "/v1/tokenize",
                json={"model": MODEL, "prompt": "Hello world"},
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            assert_conforms(TokenizeResponse, answer.json())
            assert answer.json()["tokens"] == reference.encode("Hello world").ids
            assert answer.json()["max_prompt_tokens"] is None
            assert answer.json()["max_prompt_bound"] is None
            assert answer.json()["fits"] is None
    finally:
        prefill.stop()
        decode.stop()


# ---- POST /v1/tokenize -----------------------------------------------------------------------


def test_chat_tokens_are_the_ids_a_chat_completion_sends_and_counts(
    api: httpx.Client, workers: tuple[StandInWorker, StandInWorker]
) -> None:
    tokenized = api.post("/v1/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert tokenized.status_code == 200, tokenized.text
    answer = tokenized.json()
    assert_conforms(TokenizeResponse, answer)
    completion = api.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    )
    assert completion.status_code == 200, completion.text
    assert answer["count"] == completion.json()["usage"]["prompt_tokens"] == len(answer["tokens"])
    # The very ids decode was sent for that completion (the stand-in records every request).
    sent = next(r for r in reversed(workers[1].requests) if r["rid"] == completion.json()["id"])
    assert answer["tokens"] == sent["input_ids"]
    assert answer["max_model_len"] == MAX_CONTEXT


def test_text_tokens_are_the_models_own_and_a_completion_counts_them_alike(
    api: httpx.Client, reference: Tokenizer
) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    answer = api.post("/v1/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert answer["tokens"] == reference.encode(text).ids
    completion = api.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert completion.status_code == 200, completion.text
    assert answer["count"] == completion.json()["usage"]["prompt_tokens"]
    plain = api.post(
        "/v1/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}
    ).json()
    assert plain["tokens"] == reference.encode(text, add_special_tokens=False).ids


def test_a_list_of_prompts_is_counted_prompt_by_prompt(
    api: httpx.Client, reference: Tokenizer
) -> None:
    texts = ["Hello", "word " * 2500, "Once upon a time"]
    answer = api.post("/v1/tokenize", json={"model": MODEL, "prompt": texts}).json()
    assert_conforms(TokenizeResponse, answer)
    assert answer["tokens"] == [reference.encode(t).ids for t in texts]
    assert answer["count"] == [len(reference.encode(t).ids) for t in texts]
    assert answer["fits"] == [True, False, True]  # "word " * 2500 is ~5000 tokens, over 4095


def test_the_limit_is_the_one_models_reports_and_moves_with_max_tokens(
    api: httpx.Client,
) -> None:
    card = api.get(f"/v1/models/{MODEL}").json()
    default = api.post("/v1/tokenize", json={"model": MODEL, "prompt": "hi"}).json()
    # /v1/models counts the same limit (max_tokens=1) plus that one completion token.
    assert default["max_tokens"] == 1
    assert default["max_prompt_tokens"] == card["max_context_tokens"] - 1 == MAX_CONTEXT - 1
    assert default["max_prompt_bound"] == card["max_context_bound"]
    assert default["fits"] is True
    wide = api.post("/v1/tokenize", json={"model": MODEL, "prompt": "hi", "max_tokens": 1000})
    assert wide.json()["max_prompt_tokens"] == MAX_CONTEXT - 1000
    assert wide.json()["max_tokens"] == 1000


def test_fits_is_what_gate_1_decides_at_the_boundary(api: httpx.Client) -> None:
    messages = _long_messages(1700)
    count = api.post("/v1/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
    at_limit = MAX_CONTEXT - count  # the max_tokens that leaves room for exactly this prompt
    assert 1 <= at_limit < MAX_OUTPUT, count
    for max_tokens, fits in ((at_limit, True), (at_limit + 1, False)):
        answer = api.post(
            "/v1/tokenize", json={"model": MODEL, "messages": messages, "max_tokens": max_tokens}
        ).json()
        assert answer["count"] == count
        assert answer["max_prompt_tokens"] == MAX_CONTEXT - max_tokens
        assert answer["fits"] is fits, answer
        assert answer["max_prompt_bound"] == "policy max_context_tokens"
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
        completion = api.post("/v1/chat/completions", json=body)
        if fits:
            assert completion.status_code == 200, completion.text
            assert completion.json()["usage"]["prompt_tokens"] == count
        else:
            _error(completion, 400, "context_length_exceeded")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "prompt": "x"}, 404, "model_not_found"),
        ({"model": MODEL}, 400, "missing_required_parameter"),
        ({"model": MODEL, "prompt": "x", "messages": MESSAGES}, 400, "invalid_value"),
        ({"model": MODEL, "prompt": "x", "max_tokens": MAX_OUTPUT + 1}, 400, "invalid_value"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
        ({"model": MODEL, "prompt": []}, 400, "invalid_value"),
        ({"model": MODEL, "prompt": [1, 2, 3]}, 400, "invalid_value"),
        ({"model": MODEL, "prompt": "x", "temperature": 0}, 400, "unknown_parameter"),
        ({"model": MODEL, "prompt": "x", "rid": "mine"}, 400, "reserved_parameter"),
        ({"prompt": "x"}, 400, "missing_required_parameter"),
    ],
)
def test_bad_tokenize_requests_get_openai_errors(
    api: httpx.Client, body: dict[str, Any], status: int, code: str
) -> None:
    _error(api.post("/v1/tokenize", json=body), status, code)


def test_tokenize_refuses_what_is_not_a_json_object_and_bodies_over_the_cap(
    api: httpx.Client,
) -> None:
    _error(api.post("/v1/tokenize", content=b"{not json"), 400, "invalid_json")
    _error(api.post("/v1/tokenize", content=b"[1]"), 400, "invalid_json")
    huge = {"model": MODEL, "prompt": "x" * (BODY_CAP + 1)}
    _error(api.post("/v1/tokenize", json=huge), 413, "request_too_large")


def test_a_prompt_its_length_proves_over_the_models_context_is_refused_untokenized(
    api: httpx.Client,
) -> None:
    # 10 bytes at most per token of this vocabulary: 100,000 bytes are over 4096 tokens whatever
    # they are. A tokenized prompt would have been answered 200 with "fits": false.
    text = "x" * 100_000
    error = _error(api.post("/v1/tokenize", json={"model": MODEL, "prompt": text}), 400, CLE)
    assert error["param"] == "prompt"
    listed = api.post("/v1/tokenize", json={"model": MODEL, "prompt": ["hi", text]})
    assert _error(listed, 400, CLE)["param"] == "prompt"
    chat = api.post(
        "/v1/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": text}]}
    )
    assert _error(chat, 400, CLE)["param"] == "messages"


def test_tokenize_and_detokenize_need_a_tenant_key(gateway: GatewayProcess) -> None:
    for path, payload in (
        ("/v1/tokenize", {"model": MODEL, "prompt": "x"}),
        ("/v1/detokenize", {"model": MODEL, "tokens": [1]}),
    ):
        anonymous = httpx.post(gateway.url + path, json=payload, timeout=10)
        _error(anonymous, 401, "invalid_api_key")
        admin = httpx.post(
            gateway.url + path,
            json=payload,
            headers={"Authorization": f"Bearer {gateway.admin_key}"},
            timeout=10,
        )
        _error(admin, 403, "admin_key_not_allowed")


# ---- POST /v1/detokenize ---------------------------------------------------------------------


def test_detokenize_gives_back_the_tokenized_text(api: httpx.Client, reference: Tokenizer) -> None:
    text = "Hello world, how are you?"
    tokens = api.post("/v1/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    answer = api.post("/v1/detokenize", json={"model": MODEL, "tokens": tokens})
    assert answer.status_code == 200, answer.text
    assert_conforms(DetokenizeResponse, answer.json())
    assert answer.json() == {"text": text}
    texts = ["Once upon a time", "the end"]
    batch = api.post("/v1/tokenize", json={"model": MODEL, "prompt": texts}).json()["tokens"]
    batched = api.post("/v1/detokenize", json={"model": MODEL, "tokens": batch}).json()
    assert_conforms(DetokenizeResponse, batched)
    assert batched == {"text": texts}
    assert api.post("/v1/detokenize", json={"model": MODEL, "tokens": []}).json() == {"text": ""}
    # Special tokens are left out unless asked for, as SGLang does.
    bos = reference.token_to_id("<|bos|>")
    assert bos is not None
    skipped = api.post("/v1/detokenize", json={"model": MODEL, "tokens": [bos, *tokens]})
    assert skipped.json() == {"text": text}
    kept = api.post(
        "/v1/detokenize",
        json={"model": MODEL, "tokens": [bos, *tokens], "skip_special_tokens": False},
    )
    assert kept.json() == {"text": "<|bos|>" + text}


@pytest.mark.parametrize(
    ("tokens", "code"),
    [
        ([1, 2, 512], "invalid_value"),  # the tiny model's vocabulary is 0..511
        ([-1], "invalid_value"),
        ([[1], [2, 100000]], "invalid_value"),
        (["a"], "invalid_value"),
        ("abc", "invalid_value"),
    ],
)
def test_detokenize_refuses_ids_outside_the_vocabulary(
    api: httpx.Client, tokens: object, code: str
) -> None:
    error = _error(api.post("/v1/detokenize", json={"model": MODEL, "tokens": tokens}), 400, code)
    assert error["param"] is not None and error["param"].startswith("tokens")


def test_detokenize_takes_at_most_a_context_of_ids(api: httpx.Client) -> None:
    whole = api.post("/v1/detokenize", json={"model": MODEL, "tokens": [42] * MAX_CONTEXT})
    assert whole.status_code == 200, whole.text
    over = api.post("/v1/detokenize", json={"model": MODEL, "tokens": [[42] * MAX_CONTEXT, [42]]})
    assert _error(over, 400, "invalid_value")["param"] == "tokens"


def test_detokenize_of_an_unknown_model_is_404(api: httpx.Client) -> None:
    response = api.post("/v1/detokenize", json={"model": "no-such-model", "tokens": [1]})
    _error(response, 404, "model_not_found")
