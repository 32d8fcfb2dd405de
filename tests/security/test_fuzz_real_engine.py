"""Schema-driven fuzzing of the tenant routes against real SGLang (the session's CPU PD pair), with
three invariants checked after every case, beyond the answer's own checks
(``tests.security.fuzzing``):

- no worker died: prefill and decode both still answer ``/health``;
- the gateway's event loop was never held for ``LAG_BOUND_S`` or more by the gateway's own
  work (its probe, ``isogate_event_loop_held_max_seconds``: the largest lag since the last
  read less its threads' waits for a CPU, which other processes on a busy host cause alone);
- the gateway's memory stayed bounded: its RSS (and its parse pool's) within
  ``RSS_MARGIN_KB`` of what it was after one honest request per route.

A stand-in worker cannot crash the way SGLang does (a field it cannot build a tensor of), and
one tenant that crashes a worker or stalls the loop takes the service from every tenant. The
gateway here has its own process (so that its memory and loop are this test's alone) in front
of the session pair, and a small ``max_output_tokens``: the gateway's own bounds, not the
fuzzer's restraint, keep every case cheap. ``/admin`` routes are not sent: the admin is not the
attacker, and they are fuzzed against stand-ins (``test_schema_fuzzing``).

In ``make test`` the cases are derandomized (the same every run) and few. ``scripts/soak fuzz``
runs many with a fresh seed (``ISOGATE_FUZZ_SEED``, ``ISOGATE_FUZZ_EXAMPLES``), printed when it
fails. Every input a random run finds becomes a ``FOUND_CASES`` entry, replayed first here with
the same checks, so that what was found once is tried on every run.
``ISOGATE_FUZZ_GATEWAY_ROOT`` runs the gateway of another checkout (an older commit's, to see
what the fuzzing finds there).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode

from gateway.api.openapi import openapi_document
from gateway.common.errors import APIError
from gateway.dev.cluster import PDCluster
from gateway.dev.harness import REPO_ROOT, GatewayProcess
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from gateway.openai.responses import ResponsesRequest
from tests.conftest import MODEL, SESSION_POOL_TOKENS, ExternalCluster
from tests.harness import PoolSpec, write_policies
from tests.security.checks import assert_no_server_error
from tests.security.conftest import FUZZ_CASES
from tests.security.fuzzing import (
    GENERATION_ROUTES,
    OPERATIONS,
    fuzz_operation,
    name_the_model,
    served_schema,
)

pytestmark = pytest.mark.engine

# The tenant's routes that do work: what one tenant's key can make the gateway do (the
# endpoints it does not serve answer 404 and nothing else).
TENANT_OPERATIONS = [
    (method, path)
    for method, path in OPERATIONS
    if path.startswith("/v1/")
    and "200" in openapi_document()["paths"][path][method.lower()]["responses"]
]
# Valid cases of a generation route are the ones that reach SGLang; each costs the pair a
# prefill and up to MAX_OUTPUT_TOKENS decode steps, and the workers' /health after it a second
# (SGLang's answers after a one-token generation and a 1 s sleep). Invalid ones are refused by
# the gateway (the stand-in run sends many more); the other routes never reach a worker.
GENERATION_POSITIVE = int(os.environ.get("ISOGATE_FUZZ_EXAMPLES", "16"))
GENERATION_NEGATIVE = max(GENERATION_POSITIVE // 4, 5)
OTHER_EXAMPLES = max(GENERATION_POSITIVE // 2, 10)
# Unset in `make test`: derandomized.
FUZZ_SEED = int(os.environ["ISOGATE_FUZZ_SEED"]) if os.environ.get("ISOGATE_FUZZ_SEED") else None
# The gateway refuses a longer output with a 400; valid cases are held to it (below).
MAX_OUTPUT_TOKENS = 8
# Every other request on the loop waits as long as a case holds it: a hold this long is a find.
LAG_BOUND_S = 0.05
# The code of the gateway's 400 when a worker refused a request the gateway had accepted.
ENGINE_REFUSED = "engine_rejected"
LAG_SERIES = ("isogate_event_loop_lag_max_seconds", "isogate_event_loop_held_max_seconds")
RSS_MARGIN_KB = 500 * 1024
# Where the gateway writes its threads' stacks when its loop goes this long without waking
# its lag probe (its wake-ups are 20 ms apart), and how much of them a failure message shows.
STALL_REPORTS = "loop-stalls"
STALL_REPORT_AFTER_S = LAG_BOUND_S
STALL_TEXT_CHARS = 6000
OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SIMPLE_MESSAGES = [{"role": "user", "content": "Say hi."}]
# What replaces a conversation or prompt the gateway's parser refuses, by field.
SIMPLE_INPUTS: dict[str, Any] = {
    "messages": SIMPLE_MESSAGES,
    "prompt": "Say hi.",
    "input": "Say hi.",
}
RequestModel = type[ChatCompletionRequest] | type[CompletionRequest] | type[ResponsesRequest]
REQUEST_MODELS: dict[str, RequestModel] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}
HONEST = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}]},
    "/v1/completions": {"prompt": "Say hi."},
    "/v1/tokenize": {"prompt": "Say hi."},
}


@dataclass(frozen=True)
class FoundCase:
    """An input that broke an invariant once, sent again as it was on every run."""

    name: str
    path: str
    # The body: JSON, or bytes sent as they are (built when the case runs, not when the suite
    # is collected: some are tens of megabytes).
    body: Callable[[], Any]
    # What it broke, and where it was found (a seed, or by hand).
    why: str
    # True where the gateway must refuse it (4xx, by itself: not a worker's refusal passed on)
    # rather than serve it.
    refused: bool = False
    # Sent this many times at once.
    at_once: int = 1
    marks: tuple[pytest.MarkDecorator, ...] = field(default=())


def _chat(**fields: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"model": MODEL, "messages": SIMPLE_MESSAGES, "max_tokens": 2, **fields}


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "found", "schema": schema}}


def _nested_schema_chat(depth: int) -> Callable[[], bytes]:
    """A chat whose schema nests ``depth`` arrays, as bytes (Python's JSON encoder would
    recurse once per level)."""
    schema = '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth
    head = json.dumps({"model": MODEL, "messages": SIMPLE_MESSAGES, "max_tokens": 2})[:-1]
    return lambda: (
        head + ',"response_format":{"type":"json_schema","json_schema":'
        '{"name":"found","schema":' + schema + "}}}"
    ).encode()


def _wide(properties: int) -> dict[str, Any]:
    field_schema = {"type": "string", "maxLength": 10, "description": "dd"}
    return {"type": "object", "properties": {f"p{i}": field_schema for i in range(properties)}}


def _many_messages(count: int) -> Callable[[], bytes]:
    message = b'{"role":"user","content":"a"}'
    head = b'{"model":"' + MODEL.encode() + b'","messages":['
    return lambda: head + b",".join([message] * count) + b"]}"


def _many_ids(count: int) -> Callable[[], bytes]:
    head = b'{"model":"' + MODEL.encode() + b'","tokens":['
    return lambda: head + b",".join([b"1"] * count) + b"]}"


# Each entry: what it broke and where it was found. Issue 40's were found by hand before this
# test existed; each fails against the gateway before its fix (ISOGATE_FUZZ_GATEWAY_ROOT at
# 1ee1d87: a 500, the loop held 0.7-2 s, a read timeout, the prefill worker gone). An entry
# marked xfail is open: strict, so that its fix makes it fail until the mark is taken off.
FOUND_CASES: list[FoundCase] = [
    FoundCase(
        "logit-bias-superscript-key",
        "/v1/chat/completions",
        _chat(logit_bias={"\u00b2": 1.0}),
        "issue 40, by hand: '²' passed str.isdigit and int() raised: a 500",
        refused=True,
    ),
    FoundCase(
        "schema-3500-properties",
        "/v1/chat/completions",
        _chat(response_format=_json_schema(_wide(3500))),
        "issue 40, by hand: a 228 KB schema (under the off-loop size) held the loop 1.1 s",
        refused=True,
    ),
    FoundCase(
        "schema-900-deep",
        "/v1/chat/completions",
        _nested_schema_chat(900),
        "issue 40, by hand: the metaschema check recursed past Python's limit: a 500",
        refused=True,
    ),
    FoundCase(
        "tokenize-2m-messages",
        "/v1/tokenize",
        _many_messages(2_000_000),
        "issue 40, by hand: parsed on the loop, /healthz waited 723 ms",
        refused=True,
    ),
    FoundCase(
        "detokenize-25m-ids",
        "/v1/detokenize",
        _many_ids(25_000_000),
        "issue 40, by hand: parsed on the loop, 946 ms",
        refused=True,
    ),
    FoundCase(
        "tokenize-12mb-prompt",
        "/v1/tokenize",
        lambda: {"model": MODEL, "prompt": "word " * (12 * 1024 * 1024 // 5)},
        "issue 40, by hand: three at once tokenized whole, the gateway's RSS grew from 95 MB "
        "to 3.0 GB and stayed",
        refused=True,
        at_once=3,
    ),
    FoundCase(
        "completion-empty-prompt",
        "/v1/completions",
        lambda: {"model": MODEL, "prompt": ["Say hi.", ""], "max_tokens": 2},
        "this test, derandomized and seed 777 (a valid case of the document): an empty prompt "
        "is zero tokens, which the gateway sends to both workers; SGLang refuses it (input_ids "
        "cannot be empty, and its abort path then logs an AttributeError) and the client gets "
        "400 engine_rejected, not the gateway's own 400",
        refused=True,
    ),
    FoundCase(
        "completion-regex-the-engine-cannot-compile",
        "/v1/completions",
        lambda: {"model": MODEL, "prompt": "Say hi.", "max_tokens": 2, "regex": "+d "},
        "this test, seed 777: a regex (and ebnf) the gateway takes and SGLang's grammar "
        "compiler refuses (EBNF parser error): both workers asked, 400 engine_rejected",
        refused=True,
        marks=(
            pytest.mark.xfail(
                strict=True,
                reason="open: the gateway does not compile regex and ebnf grammars itself",
            ),
        ),
    ),
    FoundCase(
        "chat-stream-grammar-the-engine-cannot-compile",
        "/v1/chat/completions",
        _chat(stream=True, guided_grammar="0"),
        "scripts/soak fuzz, seed 2179449493 (flaky there): decode refused the grammar before "
        "the KV transfer it would have verified and said 'not verified' on its abort chunk; "
        "the gateway answered 502 isolation_check_failed for the engine's refusal. Seed "
        "4035335039: the same refusal counted 1 prompt token of 14, the same 502",
    ),
    FoundCase(
        "chat-min-tokens-beside-a-one-token-choice",
        "/v1/chat/completions",
        _chat(min_tokens=2, guided_choice=["0"]),
        "scripts/soak fuzz, seed 2933923247: the choice ends the output at prefill's token, "
        "SGLang's PD decode steps once more with the end barred by min_tokens, and the token "
        "it takes is outside the choice: it fails the request (502 upstream_error from the "
        "gateway) or, at max_tokens 2, returns it (200, finish_reason length)",
        refused=True,
    ),
    # Last: before its fix it kills the prefill worker, and every case after it fails too.
    FoundCase(
        "top-k-past-int32",
        "/v1/chat/completions",
        _chat(top_k=10**18),
        "issue 40, by hand: SGLang overflowed its int32 top_k tensor and the prefill worker exited",
        refused=True,
    ),
]


@dataclass
class StallReports:
    """What the gateway's stall report (``gateway.observability.loop_lag.StallReport``) wrote
    since the last read: where its threads were each time its loop went ``STALL_REPORT_AFTER_S``
    without waking its lag probe (a hold, or on a busy host a wait for a CPU). Attached to a
    failed loop check, so that a hold found once says what it was."""

    directory: Path
    read: dict[Path, int] = field(default_factory=dict)

    def since_last_read(self) -> str:
        texts = []
        for path in sorted(self.directory.glob("loop-stalls-*.txt")):
            written = path.read_bytes()
            texts.append(written[self.read.get(path, 0) :].decode(errors="replace"))
            self.read[path] = len(written)
        return "".join(texts)


@dataclass
class Invariants:
    """The three things no tenant's case may break."""

    gateway: GatewayProcess
    workers: dict[str, str]  # role -> URL
    stalls: StallReports
    rss_bound_kb: int = 0
    # The worst seen since ``figures`` was last read.
    peak_rss_kb: int = 0
    peak_lag_s: float = 0.0
    peak_held_s: float = 0.0

    def check(self, case: str, *, workers: bool = True) -> None:
        """All three after ``case``; without ``workers``, the loop and memory only (for a route
        that never calls a worker, when the workers' second-long check would buy nothing)."""
        if workers:
            self.check_workers(f"after {case}")
        lag, held = loop_lag_max_s(self.gateway)
        self.peak_lag_s = max(self.peak_lag_s, lag)
        self.peak_held_s = max(self.peak_held_s, held)
        stalls = self.stalls.since_last_read()
        assert held < LAG_BOUND_S, (
            f"the gateway's event loop was held {held * 1000:.0f} ms "
            f"(late {lag * 1000:.0f} ms): {case}"
            + (
                f"\nwhere its threads were meanwhile:\n{stalls[-STALL_TEXT_CHARS:]}"
                if stalls
                else ""
            )
        )
        rss = gateway_rss_kb(self.gateway)
        self.peak_rss_kb = max(self.peak_rss_kb, rss)
        assert rss <= self.rss_bound_kb, (
            f"the gateway's RSS is {rss // 1024} MB, over its bound of "
            f"{self.rss_bound_kb // 1024} MB, after {case}"
        )

    def check_workers(self, when: str) -> None:
        """Both workers answer ``/health`` (asked together: each answer takes a second)."""
        with ThreadPoolExecutor(len(self.workers)) as pool:
            answers = dict(zip(self.workers, pool.map(_health, self.workers.values()), strict=True))
        dead = {role: answer for role, answer in answers.items() if answer}
        assert not dead, f"a worker died {when}: {dead}"

    def figures(self) -> str:
        """The worst lag and RSS seen since the last call, and the bounds they were held to."""
        line = (
            f"loop held peak {self.peak_held_s * 1000:.0f} ms (bound {LAG_BOUND_S * 1000:.0f}), "
            f"late peak {self.peak_lag_s * 1000:.0f} ms; "
            f"RSS peak {self.peak_rss_kb // 1024} MB (bound {self.rss_bound_kb // 1024})"
        )
        self.peak_rss_kb, self.peak_lag_s, self.peak_held_s = 0, 0.0, 0.0
        return line


