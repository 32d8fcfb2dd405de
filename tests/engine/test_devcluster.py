"""The development PD pair: real SGLang 0.5.23 prefill + decode on the CPU, and the tiny model.

The `engine` tests use the session's PD pair (`pd_cluster` in tests/conftest.py: one pair
of about 4.5 GB for the whole run). The rest are cheap checks of the model generator and the
process handling.
"""

import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from gateway.dev.cluster import (
    ClusterStartError,
    ManagedProcess,
    PDCluster,
    RouterProcess,
    default_cluster_spec,
    group_members,
)
from gateway.dev.model import CHAT_TEMPLATE, MODEL_FILES, ensure_tiny_model
from tests.e2e_engine.pd_pairs import FORKED_LOG_LINE

MAX_NEW_TOKENS = 12
PROMPT = "Hello, world! How are you today?"


@pytest.fixture(scope="module")
def prompt_ids(pd_cluster: PDCluster) -> list[int]:
    tokenizer = Tokenizer.from_file(str(pd_cluster.spec.model_dir / "tokenizer.json"))
    return tokenizer.encode(PROMPT).ids


def generate_body(input_ids: list[int]) -> dict[str, object]:
    return {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS},
    }


async def generate_through_pd_pair(pd_cluster: PDCluster, input_ids: list[int]) -> dict:
    """Send the same body to prefill and decode at once, as sglang_router does.

    Both halves carry the same `rid`: the production plugin (engine_patch) derives an
    untagged request's generation from its rid and refuses KV written for another one.
    """
    body = {
        **generate_body(input_ids),
        "rid": uuid.uuid4().hex,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pd_cluster.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    async with httpx.AsyncClient(timeout=60.0) as client:
        prefill, decode = await asyncio.gather(
            client.post(f"{pd_cluster.prefill_url}/generate", json=body),
            client.post(f"{pd_cluster.decode_url}/generate", json=body),
        )
    assert prefill.status_code == 200, prefill.text
    assert decode.status_code == 200, decode.text
    return decode.json()


@pytest.mark.engine
def test_pd_pair_generates_the_requested_greedy_tokens(
    pd_cluster: PDCluster, prompt_ids: list[int]
) -> None:
    result = asyncio.run(generate_through_pd_pair(pd_cluster, prompt_ids))

    assert len(result["output_ids"]) == MAX_NEW_TOKENS
    assert result["meta_info"]["prompt_tokens"] == len(prompt_ids)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW_TOKENS}


