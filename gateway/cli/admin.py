"""``isogate migrate | tenant | key | audit``: administration straight against the database.

Every command takes ``--database-url`` (default: ``ISOGATE_DATABASE_URL``, else the SQLite
file of ``Settings``). Output is JSON lines (one object per line, for scripts) or, with
``--format table``, aligned columns. A created key is printed once and never again.

A gateway caches keys for ``auth_cache_ttl_s``: a key revoked or a tenant disabled here
stops working in running gateways within that time (the admin API acts at once on the
replica that serves it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import orjson

from gateway.api.admin_routes import TENANT_ID_PATTERN
from gateway.api.audit_routes import MAX_LIMIT, parse_cursor, parse_limit, parse_outcome, parse_time
from gateway.common.errors import APIError
from gateway.config.settings import Settings
from gateway.tenancy.store import (
    OUTCOMES,
    AuditQuery,
    Store,
    StoreConflict,
    StoreNotFound,
    audit_row_json,
    create_store,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url", help="SQLAlchemy URL (default: ISOGATE_DATABASE_URL or the SQLite file)"
    )
    common.add_argument("--format", choices=("jsonl", "table"), default="jsonl")

    migrate = subparsers.add_parser(
        "migrate", parents=[common], help="create or upgrade the database schema"
    )
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.set_defaults(func=_command(cmd_migrate))

    tenant = subparsers.add_parser("tenant", help="manage tenants").add_subparsers(
        dest="tenant_command", required=True
    )
    create = tenant.add_parser("create", parents=[common], help="create a tenant")
    create.add_argument("tenant_id")
    create.add_argument("--name")
    create.set_defaults(func=_command(cmd_tenant_create))
    tenant.add_parser("list", parents=[common], help="list tenants").set_defaults(
        func=_command(cmd_tenant_list)
    )
    for verb, disabled in (("disable", True), ("enable", False)):
        sub = tenant.add_parser(verb, parents=[common], help=f"{verb} a tenant (all its keys)")
        sub.add_argument("tenant_id")
        sub.set_defaults(func=_command(_tenant_toggle(disabled)))

    key = subparsers.add_parser("key", help="manage API keys").add_subparsers(
        dest="key_command", required=True
    )
    create = key.add_parser(
        "create", parents=[common], help="create a key for a tenant (printed once)"
    )
    create.add_argument("tenant_id")
    create.add_argument("--name")
    create.add_argument(
        "--models",
        help="comma-separated: the only models the key may call, within its tenant's",
    )
    create.set_defaults(func=_command(cmd_key_create))
    listing = key.add_parser("list", parents=[common], help="list keys (never the keys themselves)")
    listing.add_argument("--tenant")
    listing.set_defaults(func=_command(cmd_key_list))
    revoke = key.add_parser("revoke", parents=[common], help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_command(cmd_key_revoke))

    audit = subparsers.add_parser(
        "audit", parents=[common], help="read the audit log, newest first"
    )
    audit.add_argument("--tenant", help="only this tenant's events")
    audit.add_argument("--since", help="RFC 3339, inclusive")
    audit.add_argument("--until", help="RFC 3339, exclusive")
    audit.add_argument("--outcome", choices=OUTCOMES)
    audit.add_argument("--model")
    audit.add_argument("--generation-id")
    audit.add_argument("--limit", default="100", help=f"1..{MAX_LIMIT} (default 100)")
    audit.add_argument("--cursor", help="next_cursor printed by the previous page")
    audit.set_defaults(func=_command(cmd_audit))


Handler = Callable[[Store, argparse.Namespace, TextIO, TextIO], int]


def _command(handler: Handler) -> Callable[..., int]:
    """What ``args.func`` holds: ``args.func(args)`` runs the command, returns the exit status."""

    def command(
        args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
    ) -> int:
        out = out or sys.stdout
        err = err or sys.stderr
        store = create_store(args.database_url or Settings().database_url)
        try:
            return handler(store, args, out, err)
        except (StoreConflict, StoreNotFound, ValueError) as exc:
            print(f"isogate: {exc}", file=err)
            return 1
        except APIError as exc:  # a bad filter, reported like the API would
            print(f"isogate: {exc.message}", file=err)
            return 2
        finally:
            store.dispose()

    return command


def cmd_migrate(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    before = store.current_revision()
    store.migrate(args.revision)
    _emit(out, args.format, [{"from": before, "to": store.current_revision()}])
    return 0


def cmd_tenant_create(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if not TENANT_ID_PATTERN.match(args.tenant_id):
        raise ValueError("tenant id must be 1-64 characters of a-z, 0-9, '_', '.', '-'")
    _emit(out, args.format, [store.create_tenant(args.tenant_id, args.name).to_json()])
    return 0


def cmd_tenant_list(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    _emit(out, args.format, [t.to_json() for t in store.list_tenants()])
    return 0


def _tenant_toggle(disabled: bool) -> Handler:
    def handler(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
        _emit(out, args.format, [store.set_tenant_disabled(args.tenant_id, disabled).to_json()])
        return 0

    return handler


def cmd_key_create(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    models = None if args.models is None else [m for m in args.models.split(",") if m]
    raw_key, record = store.create_key(args.tenant_id, args.name, models)
    _emit(out, args.format, [{**record.to_json(), "key": raw_key}])
    return 0


def cmd_key_list(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    _emit(out, args.format, [k.to_json() for k in store.list_keys(args.tenant)])
    return 0


def cmd_key_revoke(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    _emit(out, args.format, [store.revoke_key(args.key_id).to_json()])
    return 0


def cmd_audit(store: Store, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    query = AuditQuery(
        tenant_id=args.tenant,
        since=parse_time(args.since, "since"),
        until=parse_time(args.until, "until"),
        outcome=parse_outcome(args.outcome),
        model=args.model,
        generation_id=args.generation_id,
        limit=parse_limit(args.limit),
        after=parse_cursor(args.cursor),
    )
    rows, next_cursor = store.query_audit(query)
    _emit(out, args.format, [audit_row_json(r, admin=True) for r in rows])
    if next_cursor:
        print(f"# next_cursor: {next_cursor}", file=err)
    return 0


def _emit(out: TextIO, fmt: str, records: Sequence[dict[str, Any]]) -> None:
    if fmt == "jsonl":
        for record in records:
            out.write(orjson.dumps(record).decode() + "\n")
        return
    if not records:
        return
    columns = [c for c in records[0] if c != "object"]
    cells = [[_cell(r.get(c)) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    out.write(
        "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip() + "\n"
    )
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry for these commands (``python -m gateway.cli.admin``)."""
    parser = argparse.ArgumentParser(prog="isogate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.func
    return command(args)


if __name__ == "__main__":
    raise SystemExit(main())
