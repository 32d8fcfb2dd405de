"""Test harness: the policy files a test's gateway runs with, and waiting on state no event
announces.

The gateway itself, as a real process over real HTTP with tenants made through its admin API
(``GatewayProcess``), and the port helpers live in ``gateway.dev.harness``, shared with the
bench suite. Tests talk to the gateway exactly as clients do (the ``openai`` SDK, httpx);
nothing is imported into the test process that a deployment would not run in a separate one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PoolSpec:
    name: str
    prefill: tuple[tuple[str, int], ...]  # (url, bootstrap_port)
    decode: tuple[str, ...]
    dedicated_to: tuple[str, ...] = ()


def write_policies(
    directory: Path,
    *,
    model_name: str,
    tokenizer_dir: Path,
    pools: Iterable[PoolSpec],
    max_context_tokens: int = 65536,
    require_engine_tags: bool = True,
    max_output_tokens: int = 1024,
    tenants: dict[str, Any] | None = None,
    default_limits: dict[str, int] | None = None,
    tool_call_parser: str | None = None,
    plain_twin: str | None = None,
) -> Path:
    """The policy files for one model (``tool_call_parser`` names its tool-call format); with
    ``plain_twin``, also a second model of that name on the same tokenizer and pools, with no
    tool calling."""
    directory.mkdir(parents=True, exist_ok=True)
    models = {
        "models": [
            {
                "name": model_name,
                "tokenizer": str(tokenizer_dir),
                "max_context_tokens": max_context_tokens,
                "default_max_tokens": 16,
                "max_output_tokens": max_output_tokens,
                "require_engine_tags": require_engine_tags,
                "pools": [
                    {
                        "name": pool.name,
                        "dedicated_to": list(pool.dedicated_to),
                        "prefill": [
                            {"url": url, "bootstrap_port": port} for url, port in pool.prefill
                        ],
                        "decode": [{"url": url} for url in pool.decode],
                    }
                    for pool in pools
                ],
            }
        ]
    }
    if tool_call_parser is not None:
        models["models"][0]["tool_call_parser"] = tool_call_parser
    if plain_twin is not None:
        models["models"].append({**models["models"][0], "name": plain_twin})
        models["models"][-1].pop("tool_call_parser", None)
    (directory / "models.yaml").write_text(yaml.safe_dump(models))
    tenants_file = {
        "defaults": {
            "isolation": "shared",
            "limits": default_limits
            or {
                "requests_per_minute": 100000,
                "tokens_per_minute": 100000000,
                "max_concurrent": 1000,
            },
        },
        "tenants": tenants or {},
    }
    (directory / "tenants.yaml").write_text(yaml.safe_dump(tenants_file))
    return directory


async def wait_until(condition: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Until ``condition()`` holds, polled on the event loop (for state kept where no event
    can be awaited, such as a stand-in's thread); AssertionError once ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)
