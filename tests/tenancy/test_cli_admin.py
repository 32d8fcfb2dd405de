"""``isogate migrate | tenant | key | audit`` against PostgreSQL and SQLite."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime

from gateway.cli import admin as cli_admin
from gateway.tenancy.store import create_store, hash_key, head_revision

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def isogate(database_url: str, *argv: str) -> tuple[int, list[dict], str]:
    parser = argparse.ArgumentParser(prog="isogate")
    cli_admin.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([*argv, "--database-url", database_url])
    out, err = io.StringIO(), io.StringIO()
    status = args.func(args, out, err)
    records = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    return status, records, err.getvalue()


def test_admin_commands_manage_tenants_and_keys(database_url: str) -> None:
    status, [migrated], _ = isogate(database_url, "migrate")
    assert status == 0 and migrated == {"from": None, "to": head_revision()}
    assert isogate(database_url, "migrate")[1] == [{"from": head_revision(), "to": head_revision()}]

    status, [tenant], _ = isogate(database_url, "tenant", "create", "acme", "--name", "Acme")
    assert status == 0 and tenant["id"] == "acme" and tenant["name"] == "Acme"
    status, _, err = isogate(database_url, "tenant", "create", "acme")
    assert status == 1 and "already exists" in err
    assert isogate(database_url, "tenant", "create", "Bad Id")[0] == 1

    status, [key], _ = isogate(database_url, "key", "create", "acme", "--name", "ci")
    assert status == 0 and key["key"].startswith("sk-iso-")
    status, listed, _ = isogate(database_url, "key", "list", "--tenant", "acme")
    assert [k["id"] for k in listed] == [key["id"]] and "key" not in listed[0]
    assert isogate(database_url, "key", "create", "nobody")[0] == 1

    store = create_store(database_url)
    assert store.lookup_key(hash_key(key["key"])).revoked is False
    status, [revoked], _ = isogate(database_url, "key", "revoke", key["id"])
    assert status == 0 and revoked["revoked_at"]
    assert store.lookup_key(hash_key(key["key"])).revoked is True

    status, [disabled], _ = isogate(database_url, "tenant", "disable", "acme")
    assert disabled["disabled"] is True
    assert isogate(database_url, "tenant", "list")[1][0]["disabled"] is True
    store.dispose()


def test_audit_command_filters_and_pages(database_url: str) -> None:
    store = create_store(database_url, migrate=True)
    store.insert_audit_rows(
        [
            dict(
                generation_id=f"g{i}",
                tenant_id="acme" if i % 2 else "beta",
                key_id=None,
                model="m",
                outcome="served" if i % 3 else "rejected",
                status=200,
                code=None,
                prefill_worker=None,
                decode_worker=None,
                prompt_tokens=i,
                completion_tokens=0,
                stream=False,
                latency_ms=0.5,
                created_at=datetime(2026, 11, 29, 12, 0, i, tzinfo=UTC),
                detail=None,
            )
            for i in range(10)
        ]
    )
    store.dispose()
    status, events, _ = isogate(database_url, "audit", "--tenant", "acme")
    assert status == 0 and [e["id"] for e in events] == ["g9", "g7", "g5", "g3", "g1"]
    _, events, err = isogate(database_url, "audit", "--limit", "3", "--outcome", "served")
    assert [e["id"] for e in events] == ["g8", "g7", "g5"]
    cursor = err.split("next_cursor: ")[1].strip()
    _, events, _ = isogate(
        database_url, "audit", "--limit", "3", "--outcome", "served", "--cursor", cursor
    )
    assert [e["id"] for e in events] == ["g4", "g2", "g1"]
    _, events, _ = isogate(database_url, "audit", "--since", "2026-11-29T12:00:08Z")
    assert [e["id"] for e in events] == ["g9", "g8"]
    assert isogate(database_url, "audit", "--since", "nonsense")[0] == 2


def test_table_format_prints_a_header_and_one_line_per_record(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    isogate(url, "migrate")
    for tenant in ("acme", "beta"):
        isogate(url, "tenant", "create", tenant)
    parser = argparse.ArgumentParser()
    cli_admin.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tenant", "list", "--format", "table", "--database-url", url])
    out = io.StringIO()
    assert args.func(args, out, io.StringIO()) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["ID", "NAME", "DISABLED", "CREATED_AT"]
    assert [line.split()[0] for line in lines[1:]] == ["acme", "beta"]


def test_module_entry_point_runs_a_command(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'y.db'}"
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli.admin", "migrate", "--database-url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"from": None, "to": head_revision()}


def test_a_key_created_with_models_is_narrowed_to_them(database_url: str) -> None:
    isogate(database_url, "migrate")
    isogate(database_url, "tenant", "create", "acme")
    status, [key], _ = isogate(database_url, "key", "create", "acme", "--models", "a,b")
    assert status == 0 and key["models"] == ["a", "b"]
    status, [plain], _ = isogate(database_url, "key", "create", "acme")
    assert plain["models"] is None
    store = create_store(database_url)
    assert store.lookup_key(hash_key(key["key"])).models == ("a", "b")
    assert store.lookup_key(hash_key(plain["key"])).models is None
    store.dispose()
