"""Real clients, unchanged, against the gateway in front of real SGLang (the session pair, CPU).

The tools people point at an OpenAI-compatible server, as they run by default: guidellm
0.8.1's streaming benchmark (chat and completions; it sends ``stream_options`` with
``continuous_usage_stats`` and reads usage from every chunk; every request was a 400 before),
and lm-eval 0.4.13's ``local-completions`` (a loglikelihood task, scored through ``echo`` and
``logprobs``, and a generate_until task) and ``local-chat-completions``, on tasks read from a
local JSONL file. ``make test`` installs both into the engine's venv
(``scripts/install-clients``); their data is made here (guidellm's synthetic text, this
module's JSONL), nothing is fetched.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.dev.cluster import PDCluster, default_engine_python
from gateway.dev.harness import GatewayProcess
from tests.conftest import MODEL

pytestmark = pytest.mark.engine

ENGINE_BIN = default_engine_python().parent
REQUESTS = 6
CAPITALS = [
    {"country": "France", "capital": "Paris", "choices": ["Paris", "Rome"], "answer": 0},
    {"country": "Italy", "capital": "Rome", "choices": ["Berlin", "Rome"], "answer": 1},
    {"country": "Germany", "capital": "Berlin", "choices": ["Berlin", "Madrid"], "answer": 0},
    {"country": "Spain", "capital": "Madrid", "choices": ["Paris", "Madrid"], "answer": 1},
]


@pytest.fixture(scope="module")
def installed() -> Path:
    if not (ENGINE_BIN / "guidellm").exists() or not (ENGINE_BIN / "lm_eval").exists():
        pytest.fail(f"guidellm and lm_eval missing in {ENGINE_BIN}: `make test` installs them")
    return ENGINE_BIN


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # Offline: any attempt to reach a model or data hub fails rather than waits.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env}
    done = subprocess.run(
        command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellms_default_streaming_benchmark_succeeds_and_reads_usage_from_the_chunks(
    installed: Path,
    gateway: GatewayProcess,
    tenant: tuple[str, str],
    pd_cluster: PDCluster,
    tmp_path: Path,
    route: str,
) -> None:
    output = tmp_path / "benchmarks.json"
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": gateway.url,
                "model": MODEL,
                "api_key": tenant[1],
                "request_format": route,
            },
            "profile": {"kind": "synchronous"},
            "constraints": [{"kind": "max_requests", "count": REQUESTS}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(pd_cluster.spec.model_dir)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 24, "output_tokens": 8}],
            "outputs": [{"kind": "json", "path": str(output)}],
        }
    }
    config = tmp_path / "scenario.json"
    config.write_text(json.dumps(scenario))
    run([str(installed / "guidellm"), "run", "-c", str(config), "--disable-console"], {}, tmp_path)
    [benchmark] = json.loads(output.read_text())["benchmarks"]
    requests = benchmark["requests"]
    counts = {kind: len(listed or []) for kind, listed in requests.items()}
    assert counts["successful"] == REQUESTS, counts  # 0 of them (all 400) before issue 41
    assert not requests["errored"] and not requests["incomplete"]
    for request in requests["successful"]:
        # The token counts it reports are the gateway's usage, read from the stream.
        assert request["output_metrics"]["text_tokens"] == 8, request["output_metrics"]
        assert request["input_metrics"]["text_tokens"] > 0


def write_tasks(directory: Path) -> Path:
    """Two lm-eval tasks over a local JSONL file: one scored by log-likelihood (multiple
    choice), one generated until a newline."""
    directory.mkdir(parents=True)
    data = directory / "capitals.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CAPITALS))
    common = (
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        'doc_to_text: "Q: What is the capital of {{country}}?\\nA:"\n'
    )
    (directory / "capitals_choice.yaml").write_text(
        "task: isogate_capitals_choice\n" + common + "output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (directory / "capitals_gen.yaml").write_text(
        "task: isogate_capitals_gen\n" + common + "output_type: generate_until\n"
        'doc_to_target: " {{capital}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return directory


def lm_eval_results(
    installed: Path, model: str, model_args: str, tasks: str, key: str, tmp_path: Path, *extra: str
) -> dict[str, Any]:
    tasks_dir = write_tasks(tmp_path / "tasks")
    output = tmp_path / "out"
    run(
        [
            str(installed / "lm_eval"),
            "--model",
            model,
            "--model_args",
            model_args,
            "--tasks",
            tasks,
            "--include_path",
            str(tasks_dir),
            "--output_path",
            str(output),
            "--log_samples",
            *extra,
        ],
        {"OPENAI_API_KEY": key},
        tmp_path,
    )
    [results_file] = output.rglob("results_*.json")
    results: dict[str, Any] = json.loads(results_file.read_text())
    return results


def test_lm_evals_local_completions_scores_and_generates(
    installed: Path,
    gateway: GatewayProcess,
    tenant: tuple[str, str],
    pd_cluster: PDCluster,
    tmp_path: Path,
) -> None:
    model_args = (
        f"model={MODEL},base_url={gateway.url}/v1/completions,"
        f"tokenizer={pd_cluster.spec.model_dir},tokenizer_backend=huggingface,"
        "num_concurrent=2,max_retries=1"
    )
    tasks = "isogate_capitals_choice,isogate_capitals_gen"
    results = lm_eval_results(
        installed, "local-completions", model_args, tasks, tenant[1], tmp_path
    )
    for task in ("isogate_capitals_choice", "isogate_capitals_gen"):
        assert results["n-samples"][task]["effective"] == len(CAPITALS), results["n-samples"]
    assert 0.0 <= results["results"]["isogate_capitals_choice"]["acc,none"] <= 1.0
    assert 0.0 <= results["results"]["isogate_capitals_gen"]["exact_match,none"] <= 1.0


def test_lm_evals_local_chat_completions_generates(
    installed: Path, gateway: GatewayProcess, tenant: tuple[str, str], tmp_path: Path
) -> None:
    model_args = (
        f"model={MODEL},base_url={gateway.url}/v1/chat/completions,num_concurrent=2,max_retries=1"
    )
    results = lm_eval_results(
        installed,
        "local-chat-completions",
        model_args,
        "isogate_capitals_gen",
        tenant[1],
        tmp_path,
        "--apply_chat_template",
    )
    assert results["n-samples"]["isogate_capitals_gen"]["effective"] == len(CAPITALS)
    assert 0.0 <= results["results"]["isogate_capitals_gen"]["exact_match,none"] <= 1.0