def _health(url: str) -> str:
    """Empty when the worker answers ``/health`` with 200, else what it said."""
    try:
        response = httpx.get(url + "/health", timeout=30)
    except httpx.HTTPError as exc:
        return repr(exc)
    return "" if response.status_code == 200 else f"{response.status_code} {response.text[:200]}"


def loop_lag_max_s(gateway: GatewayProcess) -> tuple[float, float]:
    """The largest event loop lag since the last read, and the largest time the gateway's own
    work held the loop (the lag less its waits for a CPU); the read resets both."""
    with gateway.admin() as admin:
        text = admin.get("/metrics").raise_for_status().text
    values = {
        family.name: float(family.samples[0].value)
        for family in text_string_to_metric_families(text)
        if family.name in LAG_SERIES
    }
    assert set(values) == set(LAG_SERIES), f"the gateway exposes {sorted(values)} of {LAG_SERIES}"
    return values[LAG_SERIES[0]], values[LAG_SERIES[1]]


def gateway_rss_kb(gateway: GatewayProcess) -> int:
    """VmRSS of the gateway's process and its children (the parse pool), in kB."""
    assert gateway.process is not None
    total, pending = 0, [gateway.process.pid]
    while pending:
        pid = pending.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            continue  # exited meanwhile
        total += next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
        )
        pending.extend(map(int, children))
    return total


