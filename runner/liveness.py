"""Is a run's runner alive? A fact that dies with the runner process, not the last phase written.

A runner holds, for its run's whole life, a **session-level advisory lock** keyed by the run on a
dedicated Postgres connection (never a pooled one: a pooled connection could be handed to other
work, and a lock on it would outlive the run). The lock dies with that connection: a SIGKILLed
or OOM-killed process, a deleted pod, a closed laptop lid all close the socket, Postgres ends the
session and frees the lock at once, so a replacement takes over without waiting.

Next to the lock the runner keeps a **heartbeat row** (``agentfast_runners``: runner id, pid,
host, its backend pid, last beat, every ``HEARTBEAT_S``) so a human can be told who holds the run
and how recently it was heard from. The row alone proves nothing (a killed runner leaves it
behind); the lock alone cannot name the holder.

The one case the lock cannot see at once is a **half-open connection**: the runner's node
vanished (power, network partition) without closing the TCP connection. Postgres then keeps the
session, and the lock, until TCP keepalives declare the peer dead; the runner's connection asks
for server-side keepalives of ``10 s idle + 3 x 5 s`` (about 25 s), and the client side uses the
same values. A frozen process (SIGSTOP, a stuck VM) keeps its socket open but stops beating: a
holder whose heartbeat is older than ``STALE_AFTER_S`` (30 s) counts as gone, and the taker ends
its session (``pg_terminate_backend``, allowed for the same role) before taking the lock. So a
lost runner is taken over after at most about 30 s, a dead one at once. The fencing epoch (G6)
stays the safety net: the lock is about not stealing a run, the epoch about a zombie never
committing after it lost it.

**Waiting for a holder that is leaving.** A claim that finds the lock held looks again for a
while (``wait_s``) before it calls the holder alive and gives up (:class:`RunnerAlive`, exit 76):
one second by default (a killed holder's socket closing), longer for a runner pod
(``AGENTFAST_WAIT_FOR_HOLDER_SECONDS``, set by the operator): the operator starts it as soon as
its predecessor's pod is being deleted, when that runner has just got SIGTERM and lets go
within a second or so, or at the end of a tool call in flight, or never answers again (its node
is gone: a half-open session, freed by keepalives, or its heartbeat goes stale, then taken
over). While it waits it takes nothing: no lock, no epoch; a holder that goes stale meanwhile
is taken over as above.

Needs a session-mode connection to Postgres (direct, or a pooler in session mode): with a
transaction-mode pooler (PgBouncer ``pool_mode=transaction``) session locks do not work.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from psycopg.rows import DictRow, dict_row

from .names import TERMINAL_PHASES, WAITING_PHASES
from .store import PROGRESS_CHANNEL, Store, StoreError, StoreUnavailable, pin_search_path

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
STALE_AFTER_S = 30.0
#: How long a claim looks again at a held lock before calling its holder alive, by default (s).
EXIT_GRACE_S = 1.0
#: How often a waiting claim asks whether the holder went stale (s).
STALE_CHECK_S = 0.5
# libpq (client side) and server-side TCP keepalives: a half-open connection is declared dead
# after about KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S seconds.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


class ClaimStopped(StoreError):
    """The claim was told to stop (SIGTERM) while it waited for a holder to let go; it took nothing."""


class RunnerAlive(StoreError):
    """A live runner owns the run; taking it over would run its work twice. ``holder`` says who."""

    def __init__(self, run_id: str, holder: RunnerInfo):
        self.run_id, self.holder = run_id, holder
        super().__init__(
            f"a live runner owns run {run_id}: {holder.describe()}. "
            "Not taking it over (it would run the same work twice); wait for it to finish or pause, "
            "or stop it, or use --force to take the run over anyway"
        )


@dataclass(frozen=True)
class RunnerInfo:
    """What the store knows about a run's runner.

    ``alive``: it holds the run's lock and its heartbeat is fresh (a resume would be refused).
    ``state``: ``alive``; ``stale`` (lock held, no heartbeat for ``STALE_AFTER_S``: frozen or unreachable, a resume
    takes over); ``none`` (no runner). ``heartbeat_age_s``: seconds since the last beat, by the
    Postgres server's clock (None without a heartbeat row). ``runner_id``, ``pid``, ``host``:
    the holder's (or, when none is alive, the last runner's) identity.
    """

    alive: bool
    state: str
    heartbeat_age_s: float | None = None
    runner_id: str | None = None
    pid: int | None = None
    host: str | None = None
    backend_pid: int | None = None

    def describe(self) -> str:
        """One phrase naming the holder and its heartbeat age."""
        who = f"runner {self.runner_id}" if self.runner_id else "a runner"
        if self.pid is not None:
            who += f" (pid {self.pid} on host {self.host})"
        if self.heartbeat_age_s is None:
            return f"{who}, starting (no heartbeat yet)"
        return f"{who}, last heartbeat {self.heartbeat_age_s:.1f} s ago"

    def to_json(self) -> dict[str, Any]:
        """The ``runner`` object of ``agentfast status -o json``."""
        d = asdict(self)
        if d["heartbeat_age_s"] is not None:
            d["heartbeat_age_s"] = round(d["heartbeat_age_s"], 1)
        return d


def new_lock_key() -> int:
    """A fresh advisory-lock key for one claim: a random signed 64-bit integer.

    Not a hash of the run's name: every session may take any advisory lock, so a key another
    tenant can compute (or saw in ``pg_locks`` while its holder lived) could be squatted. A claim
    writes its key in the run's heartbeat row (``agentfast_runners.lock_key``: only the run's
    namespace and the owner read it), and a lock counts only when held by the session that row
    names (``backend_pid``): whoever holds a key of a dead claim holds nothing (issue 30)."""
    return int.from_bytes(secrets.token_bytes(8), "big", signed=True)


# The run's heartbeat row and, when the session the row names holds the row's key, that lock.
_HOLDER_JOIN = """LEFT JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.pid = r.backend_pid
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
     AND l.classid::bigint = (r.lock_key >> 32) & 4294967295 AND l.objid::bigint = r.lock_key & 4294967295"""
_STATE_SQL = (
    """SELECT l.pid AS lock_pid, r.runner_id, r.pid, r.host, r.backend_pid, r.lock_key,
       extract(epoch FROM clock_timestamp() - r.beat_at)::float8 AS age
