"""``/v1/tokenize`` and ``/v1/detokenize`` are metered and bounded like generations, and what they
are sent is parsed off the event loop.

- Each call counts against the tenant's requests and tokens per minute (429 once either is
  spent, with Retry-After; the rate-limit headers on every answer), so a tenant refused on
  generations is refused here too.
- A request is bounded by the model's context: each prompt by what could fit it, all of its
  prompts together by one context's worth of bytes (413), a detokenize by a context of ids;
  a request past a bound is refused before it is tokenized, and nothing of it is charged.
- A large body is parsed in the gateway's parsing process, not on the event loop: ``/healthz``
  is answered while one is processed, and the gateway's memory does not grow by the bodies.

One gateway process in front of stand-in workers; the tiny model's tokenizer (at most 10 bytes
a token) and the context of ``make run``'s policy (65,536 tokens), so one context's worth of
bytes is 655,360.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.reliability.stack import (
    MODEL,
    STANDIN_POOL_TOKENS,
    StandInStack,
    chat_body,
    process_status,
    range_port,
)
from tests.security.checks import assert_clean_error
from tests.standin_worker import Behaviour, StandInWorker

REQUESTS_PER_MINUTE = 3
TOKENS_PER_MINUTE = 3000
CONTEXT = 65536  # policies/models.yaml's, as ``make run`` serves the tiny model
LONGEST_TOKEN_BYTES = 10  # the tiny model's vocabulary
ONE_CONTEXT_BYTES = CONTEXT * LONGEST_TOKEN_BYTES


@pytest.fixture(scope="module")
def metered_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInStack]:
    work = tmp_path_factory.mktemp("tokenize-limits")
    pool = Behaviour(pool_tokens=STANDIN_POOL_TOKENS)
    with (
        StandInWorker("prefill", pool, port=range_port()) as prefill,
        StandInWorker("decode", pool, port=range_port()) as decode,
    ):
        policies = write_policies(
            work / "policies",
            model_name=MODEL,
            tokenizer_dir=ensure_tiny_model(DEFAULT_MODEL_DIR),
            pools=[PoolSpec("shared", ((prefill.url, range_port()),), (decode.url,))],
            max_context_tokens=CONTEXT,
            default_limits={
                "requests_per_minute": REQUESTS_PER_MINUTE,
                "tokens_per_minute": TOKENS_PER_MINUTE,
                "max_concurrent": 100,
            },
        )
        env = {"ISOGATE_MAX_BODY_BYTES": str(64 * 1024 * 1024)}
        with GatewayProcess(policies, work, env=env, port=range_port()) as gateway:
            yield StandInStack(prefill, decode, gateway)


def _tokenize(client: httpx.Client, **body: object) -> httpx.Response:
    return client.post("/v1/tokenize", json={"model": MODEL, **body})


def _remaining(answer: httpx.Response) -> tuple[int, int]:
    return (
        int(answer.headers["x-ratelimit-remaining-requests"]),
        int(answer.headers["x-ratelimit-remaining-tokens"]),
    )


def test_a_tenant_refused_on_generations_is_refused_on_tokenize_and_detokenize(
    metered_stack: StandInStack,
) -> None:
    with metered_stack.client(metered_stack.key("out-of-requests")) as client:
        for _ in range(REQUESTS_PER_MINUTE):
            assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        generation = client.post("/v1/chat/completions", json=chat_body())
        assert generation.status_code == 429
        for answer in (
            _tokenize(client, prompt="hello"),
            client.post("/v1/detokenize", json={"model": MODEL, "tokens": [1, 2]}),
        ):
            error = assert_clean_error(answer.status_code, answer.content, statuses=(429,))
            assert error["code"] == "rate_limit_exceeded"
            assert int(answer.headers["retry-after"]) >= 1


def test_tokenize_and_detokenize_count_a_request_and_their_tokens(
    metered_stack: StandInStack,
) -> None:
    with metered_stack.client(metered_stack.key("metered")) as client:
        # A fresh tenant's first call: its buckets are full, so what is left is exact.
        decoded = client.post("/v1/detokenize", json={"model": MODEL, "tokens": [42] * 100})
        assert decoded.status_code == 200, decoded.text
        assert decoded.headers["x-ratelimit-limit-requests"] == str(REQUESTS_PER_MINUTE)
        assert decoded.headers["x-ratelimit-limit-tokens"] == str(TOKENS_PER_MINUTE)
        assert _remaining(decoded) == (REQUESTS_PER_MINUTE - 1, TOKENS_PER_MINUTE - 100)
        started = time.monotonic()
        counted = _tokenize(client, prompt="word " * 1000)
        refill = (time.monotonic() - started) * TOKENS_PER_MINUTE / 60
        assert counted.status_code == 200, counted.text
        count = counted.json()["count"]
        requests_left, tokens_left = _remaining(counted)
        assert requests_left == REQUESTS_PER_MINUTE - 2
        # Charged its count, not the fewest tokens it could have been before tokenizing.
        expected = TOKENS_PER_MINUTE - 100 - count
        assert expected <= tokens_left <= expected + refill + 1
        # The next call's text is more bytes than the longest tokens of what is left could
        # hold: refused for tokens, before tokenizing, not for requests (it is the third of
        # three). "word " is 5 bytes.
        at_least = tokens_left + 100
        refused = _tokenize(client, prompt="word " * (at_least * LONGEST_TOKEN_BYTES // 5))
        error = assert_clean_error(refused.status_code, refused.content, statuses=(429,))
        assert error["message"] == f"Rate limit reached: {TOKENS_PER_MINUTE} tokens per minute."
        assert int(refused.headers["retry-after"]) >= 1


def test_prompts_past_one_context_together_are_refused_before_being_tokenized(
    metered_stack: StandInStack,
) -> None:
    # Each prompt fits the context on its own; together they hold more than a context could.
    prompt = "word " * 10_000
    prompts = [prompt] * (ONE_CONTEXT_BYTES // len(prompt) + 1)
    with metered_stack.client(metered_stack.key("over-the-bound")) as client:
        over = _tokenize(client, prompt=prompts)
        error = assert_clean_error(over.status_code, over.content, statuses=(413,))
        assert error["code"] == "request_too_large" and error["param"] == "prompt"
        assert str(ONE_CONTEXT_BYTES) in error["message"]
        # Nothing of it was charged but the request: the next call finds every token there.
        served = _tokenize(client, prompt=["hello", "world"])
        assert served.status_code == 200, served.text
        assert _remaining(served) == (
            REQUESTS_PER_MINUTE - 2,
            TOKENS_PER_MINUTE - sum(served.json()["count"]),
        )


def test_ids_past_the_context_in_a_large_body_are_refused(metered_stack: StandInStack) -> None:
    with metered_stack.client(metered_stack.key("many-ids")) as client:
        # Over the size that is parsed off the event loop (256 KiB by default).
        answer = client.post("/v1/detokenize", json={"model": MODEL, "tokens": [1] * 150_000})
    error = assert_clean_error(answer.status_code, answer.content, statuses=(400,))
    assert error["param"] == "tokens" and str(CONTEXT) in error["message"]
    assert int(answer.request.headers["content-length"]) > 256 * 1024  # parsed off the loop


def _while_processed(
    stack: StandInStack, tenant: str, path: str, body: bytes
) -> tuple[httpx.Response, int]:
    """The answer to ``body``, and how many ``/healthz`` calls were asked after the body was
    all sent and answered before that answer came back."""
    uploaded = threading.Event()
    answered = threading.Event()
    answers_meanwhile = 0

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]
        uploaded.set()  # asked for more after the last chunk: all of it was written

    def probe_health() -> None:
        nonlocal answers_meanwhile
        with httpx.Client(base_url=stack.gateway.url, timeout=60) as client:
            while not answered.is_set():
                was_uploaded = uploaded.is_set()
                assert client.get("/healthz").status_code == 200
                if was_uploaded and not answered.is_set():
                    answers_meanwhile += 1

    prober = threading.Thread(target=probe_health)
    prober.start()
    try:
        with stack.client(stack.key(tenant), timeout_s=120) as client:
            answer = client.post(
                path, content=chunks(), headers={"Content-Type": "application/json"}
            )
    finally:
        answered.set()
        prober.join()
    return answer, answers_meanwhile


def test_the_loop_answers_healthz_while_2_million_messages_are_looked_at(
    metered_stack: StandInStack,
) -> None:
    message = orjson.dumps({"role": "user", "content": "x"})
    body = b'{"model": "%s", "messages": [%s]}' % (
        MODEL.encode(),
        b",".join([message] * 2_000_000),
    )
    answer, meanwhile = _while_processed(metered_stack, "many-messages", "/v1/tokenize", body)
    error = assert_clean_error(answer.status_code, answer.content, statuses=(400,))
    assert error["param"] == "messages"
    assert meanwhile >= 2, "the event loop did not answer while the body was processed"


def test_the_loop_answers_healthz_while_20_million_ids_are_looked_at(
    metered_stack: StandInStack,
) -> None:
    body = b'{"model": "%s", "tokens": [%s]}' % (MODEL.encode(), b",".join([b"1"] * 20_000_000))
    answer, meanwhile = _while_processed(metered_stack, "many-ids-2", "/v1/detokenize", body)
    error = assert_clean_error(answer.status_code, answer.content, statuses=(400,))
    assert error["param"] == "tokens"
    assert meanwhile >= 2, "the event loop did not answer while the body was processed"


def test_three_12_mb_tokenize_calls_leave_the_gateways_memory_where_it_was(
    metered_stack: StandInStack,
) -> None:
    """The issue's figure: three concurrent 12 MB calls took the gateway from 95 MB to 3 GB,
    for good. Now each is refused where it is parsed, and the gateway never holds a body: its
    memory afterwards is within one body's size of where it was."""
    prompts = ["word " * 38_000] * 64  # each fits a context; 12 MB together
    body = orjson.dumps({"model": MODEL, "prompt": prompts})
    gateway = metered_stack.gateway.process
    assert gateway is not None
    before = process_status(gateway.pid)["VmRSS"] * 1024

    def call(tenant: str) -> Callable[[], httpx.Response]:
        def send() -> httpx.Response:
            with metered_stack.client(metered_stack.key(tenant), timeout_s=120) as client:
                return client.post(
                    "/v1/tokenize", content=body, headers={"Content-Type": "application/json"}
                )

        return send

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda send: send(), [call(f"twelve-mb-{n}") for n in range(3)]))
    after = process_status(gateway.pid)["VmRSS"] * 1024
    assert after - before < len(body), f"grew {after - before} bytes, a body is {len(body)}"
    for answer in answers:
        assert_clean_error(answer.status_code, answer.content, statuses=(413,))