def make_valid(body: dict[str, Any], model: RequestModel) -> None:
    """Makes a valid case of the document one the gateway takes, as its own parser objects.

    The document types the fields the gateway refuses whatever their value
    (``unsupported_parameter``) as the engines do, and its messages more loosely than the
    gateway checks them (roles, tool calls, content parts): a case with either never reaches a
    worker. Such fields are taken out one by one, and a conversation or prompt the parser
    refuses is replaced by a short one, so that the sampling fields of the case, which are what
    reaches the engine, are still sent. A case refused for anything else is sent as it is.
    """
    for _ in range(len(body) + 16):
        try:
            parse_request(json.dumps(body).encode(), model)
            return
        except APIError as refusal:
            param = refusal.param or ""
            if refusal.code == "unsupported_parameter" and _drop(body, param):
                continue
            conversation = param.split(".")[0]
            if (
                conversation in SIMPLE_INPUTS
                and body.get(conversation) != SIMPLE_INPUTS[conversation]
            ):
                body[conversation] = SIMPLE_INPUTS[conversation]
                continue
            return


def _drop(body: dict[str, Any], param: str) -> bool:
    """Removes the field at a dotted path (``messages.0.audio``); False if there is none."""
    *parents, name = param.split(".")
    node: Any = body
    for part in parents:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    if isinstance(node, dict) and name in node and name not in ("role", "type"):
        del node[name]
        return True
    return False