FROM agentfast_runners r """
    + _HOLDER_JOIN
    + """
WHERE r.run_id = %(run_id)s"""
)


def _one_bool(row: dict[str, Any] | None) -> bool:
    assert row is not None  # a SELECT without FROM returns its row
    return bool(row["ok"])


def runs_held(store: Store, run_ids: Sequence[str]) -> set[str]:
    """Which of ``run_ids`` have their runner lock held now (a runner alive, or frozen: see
    :func:`runner_state` for the story), in one query for all of them. Raises StoreUnavailable."""
    rows = store._retry(
        lambda c: c.execute(
            "SELECT r.run_id FROM agentfast_runners r " + _HOLDER_JOIN + " WHERE r.run_id = ANY(%s) AND l.pid IS NOT NULL",
            (list(run_ids),),
        ).fetchall()
    )
    return {r["run_id"] for r in rows}


def _info(row: dict[str, Any] | None, stale_after_s: float) -> RunnerInfo:
    if row is None:
        return RunnerInfo(alive=False, state="none")
    ident = {"runner_id": row["runner_id"], "pid": row["pid"], "host": row["host"], "backend_pid": row["backend_pid"]}
    if row["lock_pid"] is None:  # the session the row names holds no lock: no runner, whatever the row says
        return RunnerInfo(alive=False, state="none", heartbeat_age_s=row["age"], **ident)
    if row["age"] is not None and row["age"] > stale_after_s:
        return RunnerInfo(alive=False, state="stale", heartbeat_age_s=row["age"], **ident)
    return RunnerInfo(alive=True, state="alive", heartbeat_age_s=row["age"], **ident)


def runner_state(store: Store, run_id: str, *, stale_after_s: float = STALE_AFTER_S) -> RunnerInfo:
    """Whether ``run_id`` has a live runner now, and who it is (one query; no lock is taken)."""
    row = store._retry(lambda c: c.execute(_STATE_SQL, {"run_id": run_id}).fetchone())
    return _info(row, stale_after_s)


class RunnerClaim:
    """The right to run a run, held by one process: the lock, its connection and the heartbeat.

    Use :meth:`acquire`; call :meth:`release` when the run's process is done with the run (a
    killed process needs no release: its connection closing frees the lock).
    """

    def __init__(self, store: Store, run_id: str, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.store, self.run_id = store, run_id
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.runner_id = uuid.uuid4().hex[:12]
        self.key = new_lock_key()
        self._conn: psycopg.Connection[DictRow] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.locked = False
        # (runner id, last heartbeat in s since the Unix epoch) of the runner whose heartbeat row
        # this claim found and replaced: one that died (or was taken over) without releasing the run.
        self.left_behind: tuple[str, float] | None = None

    # -- connection -----------------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[DictRow]:
        conn = psycopg.connect(
            self.store.dsn,
            autocommit=True,
            row_factory=dict_row,
            connect_timeout=5,
            keepalives=1,
            keepalives_idle=KEEPALIVE_IDLE_S,
            keepalives_interval=KEEPALIVE_INTERVAL_S,
            keepalives_count=KEEPALIVE_COUNT,
            application_name="agentfast runner",
        )
        # Server side: the backend notices a vanished client (half-open TCP) as quickly; these
        # settings are ignored on a Unix socket, where a dead process always closes the socket.
        conn.execute(
            "SELECT set_config('tcp_keepalives_idle', %s, false), set_config('tcp_keepalives_interval', %s, false),"
            " set_config('tcp_keepalives_count', %s, false)",
            (str(KEEPALIVE_IDLE_S), str(KEEPALIVE_INTERVAL_S), str(KEEPALIVE_COUNT)),
        )
        pin_search_path(conn)  # the heartbeat table is the store's, never one in the role's own schema
        return conn

    def _connect_retrying(self) -> psycopg.Connection[DictRow]:
        deadline = time.monotonic() + self.store.retry_for_s
        delay = 0.1
        while True:
            try:
                return self._connect()
            except psycopg.OperationalError as err:
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailable(f"Postgres unavailable for {self.store.retry_for_s:.0f}s: {err}") from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _try_lock(self, take_from: str | None = None, *, rejoin: bool = False) -> RunnerInfo | None:
        """One transaction on the run's heartbeat row (locked FOR UPDATE: claims take turns on
        it, and row-level security keeps every other namespace off it). When the row names a
        holder whose session holds its key, and that holder is not ``take_from`` (a runner id
        being taken over), returns it and changes nothing. Otherwise takes a fresh key, writes
        this claim's identity and key into the row and returns None: the run is ours.
        ``rejoin``: this claim held the run and lost its session; unless the row still names it
        (another runner took the run over, or released it after, or the run is gone) it claims
        nothing and returns the row's holder."""
        assert self._conn is not None
        with self._conn.transaction():
            while True:
                row = self._conn.execute(_STATE_SQL + " FOR UPDATE OF r", {"run_id": self.run_id}).fetchone()
                holder = _info(row, self.stale_after_s)
                if (holder.state != "none" and holder.runner_id != take_from) or (
                    rejoin and (row is None or row["runner_id"] != self.runner_id)
                ):
                    return holder
                key = new_lock_key()
                while not _one_bool(self._conn.execute("SELECT pg_try_advisory_lock(%s) AS ok", (key,)).fetchone()):
                    key = new_lock_key()  # a random key someone holds: take another
                ident = (self.runner_id, os.getpid(), socket.gethostname()[:255], key)
                if row is None:
                    inserted = self._conn.execute(
                        """INSERT INTO agentfast_runners (run_id, runner_id, pid, host, lock_key, backend_pid, started_at, beat_at)
                           VALUES (%s, %s, %s, %s, %s, pg_backend_pid(), now(), now()) ON CONFLICT (run_id) DO NOTHING""",
                        (self.run_id, *ident),
                    ).rowcount
                    if not inserted:  # another claim wrote the row meanwhile: look at it
                        self._conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
                        continue
                else:
                    self._conn.execute(
                        """UPDATE agentfast_runners SET runner_id = %s, pid = %s, host = %s, lock_key = %s,
                               backend_pid = pg_backend_pid(), started_at = now(), beat_at = now() WHERE run_id = %s""",
                        (*ident, self.run_id),
                    )
                    if row["runner_id"] != self.runner_id and row["lock_key"] is not None:  # one that never released the run
                        self.left_behind = (row["runner_id"], time.time() - float(row["age"] or 0.0))
                self.key, self.locked = key, True
                break
        self._conn.execute(
            "SELECT agentfast_notify(%s, %s)", (PROGRESS_CHANNEL, self.run_id)
        )  # the operator republishes liveness
        return None

    def _state(self) -> RunnerInfo:
        assert self._conn is not None
        row = self._conn.execute(_STATE_SQL, {"run_id": self.run_id}).fetchone()
        return _info(row, self.stale_after_s)

    # -- acquire / release ----------------------------------------------------------------------

    @classmethod
    def acquire(
        cls,
        store: Store,
        run_id: str,
        *,
        force: bool = False,
        wait_s: float = EXIT_GRACE_S,
        stop: threading.Event | None = None,
        **kw: Any,
    ) -> RunnerClaim:
        """Take the run's lock and start heartbeating; returns the claim.

        A held lock is looked at again for ``wait_s`` seconds (a holder that was killed, or got
        SIGTERM, lets go meanwhile). A holder still alive then (lock held, heartbeat fresh) makes
        this raise :class:`RunnerAlive` unless ``force``. A stale holder (or any holder, with
        ``force``) has its session ended (when this role may) and the run is taken over with a
        fresh key: the row names this claim, the old holder stops beating when it sees that, and
        the fencing epoch keeps it from committing.
        ``stop`` set while waiting raises :class:`ClaimStopped`. Raises StoreUnavailable.
        """
        claim = cls(store, run_id, **kw)
        deadline = time.monotonic() + store.retry_for_s
        delay = 0.1
        while True:
            claim._conn = claim._connect_retrying()
            try:
                claim._claim(force, wait_s, stop)
                break
            except psycopg.Error as err:
                claim._conn.close()
                sqlstate = getattr(err, "sqlstate", None)
                if sqlstate == "42501":
                    raise StoreUnavailable(
                        f"Postgres refused the runner a privilege (nothing is lost; fix the grant, then resume): {err}"
                    ) from None
                if not (isinstance(err, psycopg.OperationalError) or sqlstate in ("25006", "25P03")):
                    raise
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailable(f"Postgres unavailable for {store.retry_for_s:.0f}s: {err}") from None
            except BaseException:
                claim._conn.close()
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        claim._thread = threading.Thread(target=claim._beat, name=f"agentfast-heartbeat {run_id}", daemon=True)
        claim._thread.start()
        return claim

    def _wait_for_holder(self, wait_s: float, stop: threading.Event | None) -> RunnerInfo | None:
        """Try to claim until the run is ours or ``wait_s`` has passed; returns None once claimed,
        else the holder as last seen. Stops early, holder returned, when the holder's heartbeat
        went stale (the caller takes it over). Raises ClaimStopped when ``stop`` is set."""
        start = time.monotonic()
        until = start + wait_s
        while True:
            holder = self._try_lock()
            if holder is None:
                return None
            now = time.monotonic()
            # After the first second a holder gone stale is taken over now, not at the end.
            if now >= until or (holder.state == "stale" and now - start >= min(EXIT_GRACE_S, wait_s)):
                return holder
            # Every 50 ms at first (a killed holder's socket closes within milliseconds), then every 200 ms.
            pause = 0.05 if now - start < EXIT_GRACE_S else 0.2
            if stop is not None:
                if stop.wait(pause):
                    raise ClaimStopped(f"run {self.run_id}: stopped while waiting for its runner to let go; nothing was taken")
            else:
                time.sleep(pause)

    def _claim(self, force: bool, wait_s: float = EXIT_GRACE_S, stop: threading.Event | None = None) -> None:
        holder = self._wait_for_holder(wait_s, stop)
        while holder is not None:
            if holder.alive and not force:
                raise RunnerAlive(self.run_id, holder)
            why = "--force" if holder.alive else f"its heartbeat is stale ({holder.describe()})"
            log.warning("taking run %s over from %s: %s", self.run_id, holder.describe(), why)
            if holder.backend_pid is not None:
                try:
                    assert self._conn is not None
                    self._conn.execute("SELECT pg_terminate_backend(%s)", (holder.backend_pid,))
                except psycopg.Error as err:  # not permitted: the epoch still fences the old holder
                    log.warning("could not end the old runner's session (backend %s): %s", holder.backend_pid, err)
            # The row then names this claim: the old holder stops beating when it sees so. Another
            # holder that came meanwhile is looked at afresh.
            holder = self._try_lock(take_from=holder.runner_id)

    def _beat(self) -> None:
        """Heartbeat thread: beat every ``heartbeat_s``; on a lost connection, reconnect and claim
        again with a fresh key (the row must name the session that holds its key)."""
        while not self._stop.wait(self.heartbeat_s):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                    self.locked = False
                if not self.locked:
                    if self._try_lock(take_from=self.runner_id, rejoin=True) is not None:
                        log.warning("run %s: another runner took the run over; this one stops beating", self.run_id)
                        return
                    continue
                cur = self._conn.execute(
                    "UPDATE agentfast_runners SET beat_at = now() WHERE run_id = %s AND runner_id = %s",
                    (self.run_id, self.runner_id),
                )
                if cur.rowcount == 0:  # another runner took the run over (--force) or it was deleted
                    log.warning("run %s: another runner took the heartbeat over; this one stops beating", self.run_id)
                    return
            except psycopg.Error as err:
                log.warning("run %s: heartbeat failed (%s); reconnecting", self.run_id, err)
                try:
                    if self._conn is not None:
                        self._conn.close()
                except Exception:
                    pass
                self._conn = None

    def release(self) -> None:
        """Stop beating, clear the heartbeat row's key, free the lock and close the connection. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        conn, self._conn = self._conn, None
        if conn is None or conn.closed:
            return
        try:
            # The row stays, naming the last runner, with no key: nobody holds the run.
            conn.execute(
                "UPDATE agentfast_runners SET lock_key = NULL WHERE run_id = %s AND runner_id = %s", (self.run_id, self.runner_id)
            )
            conn.execute("SELECT pg_advisory_unlock_all(), agentfast_notify(%s, %s)", (PROGRESS_CHANNEL, self.run_id))
        except psycopg.Error as err:
            log.warning("run %s: could not clear the heartbeat row: %s", self.run_id, err)
        finally:
            conn.close()  # ends the session: the lock goes with it


def batch_waits(call_ids: Sequence[str], decided: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(awaiting, decided)`` for :func:`runner_story` from a paused batch.

    ``call_ids``: every call the batch awaits a decision on (model order); ``decided``: call id
    -> decision already recorded. While any call is undecided, ``awaiting`` names those (comma
    separated) and ``decided`` is None; once all are decided, ``awaiting`` names them all and
    ``decided`` the decisions made (e.g. ``"approve, deny"``).
    """
    undecided = [c for c in call_ids if c not in decided]
    if undecided:
        return ", ".join(undecided), None
    if not call_ids:
        return None, None
    return ", ".join(call_ids), ", ".join(sorted({decided[c] for c in call_ids}))


