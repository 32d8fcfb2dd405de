"""Alembic environment for isogate's schema (tenants, API keys, audit log).

Run through ``isogate migrate`` (``gateway.tenancy.store.Store.migrate``), which hands over a ready
engine in ``config.attributes["engine"]``. Plain ``alembic -c ...`` also works with
``sqlalchemy.url`` set in the config.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from gateway.tenancy.store import metadata, normalize_url

config = context.config


def run_migrations() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        engine = create_engine(normalize_url(config.get_main_option("sqlalchemy.url")))
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            # SQLite cannot ALTER most things in place; batch mode recreates tables.
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; give a database URL")
run_migrations()
