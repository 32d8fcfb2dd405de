"""Policy changes take effect without a restart (file watch and SIGHUP); a bad file is refused
with one clear log line and the policies in force stay in force."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from gateway.dev.harness import GatewayProcess
from gateway.service.reload import POLL_INTERVAL_S
from tests.deploy.conftest import MODEL, chat, log_lines, log_size, model_ids, wait_for


def refusals(gateway: GatewayProcess, offset: int) -> list[dict[str, Any]]:
    return [
        line for line in log_lines(gateway, offset) if line.get("event") == "policy_reload_refused"
    ]


def _add_model(policies_dir: Path, name: str) -> None:
    models_file = policies_dir / "models.yaml"
    document = yaml.safe_load(models_file.read_text())
    document["models"].append(dict(document["models"][0], name=name))
    models_file.write_text(yaml.safe_dump(document))


def test_an_edited_models_file_adds_a_model_without_a_restart(start_gateway) -> None:
    gateway = start_gateway()
    _, key = gateway.create_tenant()
    assert model_ids(gateway, key) == [MODEL]
    pid = gateway.process.pid

    _add_model(gateway.policies_dir, "tiny-llama-b")

    wait_for(
        lambda: model_ids(gateway, key) == sorted([MODEL, "tiny-llama-b"]), what="the new model"
    )
    assert chat(gateway, key, model="tiny-llama-b").status_code == 200
    assert gateway.process.pid == pid and gateway.process.poll() is None
    # Log lines reach the file in batches (within 0.1 s): wait for the line, not just the effect.
    reloaded = wait_for(
        lambda: [line for line in log_lines(gateway) if line.get("event") == "policy_reloaded"],
        what="the reload's log line",
    )
    assert reloaded[-1]["trigger"] == "file change"
    assert reloaded[-1]["models"] == sorted([MODEL, "tiny-llama-b"])


def test_a_broken_policy_file_is_refused_and_the_previous_policies_stay_in_force(
    start_gateway,
) -> None:
    gateway = start_gateway()
    _, key = gateway.create_tenant()
    models_file = gateway.policies_dir / "models.yaml"
    offset = log_size(gateway)

    models_file.write_text("models:\n  - name: half-written\n    pools: [\n")

    refused = wait_for(lambda: refusals(gateway, offset), what="the refusal line")
    reported_at = time.monotonic()
    line = refused[0]
    assert line["level"] == "error"
    assert str(models_file) in line["message"] and "not valid YAML" in line["message"]
    assert "previous policies stay in force" in line["message"]
    assert model_ids(gateway, key) == [MODEL]
    assert chat(gateway, key).status_code == 200
    # Reported once, not on every poll: a report repeated by the watch would come within one
    # poll interval of the first; three are awaited from the first one on.
    while time.monotonic() < reported_at + 3 * POLL_INTERVAL_S:
        if len(refusals(gateway, offset)) > 1:
            break
        time.sleep(0.1)
    assert len(refusals(gateway, offset)) == 1, "a broken file is reported once, not on every poll"

    # A file that parses but breaks the schema is refused the same way, naming the field.
    models_file.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {"name": "no-pools", "tokenizer": "x", "max_context_tokens": 0, "pools": []}
                ]
            }
        )
    )
    schema = wait_for(lambda: refusals(gateway, offset)[1:], what="the schema refusal")
    assert "max_context_tokens" in schema[0]["problem"] and "pools" in schema[0]["problem"]
    assert model_ids(gateway, key) == [MODEL]


def test_sighup_reloads_a_change_the_file_watch_cannot_see(start_gateway) -> None:
    gateway = start_gateway()
    _, key = gateway.create_tenant()
    _add_model(gateway.policies_dir, "tiny-llama-b")
    wait_for(
        lambda: model_ids(gateway, key) == sorted([MODEL, "tiny-llama-b"]), what="the first reload"
    )

    # Same size, same inode, same mtime: invisible to the watch; only SIGHUP can bring it in.
    models_file = gateway.policies_dir / "models.yaml"
    before = models_file.stat()
    text = models_file.read_text()
    assert text.count("tiny-llama-b") == 1
    with open(models_file, "r+") as handle:
        handle.write(text.replace("tiny-llama-b", "tiny-llama-c"))
    os.utime(models_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (
        models_file.stat().st_ino == before.st_ino and models_file.stat().st_size == before.st_size
    )
    time.sleep(2.5)  # two and a half poll intervals: the watch has looked and seen nothing
    assert model_ids(gateway, key) == sorted([MODEL, "tiny-llama-b"])

    os.kill(gateway.process.pid, signal.SIGHUP)

    wait_for(
        lambda: model_ids(gateway, key) == sorted([MODEL, "tiny-llama-c"]), what="the SIGHUP reload"
    )
    assert gateway.process.poll() is None
    triggers = wait_for(
        lambda: [
            line["trigger"]
            for line in log_lines(gateway)
            if line.get("event") == "policy_reloaded" and line["trigger"] == "SIGHUP"
        ],
        what="the SIGHUP reload's log line",
    )
    assert triggers == ["SIGHUP"]