def runner_story(info: RunnerInfo, phase: str, awaiting: str | None, decided: str | None) -> tuple[str, str]:
    """What a reader of the run's status should be told about its runner: ``(state, sentence)``.

    ``phase``: the latest checkpoint's phase; ``awaiting``: the call id it waits on (if any);
    ``decided``: the decision already recorded for that call (``approve``/``deny``), if any.
    ``state`` is one of ``alive``, ``ended`` (the run finished; no runner needed),
    ``waiting_for_decision`` (paused with no runner: normal for a ``--no-wait`` run or one
    released while waiting), ``decided_resume_needed`` (paused, decided, nobody to continue it) or
    ``interrupted`` (unfinished and no live runner: it stopped or was killed; ``stale`` holders
    included). The sentence never says what to type: CLI and operator add their own next step.
    """
    if info.alive:
        extra = f"; it waits for a decision on {awaiting}" if phase in WAITING_PHASES and awaiting and not decided else ""
        return "alive", f"alive: {info.describe()}{extra}"
    if phase in TERMINAL_PHASES:
        return "ended", "none (the run has ended)"
    if phase in WAITING_PHASES and awaiting:
        if decided:
            return (
                "decided_resume_needed",
                f"no runner: the decision on {awaiting} ({decided}) is recorded and nothing is running to act on it",
            )
        return "waiting_for_decision", f"no runner: waiting for a decision on {awaiting} (normal for a paused run)"
    if info.state == "stale":
        return "interrupted", f"no live runner: interrupted; {info.describe()} (frozen or unreachable; a resume takes it over)"
    return "interrupted", "no runner: interrupted (its process stopped or was killed before the run finished)"
