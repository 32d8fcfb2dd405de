"""``isogate policies check [DIR] [--live URL]``: the platform team's policies, checked before
they ship.

Offline, the directory is loaded as the gateway loads it (schema, models named by tenants,
aliases that name a model and shadow none: what a reload refuses) and then held to what a
deployment needs that a load does not refuse: every pool's ``dedicated_to`` names a tenant of
tenants.yaml of class dedicated (else the pool is never routed to), every dedicated tenant may
call a model with a pool dedicated to it, and every model a shared tenant may call has a shared
pool. Each problem is printed as ``FILE: FIELD: REASON``; any problem exits 1.

With ``--live URL`` (the admin key in ``ISOGATE_ADMIN_KEY``) the directory is compared with
what the gateway at URL runs (``/admin/policies``): models, tenants and aliases added, removed
or moved, every limit, budget and bound changed, and, from the live pool capacity
(``/admin/workers``), the prompt sizes admitted today that would be refused after.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from gateway.config.policies import PolicyError, load_policies

_FILES = ("models.yaml", "tenants.yaml")


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.reason}"


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = commands.add_parser("policies", help="the platform team's policy files")
    actions = group.add_subparsers(dest="policies_command", required=True)
    check = actions.add_parser(
        "check",
        help="validate a policies directory; with --live, what it would change on a gateway",
    )
    check.add_argument(
        "directory", nargs="?", type=Path, help="default: the gateway's (ISOGATE_POLICIES_DIR)"
    )
    check.add_argument(
        "--live", metavar="URL", help="compare with the gateway at URL (ISOGATE_ADMIN_KEY)"
    )
    check.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    directory: Path = args.directory or _default_directory()
    problems = check_directory(directory)
    for problem in problems:
        print(problem, file=err)
    if problems:
        print(f"isogate policies check: {len(problems)} problem(s) in {directory}", file=err)
        return 1
    policies = load_policies(directory)
    print(
        f"ok: {directory}: {len(policies.models)} model(s), {len(policies.aliases)} alias(es), "
        f"{len(policies.tenants)} tenant(s)",
        file=out,
    )
    if args.live is None:
        return 0
    admin_key = os.environ.get("ISOGATE_ADMIN_KEY")
    if not admin_key:
        print("isogate policies check: --live needs ISOGATE_ADMIN_KEY", file=err)
        return 2
    try:
        live, workers = _read_live(args.live.rstrip("/"), admin_key)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"isogate policies check: {args.live}: {exc}", file=err)
        return 2
    changes = list(live_changes(live, policies.summary(), workers))
    print(f"against {args.live}:", file=out)
    for change in changes or ["no change"]:
        print(f"  {change}", file=out)
    return 0


def _default_directory() -> Path:
    from gateway.config.settings import Settings

    return Settings().policies_dir


# ---- offline -----------------------------------------------------------------------------------


def check_directory(directory: Path) -> list[Problem]:
    """Every problem of the directory: what a load refuses (one, as the load stops there), or
    else each deployment problem a load lets through."""
    try:
        policies = load_policies(directory)
    except PolicyError as exc:
        return _problems_of(str(exc), directory)
    summary = policies.summary()
    tenants: dict[str, dict[str, Any]] = summary["tenants"]
    defaults: dict[str, Any] = summary["tenant_defaults"]
    problems: list[Problem] = []
    for name, model in summary["models"].items():
        for index, pool in enumerate(model["pools"]):
            where = f"models.{name}.pools.{index}.dedicated_to"
            for tenant_id in pool["dedicated_to"]:
                tenant = tenants.get(tenant_id)
                if tenant is None:
                    problems.append(
                        Problem(
                            "models.yaml", where, f"tenant {tenant_id!r} is not in tenants.yaml"
                        )
                    )
                elif tenant["isolation"] != "dedicated":
                    problems.append(
                        Problem(
                            "models.yaml",
                            where,
                            f"tenant {tenant_id!r} is of class shared: it is never routed to "
                            f"pool {pool['name']!r}",
                        )
                    )
    for tenant_id, tenant in [("defaults", defaults), *tenants.items()]:
        where = "defaults" if tenant_id == "defaults" else f"tenants.{tenant_id}"
        callable_models = [
            name
            for name in summary["models"]
            if tenant["models"] is None or name in tenant["models"]
        ]
        if tenant["isolation"] == "dedicated" and tenant_id != "defaults":
            reachable = [
                name
                for name in callable_models
                if any(tenant_id in p["dedicated_to"] for p in summary["models"][name]["pools"])
            ]
            if not reachable:
                problems.append(
                    Problem(
                        "tenants.yaml",
                        f"{where}.models",
                        "dedicated, but none of the models it may call has a pool dedicated to it",
                    )
                )
        if tenant["isolation"] == "shared":
            for name in callable_models:
                if all(p["dedicated_to"] for p in summary["models"][name]["pools"]):
                    problems.append(
                        Problem(
                            "tenants.yaml",
                            where,
                            f"a shared tenant that may call model {name!r}, which has no "
                            "shared pool (every request of it would be refused)",
                        )
                    )
    return problems


def _problems_of(message: str, directory: Path) -> list[Problem]:
    """A load's refusal (``PATH: FIELD: REASON; FIELD: REASON`` or ``PATH: REASON``) as
    problems naming the file by its name."""
    path, _, rest = message.partition(": ")
    file = Path(path).name if Path(path).name in _FILES else str(directory)
    problems = []
    for part in rest.split("; "):
        field, separator, reason = part.partition(": ")
        if not separator or " " in field:  # no field named: the file as a whole
            field, reason = "(file)", part
        reason = reason.removeprefix("Value error, ")
        if field == "(top)":  # a check across the file's fields names the field itself
            inner, separator, rest = reason.partition(": ")
            if separator and " " not in inner:
                field, reason = inner, rest
        problems.append(Problem(file, field, reason))
    return problems


# ---- against a running gateway -------------------------------------------------------------


def _read_live(url: str, admin_key: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The gateway's policies and each worker's KV pool (tokens), as it sees them now."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
        policies = client.get("/admin/policies")
        policies.raise_for_status()
        workers = client.get("/admin/workers")
        workers.raise_for_status()
    pools = {
        record["url"]: int(record["capacity"]["max_total_num_tokens"])
        for record in workers.json()["data"]
        if record.get("capacity")
    }
    live: dict[str, Any] = policies.json()
    return live, pools


def live_changes(
    live: dict[str, Any], new: dict[str, Any], pool_tokens: Mapping[str, int]
) -> Iterator[str]:
    """What replacing ``live`` by ``new`` (both ``Policies.summary``) would change."""
    yield from _added_removed("model", live["models"], new["models"])
    yield from _aliases(live["aliases"], new["aliases"])
    yield from _added_removed("tenant", live["tenants"], new["tenants"])
    for name in sorted(live["models"].keys() & new["models"].keys()):
        before, after = dict(live["models"][name]), dict(new["models"][name])
        pools_before, pools_after = before.pop("pools"), after.pop("pools")
        yield from _changed(f"models.{name}", before, after)
        if pools_before != pools_after:
            yield f"models.{name}.pools: changed"
    yield from _changed("defaults", live["tenant_defaults"], new["tenant_defaults"])
    for tenant_id in sorted(live["tenants"].keys() & new["tenants"].keys()):
        yield from _changed(
            f"tenants.{tenant_id}", live["tenants"][tenant_id], new["tenants"][tenant_id]
        )
    for name in sorted(live["models"]):
        today = _admitted(live["models"][name], pool_tokens)
        if today is None:
            continue
        largest, bound = today
        if name not in new["models"]:
            yield (
                f"models.{name}: removed: prompts of up to {largest} tokens (prompt + "
                "max_tokens) admitted today would be refused"
            )
            continue
        then = _admitted(new["models"][name], pool_tokens)
        if then is not None and then[0] < largest:
            yield (
                f"models.{name}: prompts of {then[0] + 1} to {largest} tokens (prompt + "
                f"max_tokens) are admitted today ({bound}) and would be refused after "
                f"({then[1]})"
            )


def _admitted(model: dict[str, Any], pool_tokens: Mapping[str, int]) -> tuple[int, str] | None:
    """The largest prompt + max_tokens a shared tenant's request to the model is admitted
    with, and what bounds it: the policy's max_context_tokens or the best shared pool's
    smallest live KV pool. None where no shared pool's workers report a capacity."""
    best: tuple[int, str] | None = None
    for pool in model["pools"]:
        if pool["dedicated_to"]:
            continue
        sizes = [pool_tokens.get(url) for url in [*pool["prefill"], *pool["decode"]]]
        if any(size is None for size in sizes):
            continue
        smallest = min(size for size in sizes if size is not None)
        limit = (
            (model["max_context_tokens"], "max_context_tokens")
            if model["max_context_tokens"] <= smallest
            else (smallest, f"pool {pool['name']!r}'s KV pool")
        )
        if best is None or limit[0] > best[0]:
            best = limit
    return best


def _added_removed(kind: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> Iterator[str]:
    for name in sorted(after.keys() - before.keys()):
        yield f"{kind} added: {name}"
    for name in sorted(before.keys() - after.keys()):
        yield f"{kind} removed: {name}"


def _aliases(before: Mapping[str, str], after: Mapping[str, str]) -> Iterator[str]:
    for alias in sorted(before.keys() | after.keys()):
        old, new = before.get(alias), after.get(alias)
        if old == new:
            continue
        if old is None:
            yield f"alias added: {alias} -> {new}"
        elif new is None:
            yield f"alias removed: {alias} (was -> {old})"
        else:
            yield f"alias moved: {alias}: {old} -> {new}"


def _changed(where: str, before: Any, after: Any) -> Iterator[str]:
    """Each leaf that differs, as ``where.field: before -> after``."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(before.keys() | after.keys()):
            yield from _changed(f"{where}.{key}", before.get(key), after.get(key))
    elif before != after:
        yield f"{where}: {_shown(before)} -> {_shown(after)}"


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)