def gateway_for_cases(
    pd_cluster: PDCluster | ExternalCluster,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    max_output_tokens: int,
) -> Iterator[GatewayProcess]:
    """A module's gateway (``yield from`` in a fixture): its own process (its memory and loop
    the module's alone) in front of the session pair, whose policy allows at most
    ``max_output_tokens``."""
    work = tmp_path_factory.mktemp(name)
    policies = write_policies(
        work / "policies",
        model_name=MODEL,
        tokenizer_dir=pd_cluster.spec.model_dir,
        pools=[
            PoolSpec(
                "shared",
                ((pd_cluster.prefill_url, pd_cluster.bootstrap_port),),
                (pd_cluster.decode_url,),
            )
        ],
        max_context_tokens=SESSION_POOL_TOKENS,
        max_output_tokens=max_output_tokens,
        # As the session gateway: tool calls in the Qwen 2.5 format, so tools reach the engine.
        tool_call_parser="qwen25",
        require_engine_tags=os.environ.get("ISOGATE_TEST_REQUIRE_ENGINE_TAGS", "1") == "1",
    )
    root = os.environ.get("ISOGATE_FUZZ_GATEWAY_ROOT")
    checkout = {"root": Path(root)} if root else {}
    stall_report = {
        "ISOGATE_LOOP_STALL_REPORT_DIR": str(work / STALL_REPORTS),
        "ISOGATE_LOOP_STALL_REPORT_AFTER_S": str(STALL_REPORT_AFTER_S),
    }
    with GatewayProcess(
        policies_dir=policies, work_dir=work, env=stall_report, **checkout
    ) as process:
        yield process


