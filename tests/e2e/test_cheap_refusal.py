"""A prompt whose byte length alone proves it over the limit is refused without tokenizing it."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from tokenizers import Tokenizer

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import StandInWorker

# The policy's context bound is the tightest (the stand-ins' pools are larger): a prompt may have
# up to MAX_CONTEXT_TOKENS - MAX_TOKENS tokens.
MAX_CONTEXT_TOKENS = 4096
MAX_TOKENS = 4
PROMPT_LIMIT = MAX_CONTEXT_TOKENS - MAX_TOKENS


def untokenized_refusals(gateway: GatewayProcess) -> float:
    text = httpx.get(
        gateway.url + "/metrics", headers={"Authorization": f"Bearer {gateway.admin_key}"}
    ).text
    return sum(
        float(v)
        for v in re.findall(
            r"^isogate_admission_refused_untokenized_total\{[^}]*\} (\S+)$", text, re.M
        )
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    work = tmp_path_factory.mktemp("cheap")
    prefill, decode = StandInWorker("prefill").start(), StandInWorker("decode").start()
    policies = write_policies(
        work / "policies",
        model_name="m",
        tokenizer_dir=ensure_tiny_model(),
        pools=[PoolSpec("shared", ((prefill.url, 1),), (decode.url,))],
        max_context_tokens=MAX_CONTEXT_TOKENS,
    )
    with GatewayProcess(
        policies, work, env={"ISOGATE_MAX_BODY_BYTES": str(64 * 1024 * 1024)}
    ) as process:
        process.stand_ins = (prefill, decode)
        yield process
    prefill.stop()
    decode.stop()


def test_a_50_mb_prompt_is_refused_on_its_byte_length_without_tokenizing(
    gateway: GatewayProcess,
) -> None:
    _, key = gateway.create_tenant()
    before = untokenized_refusals(gateway)
    prompt = "x" * (50 * 1024 * 1024)
    started = time.perf_counter()
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    elapsed = time.perf_counter() - started
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "at least" in error["message"]  # a bound from the byte length, not a token count
    assert untokenized_refusals(gateway) == before + 1
    assert not any(r for w in gateway.stand_ins for r in w.requests)  # no worker was contacted
    print(f"refused 50 MB in {elapsed * 1000:.0f} ms end to end (timing is reported by make bench)")


def prompt_of(tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens as the model's own tokenizer counts them (the
    tokenizers library on its tokenizer.json, with the special tokens a generation adds)."""
    tokenizer = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    words = ["word"] * (tokens // 2)
    for suffix in ("", ".", " a", "!"):
        while len(tokenizer.encode(" ".join(words) + suffix).ids) > tokens:
            words.pop()
        if len(tokenizer.encode(" ".join(words) + suffix).ids) == tokens:
            return " ".join(words) + suffix
    raise AssertionError(f"no prompt of exactly {tokens} tokens")


def test_a_prompt_near_the_limit_is_tokenized_and_counted_exactly(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant()
    before = untokenized_refusals(gateway)
    decode = gateway.stand_ins[1]
    # Thousands of bytes either way: the byte bound cannot prove either one too long (a token
    # may span several bytes), so both are tokenized, and one token decides.
    at_the_limit, one_over = prompt_of(PROMPT_LIMIT), prompt_of(PROMPT_LIMIT + 1)

    def complete(prompt: str) -> httpx.Response:
        return httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )

    served = complete(at_the_limit)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == PROMPT_LIMIT
    assert len(decode.requests[-1]["input_ids"]) == PROMPT_LIMIT  # what the worker was sent

    sent_before = len(decode.requests)
    refused = complete(one_over)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"is {PROMPT_LIMIT} tokens" in error["message"], error
    assert f"your prompt has {PROMPT_LIMIT + 1} tokens" in error["message"], error  # counted
    assert len(decode.requests) == sent_before  # refused before any worker
    assert untokenized_refusals(gateway) == before


def test_a_body_over_the_configured_size_is_413(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant()
    response = httpx.post(
        gateway.url + "/v1/completions",
        content=b"x" * (65 * 1024 * 1024),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
