"""Every field at the gateway's bound, on the real CPU PD pair: the largest (and smallest) value the
gateway accepts is served, and both workers still answer ``/health`` afterwards; one past it is a
400 that never reaches them.

``top_k: 10**18`` passed the gateway once and overflowed SGLang's int32 top_k tensor: the prefill
scheduler died and every tenant got 503 until someone restarted it. The bounds come from
``engine_bounds.FIELD_BOUNDS`` (held against SGLang's code by tests/engine_bounds), narrowed by
the session model's policy (``max_output_tokens``) and its vocabulary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokenizers import Tokenizer

from gateway.dev.cluster import PDCluster
from gateway.dev.harness import GatewayProcess
from gateway.openai.engine_bounds import FIELD_BOUNDS
from tests.conftest import MODEL

pytestmark = pytest.mark.engine

Case = tuple[str, dict[str, Any]]  # route, fields


@pytest.fixture(scope="module")
def http(gateway: GatewayProcess, tenant: tuple[str, str]) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.url, headers={"Authorization": f"Bearer {tenant[1]}"}, timeout=300
    )


@pytest.fixture(scope="module")
def model(gateway: GatewayProcess) -> dict[str, Any]:
    models = yaml.safe_load((Path(gateway.policies_dir) / "models.yaml").read_text())["models"]
    policy: dict[str, Any] = next(m for m in models if m["name"] == MODEL)
    return policy


@pytest.fixture(scope="module")
def vocab_size(model: dict[str, Any]) -> int:
    return Tokenizer.from_file(str(Path(model["tokenizer"]) / "tokenizer.json")).get_vocab_size()


def send(http: httpx.Client, route: str, fields: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, **fields}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Say something."}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "Say something."
        path = "/v1/completions"
    # json, not orjson: a value one past int64 must reach the gateway as written.
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def assert_workers_alive(cluster: PDCluster) -> None:
    for url in (cluster.prefill_url, cluster.decode_url):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200, f"{url} is down"


def at_bounds(vocab_size: int, max_output_tokens: int) -> dict[str, list[Case]]:
    """Per field, the requests with the field at each end of what the gateway accepts here."""
    b = FIELD_BOUNDS
    last_id = vocab_size - 1
    return {
        "top_k": [("chat", {"top_k": b["top_k"].largest()}), ("chat", {"top_k": -1})],
        # min_tokens at its bound: max_tokens, itself at the model's bound.
        "min_tokens": [
            ("chat", {"max_tokens": max_output_tokens, "min_tokens": max_output_tokens})
        ],
        "max_tokens": [
            ("chat", {"max_tokens": b["max_tokens"].smallest()}),
            ("text", {"max_tokens": 0, "echo": True, "logprobs": 0}),  # a completion's 0
        ],
        "max_completion_tokens": [("chat", {"max_completion_tokens": 1})],
        "seed": [("chat", {"seed": b["seed"].largest()}), ("text", {"seed": b["seed"].smallest()})],
        "n": [("chat", {"n": b["n"].largest()})],
        "best_of": [("text", {"best_of": b["best_of"].largest()})],
        "top_logprobs": [("chat", {"logprobs": True, "top_logprobs": b["top_logprobs"].largest()})],
        "logprobs": [("text", {"logprobs": b["logprobs"].largest()})],
        "stop_token_ids": [("chat", {"stop_token_ids": [0, last_id]})],
        "logit_bias": [
            ("chat", {"logit_bias": {"0": b["logit_bias (bias)"].smallest(), str(last_id): 100}})
        ],
        # Floats at their ends, the open ones at the smallest double above them.
        "floats": [
            (
                "chat",
                {
                    "temperature": b["temperature"].largest(),
                    "top_p": b["top_p"].smallest(),
                    "min_p": b["min_p"].largest(),
                    "presence_penalty": b["presence_penalty"].largest(),
                    "frequency_penalty": b["frequency_penalty"].smallest(),
                    "repetition_penalty": b["repetition_penalty"].smallest(),
                },
            ),
            (
                "chat",
                {
                    "temperature": b["temperature"].smallest(),
                    "top_p": b["top_p"].largest(),
                    "min_p": b["min_p"].smallest(),
                    "presence_penalty": b["presence_penalty"].smallest(),
                    "frequency_penalty": b["frequency_penalty"].largest(),
                    "repetition_penalty": b["repetition_penalty"].largest(),
                },
            ),
        ],
    }


def past_bounds(vocab_size: int, max_output_tokens: int) -> dict[str, list[Case]]:
    b = FIELD_BOUNDS
    return {
        "top_k": [
            ("chat", {"top_k": b["top_k"].largest() + 1}),
            ("chat", {"top_k": 1_000_000_000_000_000_000}),
            ("chat", {"top_k": 0}),
            ("chat", {"top_k": -2}),
        ],
        "min_tokens": [
            ("chat", {"max_tokens": 4, "min_tokens": 5}),
            ("chat", {"min_tokens": b["min_tokens"].largest() + 1}),
        ],
        "max_tokens": [
            ("chat", {"max_tokens": max_output_tokens + 1}),
            ("text", {"max_tokens": b["max_tokens"].largest() + 1}),
        ],
        "max_completion_tokens": [
            ("chat", {"max_completion_tokens": b["max_completion_tokens"].largest() + 1})
        ],
        "seed": [("chat", {"seed": b["seed"].largest() + 1}), ("text", {"seed": -(2**63) - 1})],
        "n": [("chat", {"n": b["n"].largest() + 1})],
        "best_of": [("text", {"best_of": b["best_of"].largest() + 1})],
        "top_logprobs": [
            ("chat", {"logprobs": True, "top_logprobs": b["top_logprobs"].largest() + 1})
        ],
        "logprobs": [("text", {"logprobs": b["logprobs"].largest() + 1})],
        "stop_token_ids": [
            ("chat", {"stop_token_ids": [vocab_size]}),
            ("chat", {"stop_token_ids": [b["stop_token_ids"].largest() + 1]}),
        ],
        "logit_bias": [
            ("chat", {"logit_bias": {str(vocab_size): 1}}),
            ("chat", {"logit_bias": {"²": 1}}),
            ("chat", {"logit_bias": {"5": math.nextafter(100.0, math.inf)}}),
        ],
        "floats": [
            ("chat", {"top_p": 0.0}),
            ("chat", {"repetition_penalty": 0.0}),
            ("chat", {"temperature": math.nextafter(2.0, math.inf)}),
        ],
    }


FIELDS = sorted(set(at_bounds(2, 2)) | set(past_bounds(2, 2)))


@pytest.mark.parametrize("field", FIELDS)
def test_a_field_at_its_bound_is_served_and_the_workers_live_on(
    http: httpx.Client,
    pd_cluster: PDCluster,
    model: dict[str, Any],
    vocab_size: int,
    field: str,
) -> None:
    for route, fields in at_bounds(vocab_size, model["max_output_tokens"]).get(field, []):
        response = send(http, route, fields)
        assert response.status_code == 200, (fields, response.text)
        assert_workers_alive(pd_cluster)


@pytest.mark.parametrize("field", FIELDS)
def test_a_field_past_its_bound_is_a_400_and_never_reaches_the_workers(
    http: httpx.Client,
    pd_cluster: PDCluster,
    model: dict[str, Any],
    vocab_size: int,
    field: str,
) -> None:
    for route, fields in past_bounds(vocab_size, model["max_output_tokens"]).get(field, []):
        response = send(http, route, fields)
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert_workers_alive(pd_cluster)


def test_top_k_of_a_quintillion_no_longer_kills_the_prefill_worker(
    http: httpx.Client, pd_cluster: PDCluster
) -> None:
    response = send(http, "chat", {"top_k": 1_000_000_000_000_000_000})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_k"
    assert_workers_alive(pd_cluster)
    assert send(http, "chat", {}).status_code == 200  # and everyone is still served
