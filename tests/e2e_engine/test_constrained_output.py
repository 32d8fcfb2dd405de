"""Constrained output finishes on the dev model (marker `engine`), on the session's PD pair.

With SGLang's dummy weights (every logit about 0) a grammar's pick among the tokens it allows
is arbitrary: a small JSON schema at temperature 0 and max_tokens 64 gave 64 tokens of
whitespace and no JSON. gateway/dev/model.py now writes weights that favour closing a string,
a number and a bracket, and the dev cluster passes `--constrained-json-disable-any-whitespace`.
Each request goes to prefill and decode as the gateway sends it
(gateway/workers/dispatch.py): the same
/generate body to both, with the bootstrap triple and the isolation headers.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from tokenizers import Tokenizer

from gateway.dev.cluster import PDCluster
from tests.conftest import ExternalCluster

pytestmark = pytest.mark.engine

MAX_NEW_TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = "[a-z]{3,8}"
EBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'
EBNF_MATCH = r"\[[0-9]+(,[0-9]+)*\]"
PROMPT = "user: Give me a JSON object with a name and an age.\nassistant:"
# (temperature, sampling_seed): greedy, then sampled at temperature 1 under a few seeds.
SAMPLING = [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3), (1.0, 4)]
SAMPLING_IDS = ["greedy", "t1-seed1", "t1-seed2", "t1-seed3", "t1-seed4"]

_rooms = itertools.count(7_000_001)


@pytest.fixture(scope="module")
def prompt_ids(pd_cluster: PDCluster | ExternalCluster) -> list[int]:
    tokenizer = Tokenizer.from_file(str(pd_cluster.spec.model_dir / "tokenizer.json"))
    return list(tokenizer.encode(PROMPT).ids)


def generate(
    cluster: PDCluster | ExternalCluster, input_ids: list[int], sampling_params: dict[str, Any]
) -> dict[str, Any]:
    """One PD generation: the same body to prefill and decode at once; decode's answer."""
    generation = f"gen_constrained_{uuid.uuid4().hex}"
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, **sampling_params},
        "rid": generation,
        "extra_key": "salt-constrained",
        "stream": False,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.bootstrap_port,
        "bootstrap_room": next(_rooms),
    }
    headers = {"X-Isolation-Tenant": "tenant-constrained", "X-Isolation-Generation": generation}
    with httpx.Client(timeout=120.0) as client, ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(
            client.post, f"{cluster.prefill_url}/generate", json=body, headers=headers
        )
        decode = pool.submit(
            client.post, f"{cluster.decode_url}/generate", json=body, headers=headers
        )
        prefill_reply, decode_reply = prefill.result(), decode.result()
    assert prefill_reply.status_code == 200, prefill_reply.text
    assert decode_reply.status_code == 200, decode_reply.text
    result: dict[str, Any] = decode_reply.json()
    meta = result["meta_info"]
    print(
        f"{sampling_params}: {meta['completion_tokens']} tokens, "
        f"finish {meta['finish_reason']}: {result['text']!r}"
    )
    return result


def sampling(temperature: float, seed: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": temperature}
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def assert_finished(result: dict[str, Any]) -> None:
    """Ended by the grammar (EOS once it was complete), not by max_new_tokens."""
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "stop", (meta["finish_reason"], result["text"])
    assert meta["completion_tokens"] < MAX_NEW_TOKENS


@pytest.mark.parametrize(("temperature", "seed"), SAMPLING, ids=SAMPLING_IDS)
def test_json_schema_output_is_complete_and_valid(
    pd_cluster: PDCluster | ExternalCluster,
    prompt_ids: list[int],
    temperature: float,
    seed: int | None,
) -> None:
    params = {**sampling(temperature, seed), "json_schema": json.dumps(SCHEMA)}
    result = generate(pd_cluster, prompt_ids, params)

    assert_finished(result)
    value = json.loads(result["text"])
    jsonschema.validate(value, SCHEMA)


@pytest.mark.parametrize(("temperature", "seed"), SAMPLING, ids=SAMPLING_IDS)
def test_regex_output_is_complete(
    pd_cluster: PDCluster | ExternalCluster,
    prompt_ids: list[int],
    temperature: float,
    seed: int | None,
) -> None:
    result = generate(pd_cluster, prompt_ids, {**sampling(temperature, seed), "regex": REGEX})

    assert_finished(result)
    assert re.fullmatch(REGEX, result["text"]), result["text"]


@pytest.mark.parametrize(("temperature", "seed"), SAMPLING, ids=SAMPLING_IDS)
def test_ebnf_output_is_complete(
    pd_cluster: PDCluster | ExternalCluster,
    prompt_ids: list[int],
    temperature: float,
    seed: int | None,
) -> None:
    # Unbounded (any number of items, of any number of digits): it ends only if the model
    # closes the list.
    result = generate(pd_cluster, prompt_ids, {**sampling(temperature, seed), "ebnf": EBNF})

    assert_finished(result)
    assert re.fullmatch(EBNF_MATCH, result["text"]), result["text"]
    # The grammar's items are digit strings, leading zeros allowed (so not always JSON).
    assert all(item.isdigit() for item in result["text"][1:-1].split(","))


@pytest.mark.parametrize(("temperature", "seed"), SAMPLING[:2], ids=SAMPLING_IDS[:2])
def test_free_text_still_runs_to_max_tokens_and_varies(
    pd_cluster: PDCluster | ExternalCluster,
    prompt_ids: list[int],
    temperature: float,
    seed: int | None,
) -> None:
    # The bias that closes grammars must not end free text early (other tests expect
    # max_tokens) nor make it one repeated token.
    result = generate(pd_cluster, prompt_ids, sampling(temperature, seed))

    assert result["meta_info"]["finish_reason"]["type"] == "length"
    assert len(result["output_ids"]) == MAX_NEW_TOKENS
    assert len(set(result["output_ids"])) >= 8, result["output_ids"]