async def stream_through_pd_pair(pd_cluster: PDCluster, body: dict) -> list[dict]:
    """Decode's stream chunks for ``body`` sent to both workers (prefill's whole answer)."""
    body = {
        **body,
        "rid": uuid.uuid4().hex,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pd_cluster.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    chunks: list[dict] = []

    async def decode(client: httpx.AsyncClient) -> None:
        url = f"{pd_cluster.decode_url}/generate"
        async with client.stream("POST", url, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: ") :]))

    async with httpx.AsyncClient(timeout=60.0) as client:
        prefill, _ = await asyncio.gather(
            client.post(f"{pd_cluster.prefill_url}/generate", json=body), decode(client)
        )
    assert prefill.status_code == 200, prefill.text
    return chunks


@pytest.mark.engine
def test_the_dev_decode_worker_streams_what_each_chunk_adds(
    pd_cluster: PDCluster, prompt_ids: list[int]
) -> None:
    # What the gateway's IncrementalChunks reads: each chunk's text, token ids and log
    # probabilities are its own new tokens', against the running completion_tokens.
    body = {**generate_body(prompt_ids), "return_logprob": True, "top_logprobs_num": 2}
    whole = asyncio.run(generate_through_pd_pair(pd_cluster, prompt_ids))
    chunks = asyncio.run(stream_through_pd_pair(pd_cluster, body))
    info = httpx.get(f"{pd_cluster.decode_url}/server_info", timeout=10.0).json()
    assert info["incremental_streaming_output"] is True
    assert len(chunks) > 1
    before = 0
    for chunk in chunks:
        meta = chunk["meta_info"]
        new = meta["completion_tokens"] - before
        assert len(chunk["output_ids"]) == len(meta["output_token_logprobs"]) == new
        assert len(meta["output_top_logprobs"]) == new
        before = meta["completion_tokens"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


@pytest.mark.engine
def test_pd_pair_greedy_output_is_deterministic_across_rooms(
    pd_cluster: PDCluster, prompt_ids: list[int]
) -> None:
    first = asyncio.run(generate_through_pd_pair(pd_cluster, prompt_ids))
    second = asyncio.run(generate_through_pd_pair(pd_cluster, prompt_ids))
    other_prompt = asyncio.run(generate_through_pd_pair(pd_cluster, prompt_ids[::-1]))

    assert first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["id"] != second["meta_info"]["id"]
    # Random dummy weights still depend on the input: a different prompt, different output.
    assert other_prompt["output_ids"] != first["output_ids"]


@pytest.mark.engine
def test_router_output_equals_direct_pd_dispatch(
    pd_cluster: PDCluster, prompt_ids: list[int], pd_router: RouterProcess
) -> None:
    direct = asyncio.run(generate_through_pd_pair(pd_cluster, prompt_ids))

    # sglang_router (the session's, tests/conftest.py) forwards the body, rid included, to both
    # halves; without a rid each half picks its own and the production plugin refuses the pair
    # (foreign_generation).
    routed = httpx.post(
        f"{pd_router.url}/generate",
        json={**generate_body(prompt_ids), "rid": uuid.uuid4().hex},
        timeout=60.0,
    )

    assert routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == direct["output_ids"]


@pytest.mark.engine
def test_workers_report_the_configured_pool_sizes(pd_cluster: PDCluster) -> None:
    prefill = httpx.get(f"{pd_cluster.prefill_url}/server_info", timeout=10.0).json()
    decode = httpx.get(f"{pd_cluster.decode_url}/server_info", timeout=10.0).json()

    assert (prefill["disaggregation_mode"], prefill["max_total_num_tokens"]) == (
        "prefill",
        pd_cluster.spec.prefill.max_total_tokens,
    )
    assert (decode["disaggregation_mode"], decode["max_total_num_tokens"]) == (
        "decode",
        pd_cluster.spec.decode.max_total_tokens,
    )


@pytest.mark.engine
def test_the_dev_pair_forks_each_servers_scheduler_and_detokenizer(pd_cluster: PDCluster) -> None:
    # Spawned, each would import torch, transformers and SGLang again: most of a CPU start.
    if not isinstance(pd_cluster, PDCluster):
        pytest.skip("an external pair (ISOGATE_TEST_CLUSTER): its logs are not ours")
    for role, log in pd_cluster.logs.items():
        assert FORKED_LOG_LINE in log.read_text(errors="replace"), role


def test_tiny_model_is_generated_identically_every_time(tmp_path: Path) -> None:
    first = ensure_tiny_model(tmp_path / "a")
    second = ensure_tiny_model(tmp_path / "b")

    for name in MODEL_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    config = json.loads((first / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"], config["num_hidden_layers"]) == (
        ["LlamaForCausalLM"],
        512,
        2,
    )


def test_tiny_model_is_not_regenerated_when_present(tmp_path: Path) -> None:
    directory = ensure_tiny_model(tmp_path / "model")
    marker_mtime = (directory / "tokenizer.json").stat().st_mtime_ns

    ensure_tiny_model(directory)

    assert (directory / "tokenizer.json").stat().st_mtime_ns == marker_mtime


def test_tiny_tokenizer_round_trips_text_and_knows_its_specials(tmp_path: Path) -> None:
    directory = ensure_tiny_model(tmp_path / "model")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "Tenant A asks: what is 2 + 2? Ünïcode too."

    assert tokenizer.get_vocab_size() == 512
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert [tokenizer.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")] == [0, 1, 2]
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_stopping_a_managed_process_kills_its_whole_group(tmp_path: Path) -> None:
    # A parent that ignores SIGTERM, with a child: both must be gone after stop().
    script = (
        "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen(['sleep', '300']); time.sleep(300)"
    )
    process = ManagedProcess("tree", [sys.executable, "-c", script], {}, tmp_path / "tree.log")
    process.start()
    pgid = process.pid
    assert pgid is not None
    _wait_for(lambda: len(group_members(pgid)) == 2)

    process.stop(grace_s=0.5)

    assert group_members(pgid) == []


def test_cluster_start_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    not_sglang = tmp_path / "python"
    not_sglang.write_text("#!/bin/sh\necho 'engine exploded on purpose' >&2\nexit 3\n")
    not_sglang.chmod(0o755)
    spec = default_cluster_spec(
        log_dir=tmp_path, engine_python=not_sglang, model_dir=tmp_path / "model"
    )

    # Fast: on the process's exit (its code named), not once the start-up timeout has passed,
    # whose error would carry the same log tail.
    with pytest.raises(ClusterStartError) as failed:
        PDCluster(spec, startup_timeout_s=30.0).start()
    assert "exited with code 3 during start-up" in str(failed.value)
    assert "engine exploded on purpose" in str(failed.value)


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
