"""Fixtures for tenants, keys, the audit log and limits: real PostgreSQL, SQLite and Redis.

Every store fixture is parametrised over both databases. PostgreSQL tests each get a
schema of their own (``isogate_t_<random>``, dropped afterwards) selected through the
connection's ``search_path``, so parallel runs by other engineers never collide; Redis
tests use a key prefix of their own and delete their keys afterwards.
"""

from __future__ import annotations

import os
import secrets
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.admin_routes import admin_routes
from gateway.api.audit_routes import audit_routes
from gateway.common.errors import APIError
from gateway.config.settings import Settings
from gateway.observability.metrics import Metrics
from gateway.tenancy.auth import Authenticator
from gateway.tenancy.limits import TenantLimiter
from gateway.tenancy.revocations import Revocations
from gateway.tenancy.store import Store, create_store, normalize_url

POSTGRES_URL = os.environ.get(
    "ISOGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
ADMIN_KEY = "test-admin-key-" + secrets.token_hex(8)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class PostgresSchema:
    """A throwaway schema in the shared test database."""

    def __init__(self, base_url: str = POSTGRES_URL):
        self.name = "isogate_t_" + secrets.token_hex(6)
        self.base_url = normalize_url(base_url)

    def url(self, *, port: int | None = None) -> str:
        url = make_url(self.base_url)
        if port is not None:
            url = url.set(port=port)
        rendered = url.render_as_string(hide_password=False)
        separator = "&" if "?" in rendered else "?"
        return f"{rendered}{separator}options={quote(f'-csearch_path={self.name}')}"

    def _libpq(self) -> str:
        return (
            make_url(self.base_url)
            .set(drivername="postgresql")
            .render_as_string(hide_password=False)
        )

    def create(self) -> None:
        try:
            with psycopg.connect(self._libpq(), autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'CREATE SCHEMA "{self.name}"')
        except psycopg.OperationalError as exc:
            pytest.fail(
                f"PostgreSQL at {self.base_url} is not reachable ({exc}); start it with "
                "`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` "
                "or set ISOGATE_TEST_POSTGRES_URL"
            )

    def drop(self) -> None:
        with psycopg.connect(self._libpq(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE')


@pytest.fixture
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: an SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'isogate.db'}"
        return
    schema = PostgresSchema()
    schema.create()
    try:
        yield schema.url()
    finally:
        schema.drop()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Every test that touches a database runs against both.
    if "database_url" in metafunc.fixturenames:
        metafunc.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    store = create_store(database_url, migrate=True)
    try:
        yield store
    finally:
        store.dispose()


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return Settings(
        database_url=database_url,
        admin_key=ADMIN_KEY,
        audit_spool_dir=tmp_path / "audit-spool",
        audit_flush_interval_s=0.05,
        audit_batch_size=100,
        auth_cache_ttl_s=5.0,
        _env_file=None,
    )


def tenancy_app(components: object) -> Starlette:
    """The admin and audit routes with the gateway's error rendering, over given components."""

    async def render(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    app = Starlette(
        routes=[*admin_routes(), *audit_routes()], exception_handlers={APIError: render}
    )
    app.state.components = components
    return app


@pytest.fixture
async def api(store: Store, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    authenticator = Authenticator(store, settings)
    components = types.SimpleNamespace(
        settings=settings,
        store=store,
        authenticator=authenticator,
        # One replica, no Redis: a revocation is forgotten here and published nowhere.
        revocations=Revocations(authenticator, None, "test", Metrics().auth_invalidations),
        audit=None,
        limiter=None,
        policies=None,
    )
    transport = httpx.ASGITransport(app=tenancy_app(components))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        client.components = components  # type: ignore[attr-defined]  # tests reach the parts here
        yield client


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_KEY}"}


def key_headers(raw_key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {raw_key}"}


@pytest.fixture(params=["memory", "redis"])
def new_limiter(
    request: pytest.FixtureRequest, redis_client: Any, redis_prefix: str
) -> Callable[[], TenantLimiter]:
    """Makes limiters that share state the way gateway replicas do (Redis), or the one (memory)."""
    if request.param == "memory":
        limiter = TenantLimiter(None)
        return lambda: limiter
    return lambda: TenantLimiter(redis_client, key_prefix=redis_prefix)