def invariants_of(
    gateway: GatewayProcess, key: str, pd_cluster: PDCluster | ExternalCluster
) -> Invariants:
    """The invariants, with the RSS bound set from the gateway after one honest request per
    route that does work (tokenizer, templates and clients loaded)."""
    headers = {"Authorization": f"Bearer {key}"}
    for path, body in HONEST.items():
        response = httpx.post(
            gateway.url + path, json={"model": MODEL, **body}, headers=headers, timeout=60
        )
        assert response.status_code == 200, response.text
    watch = Invariants(
        gateway,
        {"prefill": pd_cluster.prefill_url, "decode": pd_cluster.decode_url},
        StallReports(gateway.work_dir / STALL_REPORTS),
    )
    loop_lag_max_s(gateway)  # start and warm-up are not the cases' lag
    watch.stalls.since_last_read()
    watch.rss_bound_kb = gateway_rss_kb(gateway) + RSS_MARGIN_KB
    return watch


@pytest.fixture(scope="module")
def fuzz_gateway(
    pd_cluster: PDCluster | ExternalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    yield from gateway_for_cases(pd_cluster, tmp_path_factory, "fuzz-gateway", MAX_OUTPUT_TOKENS)


@pytest.fixture(scope="module")
def key(fuzz_gateway: GatewayProcess) -> str:
    return fuzz_gateway.create_tenant()[1]


@pytest.fixture(scope="module")
def api_schema(fuzz_gateway: GatewayProcess) -> schemathesis.BaseSchema:
    return served_schema(fuzz_gateway.url, ours=fuzz_gateway.root == REPO_ROOT)


@pytest.fixture(scope="module")
def invariants(
    fuzz_gateway: GatewayProcess, key: str, pd_cluster: PDCluster | ExternalCluster
) -> Invariants:
    return invariants_of(fuzz_gateway, key, pd_cluster)


@pytest.mark.parametrize(
    "found", [pytest.param(case, id=case.name, marks=case.marks) for case in FOUND_CASES]
)
def test_every_input_found_by_fuzzing_keeps_the_invariants(
    fuzz_gateway: GatewayProcess,
    key: str,
    invariants: Invariants,
    request: pytest.FixtureRequest,
    found: FoundCase,
) -> None:
    body = found.body()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def send(_: int) -> httpx.Response:
        return httpx.post(
            fuzz_gateway.url + found.path, content=content, headers=headers, timeout=60
        )

    with ThreadPoolExecutor(found.at_once) as pool:
        responses = list(pool.map(send, range(found.at_once)))
    for response in responses:
        assert_no_server_error(response.status_code, response.content)
        if found.refused:
            # By the gateway itself, before any worker is asked.
            assert 400 <= response.status_code < 500, (found.why, response.status_code)
            assert response.json()["error"]["code"] != ENGINE_REFUSED, (found.why, response.text)
    invariants.check(f"found case {found.name} ({found.why})")
    request.node.user_properties.append(("fuzz_figures", f"{found.name}: {invariants.figures()}"))


@pytest.mark.parametrize(
    ("method", "path"), TENANT_OPERATIONS, ids=[f"{m} {p}" for m, p in TENANT_OPERATIONS]
)
def test_every_fuzzed_tenant_request_keeps_the_workers_alive_the_loop_free_and_memory_bounded(
    api_schema: schemathesis.BaseSchema,
    key: str,
    invariants: Invariants,
    request: pytest.FixtureRequest,
    method: str,
    path: str,
) -> None:
    if path not in api_schema.raw_schema["paths"]:
        pytest.skip(f"the checkout under test does not serve {path}")
    name_model = name_the_model(MODEL)

    def prepare(case: schemathesis.Case, mode: GenerationMode) -> None:
        name_model(case, mode)
        if mode != GenerationMode.POSITIVE or not isinstance(case.body, dict):
            return
        if path in ("/v1/tokenize", "/v1/detokenize"):
            case.body["model"] = MODEL
        # Valid outputs within the gateway's bound, so that they reach the engine; an invalid
        # case is refused before it does, whatever it asks for.
        for name in OUTPUT_FIELDS:
            value = case.body.get(name)
            if isinstance(value, int) and value > MAX_OUTPUT_TOKENS:
                case.body[name] = MAX_OUTPUT_TOKENS
        if path in REQUEST_MODELS:
            make_valid(case.body, REQUEST_MODELS[path])

    statuses: Counter[str] = Counter()

    def after(case: schemathesis.Case, response: schemathesis.Response) -> None:
        # A worker's refusal of what the gateway took is a gap in the gateway's own bounds
        # (not an invariant: the refusal is clean); the figures count it apart.
        engine = response.status_code == 400 and ENGINE_REFUSED in response.text
        statuses[f"{response.status_code}{' ' + ENGINE_REFUSED if engine else ''}"] += 1
        answered = f"{case.as_curl_command()} (answered {response.status_code})"
        invariants.check(answered, workers=path in GENERATION_ROUTES)

    generation = path in GENERATION_ROUTES
    try:
        sent = fuzz_operation(
            api_schema[path][method],
            key=key,
            positive=GENERATION_POSITIVE if generation else OTHER_EXAMPLES,
            negative=GENERATION_NEGATIVE if generation else OTHER_EXAMPLES,
            prepare=prepare,
            after=after,
            fuzz_seed=FUZZ_SEED,
            shrink=False,
        )
        invariants.check_workers(f"during {method} {path}")
    except BaseException:
        if FUZZ_SEED is not None:
            print(f"\nfuzz seed {FUZZ_SEED}: rerun with ISOGATE_FUZZ_SEED={FUZZ_SEED}")
        raise
    FUZZ_CASES[f"schemathesis on SGLang {method} {path}"] += sent
    answers = ", ".join(f"{count} x {status}" for status, count in sorted(statuses.items()))
    figures = f"{method} {path}: {invariants.figures()}; answers {answers}"
    request.node.user_properties.append(("fuzz_figures", figures))
    assert sent > 0


# The fuzzing keeps every answer small (MAX_OUTPUT_TOKENS, short prompts), and so cannot find
# what grows with an answer's size: a stream whose every chunk repeated and was checked whole
# (quadratic in its length), a scored prompt checked and read in one go. These are the largest
# answers a tenant may ask for of a gateway whose policy allows LARGEST_OUTPUT_TOKENS, each
# held to the same invariants: a whole answer's body is large enough for the engine's answer to
# be scanned (``gateway.workers.answer_json``) and its log probabilities written in slices.
LARGEST_OUTPUT_TOKENS = 4096
# Words of a prompt that, with its echo scored, fills most of the session pool.
SCORED_PROMPT_WORDS = 2300
LARGEST_ANSWERS = {
    "chat streamed, top_logprobs 20": (
        "/v1/chat/completions",
        # A shorter stream: each chunk is checked for what it adds, so length alone costs
        # nothing more per chunk, and the CPU pair takes a second per 200 tokens.
        {
            "messages": SIMPLE_MESSAGES,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
            "max_tokens": 1024,
        },
    ),
    "chat whole, top_logprobs 20": (
        "/v1/chat/completions",
        {"messages": SIMPLE_MESSAGES, "logprobs": True, "top_logprobs": 20},
    ),
    # The most choices: sixteen answers' log probabilities alive at once (about 100 MB written),
    # where the cyclic GC's walks over them, freeing them and writing the body held the loop.
    "chat whole, n 16, top_logprobs 20": (
        "/v1/chat/completions",
        {"messages": SIMPLE_MESSAGES, "logprobs": True, "top_logprobs": 20, "n": 16},
    ),
    # The Responses API has no ignore_eos: the random-weight model rarely ends early anyway.
    "responses whole, top_logprobs 20": (
        "/v1/responses",
        {
            "input": "Hello",
            "top_logprobs": 20,
            "include": ["message.output_text.logprobs"],
            "max_output_tokens": LARGEST_OUTPUT_TOKENS,
        },
    ),
    # A stream's last events carry the message's log probabilities three times over (its part,
    # its item and the completed response): megabytes at the end of a long answer.
    "responses streamed, top_logprobs 20": (
        "/v1/responses",
        {
            "input": "Hello",
            "stream": True,
            "top_logprobs": 20,
            "include": ["message.output_text.logprobs"],
            "max_output_tokens": LARGEST_OUTPUT_TOKENS,
        },
    ),
    "completions echo scored, logprobs 5": (
        "/v1/completions",
        {
            "prompt": " ".join(f"w{i % 97}" for i in range(SCORED_PROMPT_WORDS)),
            "echo": True,
            "logprobs": 5,
            "max_tokens": 1,
        },
    ),
}


@pytest.fixture(scope="module")
def large_gateway(
    pd_cluster: PDCluster | ExternalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    yield from gateway_for_cases(
        pd_cluster, tmp_path_factory, "large-gateway", LARGEST_OUTPUT_TOKENS
    )


@pytest.fixture(scope="module")
def large_invariants(
    large_gateway: GatewayProcess, pd_cluster: PDCluster | ExternalCluster
) -> tuple[Invariants, str]:
    key = large_gateway.create_tenant()[1]
    return invariants_of(large_gateway, key, pd_cluster), key


# A whole answer sends nothing until it is done, and 16 choices of the largest answer take the
# CPU pair minutes, more than five beside the rest of the suite: the client and the test wait
# longer than the suite's default limit (pyproject's ``timeout``), which that case came within
# a factor of two of.
LARGEST_ANSWER_WAIT_S = 840


@pytest.mark.timeout(LARGEST_ANSWER_WAIT_S + 60)
@pytest.mark.parametrize("name", list(LARGEST_ANSWERS))
def test_the_largest_answers_a_tenant_may_ask_for_keep_the_invariants(
    large_gateway: GatewayProcess,
    large_invariants: tuple[Invariants, str],
    request: pytest.FixtureRequest,
    name: str,
) -> None:
    invariants, key = large_invariants
    path, fields = LARGEST_ANSWERS[name]
    body = {"model": MODEL, **fields}
    if path != "/v1/responses":
        body = {"max_tokens": LARGEST_OUTPUT_TOKENS, "ignore_eos": True, **body}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", large_gateway.url + path, json=body, headers=headers, timeout=LARGEST_ANSWER_WAIT_S
    ) as response:
        raw = response.read()
    assert response.status_code == 200, raw[:500]
    assert b"isolation_check_failed" not in raw and len(raw) > 100_000  # a large answer indeed
    invariants.check(f"the largest answer: {name}")
    request.node.user_properties.append(("fuzz_figures", f"{name}: {invariants.figures()}"))
