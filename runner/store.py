"""The Postgres store: checkpoints, the tool-call journal, approvals and the fencing lease.

Shapes: runs are keyed by ``run_id`` (``"namespace/name"``); writes that belong to a runner take a
:class:`Lease` (run id, run uid + fencing epoch) and are rejected by Postgres with :class:`LeaseLost` once
another runner has taken the run over (G6). Every public write is one transaction.

Failure handling: a lost connection (Postgres restarting, a network blip), a server that is
read-only for now (a failover) or out of disk, memory or connections is retried with
exponential backoff for up to ``retry_for_s`` seconds; every retried write is idempotent (the
checkpoint carries a client-chosen key; journal updates are absolute). After that the store raises
:class:`StoreUnavailable`, which the runner turns into a "retry me" exit.

Content: every ``str`` and ``jsonb`` parameter of the store's connections passes through
:func:`agentfast.runner.storable.storable` (NUL and lone surrogates become U+FFFD), so no write
fails on what a model, a tool or a user wrote. The write methods whose values the runner keeps
using (:meth:`Store.save_turn`, :meth:`Store.record_result`, :meth:`Store.commit_checkpoint`)
hand back the stored form, so memory and a later resume agree.

Notifications (LISTEN/NOTIFY): ``agentfast_progress`` after every checkpoint, ``agentfast_approval``
after every decision and cancel request; the payload is the run's ``notify_token``, never its id
(:meth:`Store.notify_token`, :meth:`Store.runs_for_tokens`): any session may LISTEN. A notification is only a wake-up:
listeners always re-read the tables, since one sent while a listener was disconnected is lost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, LiteralString, TypeVar, get_args, overload

import psycopg
import pydantic
import pydantic_core
from psycopg import sql
from psycopg.rows import DictRow, dict_row, tuple_row
from psycopg.types.json import Jsonb, set_json_dumps
from psycopg.types.string import StrBinaryDumper, StrDumperUnknown
from psycopg_pool import ConnectionPool
from pydantic import BaseModel

from . import names, payloads
from .arguments import arguments_digest as digest_of_arguments

# InvalidDecision: raised by Store.decide (not from .spec, whose models status, history and list
# never need); deadline_message: the loop and the operator import it from here.
from .decisions import (  # noqa: F401
    REPLY,
    DecisionsClosed,
    InvalidDecision,
    check_decision,
    check_decision_fits,
    decisions_closed,
)
from .decisions import (
    deadline_message as deadline_message,
)
from .errors import AgentfastError, UnknownRun
from .migrations import MIGRATIONS
from .names import TERMINAL_PHASES
from .payloads import Limits, PayloadTooLarge
from .snapshot import (
    SCHEMA_VERSION,
    AwaitedCall,
    Message,
    PendingToolCall,
    Phase,
    Prices,
    RunContext,
    RunStatus,
    Session,
    StateSnapshot,
    ToolCall,
    ToolResult,
    now_ms,
)
from .storable import SURROGATE, storable, storable_text

PROGRESS_CHANNEL = "agentfast_progress"
APPROVAL_CHANNEL = "agentfast_approval"
FENCE_SQLSTATE = "AF001"
_MIGRATION_LOCK = 0x61_66_5F_6D_69_67  # "af_mig": the advisory-lock key of schema migrations
# Joined to agentfast_runs r: c is each run's latest checkpoint (all NULL for a run without one).
_LATEST_CHECKPOINT = """LEFT JOIN LATERAL (SELECT * FROM agentfast_checkpoints c WHERE c.run_id = r.run_id
                                  ORDER BY checkpoint_id DESC LIMIT 1) c ON true"""
# The owner's serializations lock a row of agentfast_locks (migration 16), on which runner roles
# have no right: an advisory lock's key space is every session's, so a tenant could squat one.
_TENANT_LOCK: LiteralString = (
    "SELECT 1 FROM agentfast_locks WHERE name = 'tenants' FOR UPDATE"  # creating or re-keying a namespace's runner role
)
_UID_LOCK: LiteralString = "SELECT 1 FROM agentfast_locks WHERE name = 'run_uid' FOR UPDATE"  # registering a run under a uid

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

log = logging.getLogger(__name__)


class StoreError(AgentfastError):
    """Base class of the store's errors."""


class StoreUnavailable(StoreError):
    """Postgres could not take the store's work: unreachable, read-only or out of resources for
    the whole retry window, or refusing the store's role a privilege. Retriable: state is intact."""


class InvalidDsn(StoreError, ValueError):
    """A DSN that libpq cannot parse, or whose host or port cannot be one (e.g. a password's
    unencoded ``@`` or ``/`` pushed into them). Raised by :func:`parse_dsn` before any pool or
    connection is made. Not retriable. The message quotes none of the DSN's text (it may hold a
    password) and says which forms are expected; no libpq error is chained to it."""


class LeaseLost(StoreError):
    """Another runner took this run over (its epoch is newer). Stop without further effects."""


class DecisionConflict(StoreError):
    """The call was already decided; decisions are write-once.

    ``existing``: the recorded Decision. ``same``: it is the very decision asked for again (same
    decision, reason and result), as a level-based replay of ``spec.approvals`` does.
    """

    def __init__(self, message: str, existing: Decision, same: bool):
        super().__init__(message)
        self.existing = existing
        self.same = same


class UidTaken(StoreError):
    """A new run was given the uid of another run (``Store.create_run``). Nothing was written."""


class SchemaBehind(StoreUnavailable):
    """The store's schema is older than this release and this role may not migrate it (a
    runner's role: runners never change the schema). The message says what to do."""


class UnknownCall(StoreError):
    """No call with this id awaits a decision in this run now (not gated, finished, not yet
    asked, not an in-flight re-run, or no such run). The message says which, and what awaits."""


class DecisionUnusable(UnknownCall):
    """The run can use no decision any more, whatever the call: it has ended, a cancel was asked
    for, or it is past ``spec.activeDeadlineSeconds`` (:func:`.decisions.decisions_closed`).
    ``closed`` says which and why; the message names the call, the run and that reason. An
    UnknownCall, so every caller that refuses one refuses this one too."""

    def __init__(self, message: str, closed: DecisionsClosed):
        super().__init__(message)
        self.closed = closed


class ForkRefused(StoreError):
    """:meth:`Store.fork_run` cannot fork the source at that iteration: the source does not exist,
    has no such iteration, its checkpoints of it were pruned, or no kept checkpoint of it is a
    finished iteration boundary (waiting for a decision, ended, or a call still unfinished). The
    message says which, in one line."""


class RunExists(StoreError):
    """:meth:`Store.fork_run` was asked to make a run whose id is taken."""


class UnreadableState(StoreError):
    """A stored row this release cannot interpret: written by a newer release (its schema version
    is above :data:`~agentfast.runner.snapshot.SCHEMA_VERSION`), or corrupt (it does not decode).

    Never retried and never half-read: every reader stops (the CLI exits 2). ``run_id``;
    ``table`` and ``row`` name the row (e.g. ``agentfast_checkpoints``, ``checkpoint 17
    (iteration 1)``); ``found_version`` / ``supported_version`` are the schema versions (the
    found one None when unknown); ``detail`` says what is wrong. ``str()`` is one line.
    """

    def __init__(self, run_id: str, table: str, row: str, detail: str, *, found_version: int | None = None):
        self.run_id, self.table, self.row, self.detail = run_id, table, row, detail
        self.found_version, self.supported_version = found_version, SCHEMA_VERSION
        versions = (
            f"schema_version {found_version}; this release reads up to {SCHEMA_VERSION}"
            if found_version is not None
            else f"this release reads schema_version up to {SCHEMA_VERSION}"
        )
        super().__init__(" ".join(f"cannot read run {run_id}: {table} {row}: {detail} ({versions}). Nothing was run.".split()))


def _validation_detail(err: Exception) -> str:
    """One short line for a decoding error (the first pydantic error, or the exception's text)."""
    if isinstance(err, pydantic.ValidationError) and err.errors():
        e = err.errors()[0]
        where = ".".join(str(p) for p in e.get("loc", ())) or "row"
        text = f"{where}: {e.get('msg', 'invalid')}"
    else:
        text = f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:300]


def decode_row(run_id: str, table: str, row: str, model: type[T], data: Any) -> T:
    """``model.model_validate(data)``, a decoding failure raised as UnreadableState naming the row."""
    try:
        return model.model_validate(data)  # type: ignore[attr-defined, no-any-return]
    except (pydantic.ValidationError, ValueError, TypeError, KeyError) as err:
        raise UnreadableState(run_id, table, row, f"corrupt row ({_validation_detail(err)})") from None


def decode_snapshot(run_id: str, cp: dict[str, Any], messages: list[Any]) -> StateSnapshot:
    """A checkpoint row (``schema_version``, ``context``, ``pending``, ``sdk_state``,
    ``saved_at``, ``checkpoint_id``, ``iteration``) plus its transcript rows as a StateSnapshot.

    The one place stored snapshots are decoded: an older version is upgraded
    (``snapshot.upgrade_snapshot_dict``); a newer version, or a row that does not decode, raises
    UnreadableState naming the run, the row and the versions.
    """
    where = f"checkpoint {cp.get('checkpoint_id')} (iteration {cp.get('iteration')})"
    version = cp.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION or version < 0:
        raise UnreadableState(
            run_id, "agentfast_checkpoints", where, "written by a newer or unknown release", found_version=version
        )
    try:
        return StateSnapshot.model_validate(
            {
                "schema_version": version,
                "run_id": run_id,
                "context": cp["context"],
                "messages": messages,
                "sdk_state": cp.get("sdk_state") if cp.get("sdk_state") is not None else {},
                "pending": cp.get("pending"),
                "saved_at": cp["saved_at"],
            }
        )
    except (pydantic.ValidationError, ValueError, TypeError, KeyError) as err:
        loc = err.errors()[0].get("loc", ()) if isinstance(err, pydantic.ValidationError) and err.errors() else ()
        if len(loc) >= 2 and loc[0] == "messages" and isinstance(loc[1], int):
            raise UnreadableState(
                run_id, "agentfast_messages", f"seq {loc[1]}", f"corrupt row ({_validation_detail(err)})", found_version=version
            ) from None
        raise UnreadableState(
            run_id, "agentfast_checkpoints", where, f"corrupt row ({_validation_detail(err)})", found_version=version
        ) from None


@dataclass(frozen=True)
class Lease:
    """The right to write a run's state, valid while ``epoch`` is the current epoch of the run
    ``run_id`` and that run is still the one of uid ``run_uid`` (not deleted or archived and
    re-created under the same id, whose epochs start again from 0). Both are checked by Postgres
    (the ``agentfast_fence`` trigger) on every write; built by :meth:`Store.acquire_lease`."""

    run_id: str
    epoch: int
    run_uid: str


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    run_uid: str
    spec: dict[str, Any]
    epoch: int


@dataclass(frozen=True)
class Turn:
    """The model's reply of one iteration and the tokens it cost."""

    iteration: int
    message: Message
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class LostReplies:
    """Model replies the endpoint answered (and billed) whose turn was never saved: a crash lost
    them after they arrived (``Store.record_reply`` kept their usage). ``count`` replies,
    ``prompt_tokens`` and ``completion_tokens`` in all (counts of tokens)."""

    count: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class JournalEntry:
    """One row of the tool-call journal. ``state``: planned -> started -> done."""

    iteration: int
    position: int
    call_id: str
    idempotency_key: str
    tool_call: ToolCall
    gated: bool
    idempotent: bool
    state: Literal["planned", "started", "done"]
    attempts: int
    result: ToolResult | None


@dataclass(frozen=True)
class Decision:
    """A human's decision on one awaited call: approve (run it), deny (the model reads
    ``reason``), complete (its effect already happened; the model reads ``result``), or reply
    (the user's answer to the model's ``ask_user`` question, in ``result``)."""

    call_id: str
    decision: Literal["approve", "deny", "complete", "reply", "end"]
    reason: str | None
    decided_by: str
    result: str | None = None
    #: The digest (runner/arguments.py) of the call's arguments as its decider saw them (G13):
    #: an approved call runs only with arguments of this digest. None: decided before migration 17.
    arguments_digest: str | None = None


@dataclass(frozen=True)
class CancelRequest:
    """A request to cancel a run (``agentfast_cancel_requests``): ``requested_by`` (``cli:USER``,
    or ``kubernetes:...`` for ``spec.cancel``) and ``requested_at`` (timezone-aware, the
    database's clock). At most one per run: the first one stands."""

    requested_by: str
    requested_at: datetime


@dataclass(frozen=True)
class EndRequests:
    """What may end a run besides its own work, read by a runner at each safe point
    (:meth:`Store.end_requests`): its cancel request, if any, and its age in seconds since it was
    registered (``agentfast_runs.created_at``, by the database's clock), for
    ``spec.activeDeadlineSeconds``."""

    cancel: CancelRequest | None
    age_s: float


def cancelled_message(request: CancelRequest) -> str:
    """The ending message of a run cancelled by ``request``: who asked and when (UTC)."""
    when = request.requested_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"cancelled by {request.requested_by} at {when}; no new tool call was started, everything done is kept"


@dataclass(frozen=True)
class SdkRow:
    """One row of a graph-native SDK's state (``agentfast_sdk_blobs``), opaque to the store (G8).

    ``key``: the adapter's own name for it, unique within the run (text, any length Postgres
    takes); ``type``: the SDK serializer's tag for ``value`` (e.g. LangGraph's ``"msgpack"``);
    ``value``: the serialized bytes. Written once with the checkpoint that first names it, never
    updated: a second write of the same key is ignored (a retried commit)."""

    key: str
    type: str
    value: bytes


@dataclass(frozen=True)
class CheckpointInfo:
    checkpoint_id: int
    iteration: int
    message_count: int
    phase: str
    saved_at: int
    epoch: int
    schema_version: int = SCHEMA_VERSION

    @property
    def readable(self) -> bool:
        """Whether this release can read the checkpoint: its schema is not newer and its phase is
        one this release knows (a phase it does not know means another release wrote the row)."""
        return 0 <= self.schema_version <= SCHEMA_VERSION and self.phase in get_args(Phase)


# Errors after which the same work can succeed on a new connection, though psycopg does not class
# them as OperationalError: read_only_sql_transaction (the server is, for now, not a primary: a
# failover in progress, a stale DNS entry or proxy; a session keeps its read-only default, so the
# connection is replaced) and idle_in_transaction_session_timeout (the session was ended under a
# stalled process). Out of disk, memory or connections (class 53) are OperationalErrors already.
_RETRY_ON_NEW_CONNECTION = frozenset({"25006", "25P03"})
# Class 54, program_limit_exceeded (a jsonb over 255 MB, a string over 1 GB, a row too large):
# psycopg classes it as OperationalError, but the same write fails the same way every time, so it
# is PayloadTooLarge (the run ends Failed), never retried into an endless "retry me" exit.
_PROGRAM_LIMIT_CLASS = "54"
# insufficient_privilege: the store's role may not do this. Nothing to retry in this process, but
# the state is intact, and a runner started once the grant is fixed continues.
_NOT_PERMITTED = "42501"


def _one(row: T | None) -> T:
    """The row of a statement that always returns one (an aggregate, a function's result, a row
    this transaction saw or wrote): None there is a broken query or schema, not a state."""
    assert row is not None, "the statement returned no row"
    return row


def _check_fork_prices(context: dict[str, Any], prices: Prices | None, source_id: str) -> None:
    """Raise ForkRefused when a fork of ``source_id`` whose copied checkpoint context is
    ``context`` (as stored) and whose own model charges ``prices`` would have a cost limit that
    cannot hold: the budget it goes on with (the source's) has ``max_cost`` and the fork's model
    has no prices (its cost could not be counted), or its prices are in another currency than the
    source's (``max_cost`` is an amount in that one). The rule a run's spec has (runner/spec.py
    ``check_cost_budget``), for the budget a fork copies rather than declares."""
    limit = (context.get("budget") or {}).get("max_cost")
    if limit is None:
        return
    if prices is None:
        raise ForkRefused(
            f"the fork's model has no prices, but the budget it goes on with ({source_id}'s) has max_cost {limit:g}:"
            " its cost could not be counted; fork onto a model with prices (its ModelConfig's spec.prices, or"
            " spec.model.prices for the scripted model)"
        )
    theirs = (context.get("prices") or {}).get("currency")
    if theirs is not None and theirs != prices.currency:
        raise ForkRefused(
            f"the fork's prices are in {prices.currency}, but the max_cost {limit:g} it goes on with ({source_id}'s budget)"
            f" is in {theirs}: fork onto a model priced in {theirs}"
        )


def _name_the_lease(conn: psycopg.Connection[DictRow], epoch: int, run_uid: str) -> None:
    """Set the transaction's lease settings, ``agentfast.epoch`` and ``agentfast.run_uid``, which
    the fence trigger (runner/migrations.py) checks on every write to the run's tables (G6). One
    statement; transaction-local, so they end with the transaction."""
    conn.execute("SELECT agentfast_name_lease(%s, %s)", (epoch, run_uid))  # the settings' one definition: migration 12


def _in_transaction(conn: psycopg.Connection[DictRow], lease: Lease | None, op: Callable[[psycopg.Connection[DictRow]], T]) -> T:
    """``op(conn)`` in one transaction on ``conn``, whose writes carry ``lease`` (None: none)."""
    with conn.transaction():
        if lease is not None:
            _name_the_lease(conn, lease.epoch, lease.run_uid)
        return op(conn)


def _is_connection_error(err: BaseException) -> bool:
    # OperationalError covers refused/reset connections, "terminating connection due to
    # administrator command" (57P01, a Postgres shutdown), "the database system is starting up"
    # (57P03), and the pool's PoolTimeout (none could be opened): all subclasses of it.
    return isinstance(err, psycopg.OperationalError)


@dataclass(frozen=True)
class RunMark:
    """What :meth:`Store.change_marks` says of one run: ``run_uid``; ``checkpoint_id``, its latest
    checkpoint (None: none yet); ``control``, what changes without a checkpoint: (fencing epoch,
    decisions recorded, decisions voided, cancel requested)."""

    run_uid: str
    checkpoint_id: int | None
    control: tuple[Any, ...]


class Store:
    """Postgres-backed durable state of agent runs.

    ``dsn``: a libpq connection string or URI. ``retention_keep``: checkpoints kept per run (the
    latest K; older ones are superseded and pruned on commit; the transcript, journal and
    approvals are never pruned). ``retry_for_s``: how long connection failures are retried.
    ``idle_in_transaction_timeout_s``: Postgres ends a session of this store that sits inside an
    open transaction that long without sending anything (its transactions never wait on the
    client, so only a frozen or partitioned process does): a zombie frozen mid-commit holds the
    run row FOR SHARE, and without this its successor's takeover would wait for it for ever.
    ``payload_limits``: strings over ``threshold_bytes`` are stored once, out of the hot rows, and
    over ``max_bytes`` refused (:mod:`.payloads`); None: from the environment
    (``AGENTFAST_PAYLOAD_THRESHOLD_BYTES``, ``AGENTFAST_PAYLOAD_MAX_BYTES``).
    Raises StoreUnavailable from the constructor when Postgres cannot be reached, ValueError for
    a malformed payload limit.
    """

    def __init__(
        self,
        dsn: str,
        *,
        retention_keep: int = 20,
        retry_for_s: float = 30.0,
        pool_max: int = 4,
        connect_timeout_s: float = 5.0,
        idle_in_transaction_timeout_s: float = 10.0,
        payload_limits: Limits | None = None,
    ) -> None:
        if retention_keep < 1:
            raise ValueError("retention_keep must be at least 1")
        self.payload_limits = payload_limits or Limits.from_env()
        # (run_id, run_uid, epoch, sha256) of payloads this store's committed transactions hold: a
        # tool's output is not sent again when its transcript message is checkpointed. Per uid and
        # epoch, so a takeover, or a run deleted or archived and made again (same id, epochs from 0
        # again), starts empty.
        self._payloads_stored: set[tuple[str, str, int, str]] = set()
        parse_dsn(dsn)  # InvalidDsn before any pool exists: psycopg.pool's warnings would quote libpq's parse error
        self.dsn = dsn
        self.retention_keep = retention_keep
        self.retry_for_s = retry_for_s
        self._pool = ConnectionPool(
            dsn,
            connection_class=psycopg.Connection[DictRow],
            min_size=1,
            max_size=pool_max,
            kwargs={"row_factory": dict_row, "connect_timeout": max(1, int(connect_timeout_s))},
            # No check on checkout (a round trip per transaction): _retry tests the pool's idle
            # connections after the first connection error instead.
            timeout=connect_timeout_s,
            open=False,
            name="agentfast",
            configure=lambda conn: _configure(conn, idle_in_transaction_timeout_s),
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except Exception as err:  # PoolTimeout: nothing could connect
            self._pool.close()
            raise StoreUnavailable(f"cannot connect to Postgres at {_redact(dsn)}: {err}") from None

    # -- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retry(self, op: Callable[[psycopg.Connection[DictRow]], T], *, lease: Lease | None = None) -> T:
        """Run ``op`` in one transaction, retrying connection failures with backoff; returns
        what ``op`` returned. ``lease``: the fencing epoch and run uid the transaction's writes
        carry (G6), set in one statement (no extra round trip).

        Not pipelined, on purpose: in psycopg's pipeline mode each statement is flushed as it is
        queued and the transaction ends at the Sync, so a client frozen between the two (a GC
        pause, SIGSTOP) leaves a backend holding the run row FOR SHARE that no
        ``idle_in_transaction_session_timeout`` ends (it applies only once the server waits after
        a Sync), and a successor's takeover waits for ever (tests/chaos/test_zombie.py). The
        runner's per-iteration writes avoid the BEGIN/COMMIT round trips another way: each is one
        statement in a transaction of its own (:meth:`_write_statement`).
        """

        return self._attempt(lambda conn: _in_transaction(conn, lease, op))

    def _attempt(self, op: Callable[[psycopg.Connection[DictRow]], T]) -> T:
        """Run ``op`` on a pooled (autocommit) connection, retrying connection failures with
        backoff for ``retry_for_s``; maps the fence's SQLSTATE to LeaseLost, and a refused
        privilege or an outage that outlasts the retries to StoreUnavailable, and a program-limit
        error (SQLSTATE class 54: a value Postgres cannot store) to PayloadTooLarge, unretried."""
        deadline = time.monotonic() + self.retry_for_s
        delay = 0.1
        attempt = 0
        checked = False
        while True:
            try:
                with self._pool.connection() as conn:
                    try:
                        return op(conn)
                    except psycopg.Error as err:
                        if getattr(err, "sqlstate", None) in _RETRY_ON_NEW_CONNECTION:
                            conn.close()  # the pool replaces a closed connection
                        raise
            except Exception as err:
                sqlstate = getattr(err, "sqlstate", None)
                if sqlstate == FENCE_SQLSTATE:
                    raise LeaseLost(str(err).strip()) from None
                if sqlstate is not None and sqlstate.startswith(_PROGRAM_LIMIT_CLASS):
                    first = (str(err).strip().splitlines() or [""])[0][:300]
                    raise PayloadTooLarge("a value of this write", None, None, f"SQLSTATE {sqlstate}: {first}") from None
                if sqlstate == _NOT_PERMITTED:
                    raise StoreUnavailable(
                        f"Postgres refused the store's role a privilege (nothing is lost; fix the grant, then resume): {err}"
                    ) from None
                if not (_is_connection_error(err) or sqlstate in _RETRY_ON_NEW_CONNECTION):
                    raise
                if not checked:
                    # Connections are not tested on checkout (that costs a round trip per
                    # transaction): the first failure tests the idle ones instead, so after a
                    # Postgres restart the retry gets a live connection, not the next dead one.
                    checked = True
                    self._pool.check()
                    continue
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailable(f"Postgres unavailable for {self.retry_for_s:.0f}s: {err}") from None
                attempt += 1
                # One INFO line per retry (AGENTFAST_LOG_LEVEL=INFO): how long a failover kept the
                # runner waiting, and how often it tried. The error's first line only: no DSN in it.
                log.info(
                    "store: Postgres unavailable (%s); retry %d in %.1fs",
                    (str(err).strip().splitlines() or [""])[0][:200],
                    attempt,
                    delay,
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    @overload
    def _read(self, query: LiteralString, params: Any, *, all: Literal[False] = False) -> DictRow | None: ...
    @overload
    def _read(self, query: LiteralString, params: Any, *, all: Literal[True]) -> list[DictRow]: ...
    def _read(self, query: LiteralString, params: Any, *, all: bool = False) -> DictRow | None | list[DictRow]:
        """One read-only query in its own transaction: its first
        row (None if none), or every row with ``all``. Retried like every store call."""

        def op(conn: psycopg.Connection[DictRow]) -> DictRow | None | list[DictRow]:
            cur = conn.execute(query, params)  # autocommit: one statement, one round trip
            return cur.fetchall() if all else cur.fetchone()

        return self._attempt(op)

    def read_together(self, queries: list[tuple[LiteralString, Any]]) -> list[list[DictRow]]:
        """Each ``(query, params)``, read-only, sent together as one pipeline on an autocommit
        connection (one round trip; no transaction is left open on the client, see :meth:`_retry`):
        every query's rows, in order. For readers that aggregate across runs (the operator's
        metrics). Raises StoreUnavailable."""

        def op(conn: psycopg.Connection[DictRow]) -> list[list[DictRow]]:
            cursors = [conn.cursor() for _ in queries]
            with conn.pipeline():
                for cur, (query, params) in zip(cursors, queries):
                    cur.execute(query, params)
            return [cur.fetchall() for cur in cursors]

        return self._attempt(op)

    # -- large payloads (runner/payloads.py) ---------------------------------------------------

    def _out_of_line(self, text: str, out: dict[str, str], what: str) -> str:
        """JSON ``text`` with its large strings replaced by references (their texts added to
        ``out``). Raises PayloadTooLarge naming ``what``."""
        return payloads.externalize_json(text, self.payload_limits, out, what=what)

    def _write_statement(
        self, lease: Lease, out: dict[str, str], query: LiteralString, params: Any, *, notify: str | None = None
    ) -> DictRow | None:
        """Run one of the schema's write functions (migration 12), ``query`` with ``params``, as
        one statement on an autocommit connection: its own transaction, one round trip, and no
        transaction left open while the client computes (a client frozen now holds no lock). The
        function names the lease itself. Payloads of ``out`` not yet stored by this lease holder
        are written first in the same transaction (BEGIN, the lease, the payloads, the statement,
        COMMIT): a row never refers to a payload that is not stored. ``notify``: a channel
        NOTIFYd with the run id once the write is committed, in a transaction of its own that
        writes nothing: Postgres serializes the commits of notifying transactions cluster-wide
        (a lock held through the WAL flush), which would cap the commit rate of all runners near
        one per flush. Returns the statement's first row (None: none). Raises like
        :meth:`_attempt`."""
        todo = {d: t for d, t in out.items() if (lease.run_id, lease.run_uid, lease.epoch, d) not in self._payloads_stored}

        def write(conn: psycopg.Connection[DictRow]) -> DictRow | None:
            if todo:
                payloads.write(conn, lease.run_id, todo)
            return conn.execute(query, params).fetchone()

        def op(conn: psycopg.Connection[DictRow]) -> DictRow | None:
            row = _in_transaction(conn, lease, write) if todo else write(conn)
            if notify is not None:
                conn.execute("SELECT agentfast_notify(%s, %s)", (notify, lease.run_id))
            return row

        return self._attempt(op)

    def _payloads_committed(self, lease: Lease, out: dict[str, str]) -> None:
        if len(self._payloads_stored) > 4096:  # a bound, not a policy: a forgotten one is only sent again
            self._payloads_stored.clear()
        self._payloads_stored.update((lease.run_id, lease.run_uid, lease.epoch, d) for d in out)

    def _resolved(
        self, run_id: str, values: list[tuple[str, str, Any]], conn: psycopg.Connection[DictRow] | None = None
    ) -> list[Any]:
        """The ``value`` of each ``(table, row, value)`` with its payload references resolved, in
        one query for all (on ``conn``, else a read of its own), none when there are no references.
        Raises UnreadableState naming the row that refers to a payload that is not stored."""
        wanted = [payloads.references(v) for _, _, v in values]
        every = set().union(*wanted) if wanted else set()
        if not every:
            return [v for _, _, v in values]
        contents = (
            payloads.fetch(conn, run_id, every) if conn is not None else self._attempt(lambda c: payloads.fetch(c, run_id, every))
        )
        out = []
        for (table, row, value), digests in zip(values, wanted):
            missing = digests - contents.keys()
            if missing:
                raise UnreadableState(run_id, table, row, f"it refers to payload sha256:{min(missing)}, which is not stored")
            out.append(payloads.resolve(value, contents) if digests else value)
        return out

    def schema_version(self) -> int:
        """The store's schema version (0: no schema yet), read without taking any lock or right
        beyond SELECT on ``agentfast_migrations``: what a runner's role may do."""

        def op(conn: psycopg.Connection[DictRow]) -> int:
            if _one(conn.execute("SELECT to_regclass('agentfast_migrations') IS NOT NULL AS ok").fetchone())["ok"] is False:
                return 0
            version: int = _one(conn.execute("SELECT coalesce(max(version), 0) AS v FROM agentfast_migrations").fetchone())["v"]
            return version

        return self._retry(op)

    def migrate(self) -> int:
        """Apply missing migrations, one migrator at a time; returns the schema version.

        A store already at this release's version is only read (a runner's role, which may not
        change the schema, gets through). Raises SchemaBehind when it is behind and this role may
        not migrate it (the operator's role does, at its start), StoreUnavailable."""
        current = self.schema_version()
        if current >= len(MIGRATIONS):
            return current

        def op(conn: psycopg.Connection[DictRow]) -> int:
            # Migrators take turns on the migrations table in a mode its readers (runner roles,
            # SELECT only) cannot hold, so no tenant can stall a migration by squatting a lock
            # (issue 30). An empty database has no table yet, and so no tenant: an advisory
            # lock serializes its first migrators.
            if _one(conn.execute("SELECT to_regclass('agentfast_migrations') IS NULL AS empty").fetchone())["empty"]:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS agentfast_migrations (version integer PRIMARY KEY,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                )
            conn.execute("LOCK TABLE agentfast_migrations IN SHARE ROW EXCLUSIVE MODE")
            applied = _one(conn.execute("SELECT coalesce(max(version), 0) AS v FROM agentfast_migrations").fetchone())["v"]
            for version, migration in enumerate(MIGRATIONS, start=1):
                if version > applied:
                    conn.execute(migration)
                    conn.execute("INSERT INTO agentfast_migrations (version) VALUES (%s)", (version,))
            return len(MIGRATIONS)

        try:
            return self._retry(op)
        except StoreUnavailable as err:
            if "refused the store's role a privilege" not in str(err):
                raise
            raise SchemaBehind(
                f"the store's schema is at version {current}, this release needs {len(MIGRATIONS)}, and this role may not"
                " migrate it: the operator migrates at its start (or run `agentfast migrate` with the owner's DSN)"
            ) from None

    # -- tenants: a Postgres role per namespace (G11) -----------------------------------------

    def tenant_role(self, namespace: str) -> str:
        """The login role of ``namespace``'s runners in this database: ``agentfast_r_`` + 24 hex
        digits of a hash of (database, namespace), so two databases on one server (roles are
        server-wide) and any namespace name (up to 63 characters) fit Postgres's 63-byte names."""
        db = self._retry(lambda c: _one(c.execute("SELECT current_database() AS d").fetchone())["d"])
        return "agentfast_r_" + hashlib.sha256(f"{db}/{namespace}".encode()).hexdigest()[:24]

    def tenant(self, namespace: str) -> tuple[str, str] | None:
        """``(role_name, credential_id)`` of ``namespace``'s runner role, or None if it has none."""
        row = self._retry(
            lambda c: c.execute(
                "SELECT role_name, credential_id FROM agentfast_tenants WHERE namespace = %s", (namespace,)
            ).fetchone()
        )
        return None if row is None else (row["role_name"], row["credential_id"])

    def tenants(self) -> dict[str, float]:
        """Every namespace with a runner role -> seconds since its credential was set."""
        rows = self._retry(
            lambda c: c.execute(
                "SELECT namespace, extract(epoch FROM now() - rotated_at)::float8 AS age FROM agentfast_tenants"
            ).fetchall()
        )
        return {r["namespace"]: r["age"] for r in rows}

    def revoke_tenant(self, namespace: str) -> bool:
        """Take ``namespace``'s runner credential away: its role may no longer log in, and its
        sessions still open see nothing from their next statement on (row-level security asks
        ``agentfast_tenants``, whose row goes). The role stays (a schema an earlier release made
        for it, with what is in it, is the namespace's); :meth:`set_tenant_password` gives it a
        new password and LOGIN again. Returns whether there was one."""

        def op(conn: psycopg.Connection[DictRow]) -> bool:
            conn.execute(_TENANT_LOCK)
            row = conn.execute("DELETE FROM agentfast_tenants WHERE namespace = %s RETURNING role_name", (namespace,)).fetchone()
            if row is None:
                return False
            conn.execute(sql.SQL("ALTER ROLE {} NOLOGIN PASSWORD NULL").format(sql.Identifier(row["role_name"])))
            return True

        return self._retry(op)

    def set_tenant_password(self, namespace: str, password: str) -> tuple[str, str]:
        """Create ``namespace``'s runner role (LOGIN, member of ``agentfast_runner``, owner of
        nothing: tools keep their tables under their own role, G11) or give it ``password``; returns ``(role_name,
        credential_id)``, a new id each call. Needs a role with CREATEROLE (the operator's).
        Existing sessions keep working; new logins need ``password``.
        Raises StoreUnavailable (also when this role may not create roles)."""
        role = self.tenant_role(namespace)
        credential_id = uuid.uuid4().hex

        def op(conn: psycopg.Connection[DictRow]) -> tuple[str, str]:
            conn.execute(_TENANT_LOCK)
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is not None
            verb = "ALTER ROLE {} LOGIN PASSWORD {}" if exists else "CREATE ROLE {} LOGIN PASSWORD {} IN ROLE agentfast_runner"
            conn.execute(sql.SQL(verb).format(sql.Identifier(role), sql.Literal(password)))
            if exists:
                conn.execute(sql.SQL("GRANT agentfast_runner TO {}").format(sql.Identifier(role)))
            conn.execute(
                """INSERT INTO agentfast_tenants (namespace, role_name, credential_id) VALUES (%s, %s, %s)
                   ON CONFLICT (namespace) DO UPDATE SET credential_id = excluded.credential_id, rotated_at = now()""",
                (namespace, role, credential_id),
            )
            return role, credential_id

        return self._retry(op)

    # -- runs and leases ----------------------------------------------------------------------

    def create_run(self, run_id: str, run_uid: str, spec: dict[str, Any]) -> RunRecord:
        """Register a run, or return the existing one with this id (its uid and spec unchanged).

        A uid is one run's for good: the idempotency keys its tools get are built from it (G4),
        so a new run whose uid another run (of another id, archived ones included) holds raises
        UidTaken. The check runs under a lock (a row of ``agentfast_locks``), not a
        constraint: a unique constraint on ``run_uid`` alone could not be kept once the tables
        are distributed by ``run_id`` (migration 7)."""

        def op(conn: psycopg.Connection[DictRow]) -> RunRecord:
            row = conn.execute("SELECT run_id, run_uid, spec, epoch FROM agentfast_runs WHERE run_id = %s", (run_id,)).fetchone()
            if row is None:
                conn.execute(_UID_LOCK)
                # Not this id: a concurrent registration of this same run (two reconciles) got here first.
                other = conn.execute(
                    "SELECT run_id FROM agentfast_runs WHERE run_uid = %s AND run_id <> %s LIMIT 1", (run_uid, run_id)
                ).fetchone()
                if other is not None:
                    raise UidTaken(
                        f"uid {run_uid} is already run {other['run_id']}'s: a uid names one run for good"
                        " (its tools' idempotency keys are made from it); give this run another uid"
                    )
                conn.execute(
                    "INSERT INTO agentfast_runs (run_id, run_uid, spec) VALUES (%s, %s, %s) ON CONFLICT (run_id) DO NOTHING",
                    (run_id, run_uid, Jsonb(spec)),
                )
                row = conn.execute(
                    "SELECT run_id, run_uid, spec, epoch FROM agentfast_runs WHERE run_id = %s", (run_id,)
                ).fetchone()
            return RunRecord(**_one(row))

        return self._retry(op)

    def get_run(self, run_id: str) -> RunRecord | None:
        row = self._retry(
            lambda c: c.execute("SELECT run_id, run_uid, spec, epoch FROM agentfast_runs WHERE run_id = %s", (run_id,)).fetchone()
        )
        return RunRecord(**row) if row else None

    def list_runs(self) -> list[tuple[RunRecord, CheckpointInfo | None]]:
        """Every run with its latest checkpoint's summary, oldest first."""

        def op(conn: psycopg.Connection[DictRow]) -> list[tuple[RunRecord, CheckpointInfo | None]]:
            rows = conn.execute(
                """SELECT r.run_id, r.run_uid, r.spec, r.epoch, c.checkpoint_id, c.iteration, c.message_count, c.phase,
                          c.saved_at, c.epoch AS c_epoch, c.schema_version
                   FROM agentfast_runs r
                   """
                + _LATEST_CHECKPOINT
                + """
                   ORDER BY r.created_at"""
            ).fetchall()
            out = []
            for r in rows:
                rec = RunRecord(r["run_id"], r["run_uid"], r["spec"], r["epoch"])
                info = None
                if r["checkpoint_id"] is not None:
                    info = CheckpointInfo(
                        r["checkpoint_id"],
                        r["iteration"],
                        r["message_count"],
                        r["phase"],
                        r["saved_at"],
                        r["c_epoch"],
                        r["schema_version"],
                    )
                out.append((rec, info))
            return out

        return self._retry(op)

    def archive_run(self, run_id: str) -> str | None:
        """Keep the run ``run_id`` (``NS/NAME``) and all its rows under ``NS/NAME@UID8`` (the first 8
        hex digits of its uid; the whole uid if that is taken), so that a new AgentRun of the same
        name starts clean and the earlier one's transcript, journal and decisions stay for audit
        (``agentfast history NS/NAME@UID8``; an ``@`` is never part of a Kubernetes name). Returns
        the new id, or None when there was no such run. A runner still holding the old run loses
        its lease at its next write: the fence finds no run of its id, or, once a new run of the
        name exists, a run of another uid (whatever its epoch)."""

        def op(conn: psycopg.Connection[DictRow]) -> str | None:
            row = conn.execute("SELECT run_uid, epoch FROM agentfast_runs WHERE run_id = %s FOR UPDATE", (run_id,)).fetchone()
            if row is None:
                return None
            uid = row["run_uid"].replace("-", "")
            new_id = f"{run_id}@{uid[:8]}"
            if conn.execute("SELECT 1 FROM agentfast_runs WHERE run_id = %s", (new_id,)).fetchone() is not None:
                new_id = f"{run_id}@{uid}"
            # The renamed rows pass the fence with the run's own epoch and uid (the rename is no runner's write).
            _name_the_lease(conn, row["epoch"], row["run_uid"])
            conn.execute("UPDATE agentfast_runs SET run_id = %s WHERE run_id = %s", (new_id, run_id))
            return new_id

        return self._retry(op)

    def cancel_run(self, run_id: str, message: str, *, reason: Literal["Deleted", "Cancelled"] = "Deleted") -> bool:
        """End an unfinished run as ``Cancelled`` with ``reason`` and ``message``: ``Deleted`` (its
        AgentRun was deleted) or ``Cancelled`` (a cancel request, :meth:`request_cancel`, and no
        live runner to carry it out). See :meth:`end_run`."""
        return self.end_run(run_id, names.Phase.CANCELLED, reason, message)

    def end_run(self, run_id: str, phase: Literal[names.Phase.CANCELLED, names.Phase.FAILED], reason: str, message: str) -> bool:
        """End an unfinished run from outside it (no runner of its own is doing so): ``phase``,
        ``reason`` and ``message`` (cut to 1024 characters) become its status. Takes the lease (a
        runner still holding the run loses it at its next write and starts nothing more) and
        commits a last checkpoint with the same transcript; a pending call stays as it was,
        undecided and never run. A run registered without a checkpoint yet gets a first one, with
        an empty transcript, so nothing starts it later. Returns whether it wrote one (False for
        no run, or a run already ended). Raises StoreUnavailable."""
        loaded = self.load_context(run_id)
        if loaded is not None and loaded[0].status.phase in TERMINAL_PHASES:
            return False
        record = self.get_run(run_id)
        if record is None:
            return False
        lease = self.acquire_lease(run_id)
        snap = self.load_snapshot(run_id)  # what the last holder committed before the takeover
        if snap is None:
            doc = record.spec.get("spec") or {}
            session = Session(
                run_uid=record.run_uid, adapter=doc.get("adapter", "vanilla"), model=(doc.get("model") or {}).get("name", "")
            )
            snap = StateSnapshot(run_id=run_id, context=RunContext(session=session), messages=[])
        elif snap.context.status.phase in TERMINAL_PHASES:
            return False
        snap.context.status = RunStatus(phase=phase, reason=reason, message=message[:1000])
        snap.saved_at = now_ms()
        self.commit_checkpoint(lease, snap, stored_messages=len(snap.messages))
        return True

    # -- cancel requests and deadlines ---------------------------------------------------------

    def request_cancel(self, run_id: str, requested_by: str) -> tuple[CancelRequest, bool]:
        """Record a request to cancel ``run_id``, made by ``requested_by``, and wake its runner if
        it waits for a decision (a NOTIFY on ``agentfast_approval``: the channel it listens on).

        Idempotent: the first request stands; returns ``(request, created)``, the recorded request
        and whether this call made it. The runner carries it out at its next safe point (top of
        an iteration, before a tool call, while waiting for a decision); nothing is ended here
        (see :meth:`cancel_run` for a run no runner holds). Only a role that owns the tables (the
        operator's, the CLI's with the owner's DSN) may write it: a runner's role gets
        StoreUnavailable (insufficient privilege). Raises UnknownRun (a KeyError) for no such run."""

        def op(conn: psycopg.Connection[DictRow]) -> tuple[CancelRequest, bool]:
            if conn.execute("SELECT 1 FROM agentfast_runs WHERE run_id = %s", (run_id,)).fetchone() is None:
                raise UnknownRun(run_id)
            made = conn.execute(
                """INSERT INTO agentfast_cancel_requests (run_id, requested_by) VALUES (%s, %s)
                   ON CONFLICT (run_id) DO NOTHING RETURNING requested_by, requested_at""",
                (run_id, requested_by[:512]),
            ).fetchone()
            if made is None:
                row = conn.execute(
                    "SELECT requested_by, requested_at FROM agentfast_cancel_requests WHERE run_id = %s", (run_id,)
                ).fetchone()
                return CancelRequest(**_one(row)), False
            conn.execute("SELECT agentfast_notify(%s, %s)", (APPROVAL_CHANNEL, run_id))
            return CancelRequest(**made), True

        return self._retry(op)

    def cancel_request(self, run_id: str) -> CancelRequest | None:
        """The run's cancel request, or None."""
        row = self._retry(
            lambda c: c.execute(
                "SELECT requested_by, requested_at FROM agentfast_cancel_requests WHERE run_id = %s", (run_id,)
            ).fetchone()
        )
        return CancelRequest(**row) if row else None

    @staticmethod
    def _end_requests(conn: psycopg.Connection[DictRow], run_id: str) -> EndRequests | None:
        row = conn.execute(
            """SELECT extract(epoch FROM clock_timestamp() - r.created_at)::float8 AS age_s, q.requested_by, q.requested_at
               FROM agentfast_runs r LEFT JOIN agentfast_cancel_requests q ON q.run_id = r.run_id
               WHERE r.run_id = %s""",
            (run_id,),
        ).fetchone()
        if row is None:
            return None
        cancel = CancelRequest(row["requested_by"], row["requested_at"]) if row["requested_by"] is not None else None
        return EndRequests(cancel, row["age_s"])

    def end_requests(self, run_id: str) -> EndRequests | None:
        """The run's cancel request and age (one cheap query; a runner's role may make it), or
        None for no such run. Ages are by the database's clock, so runners on hosts whose clocks
        differ agree."""
        return self._retry(lambda c: self._end_requests(c, run_id))

    def expired_runs(self, default_ttl_s: int) -> list[tuple[str, str]]:
        """``(run_id, run_uid)`` of every run past its retention: ended (or never started) longer
        ago than its ``spec.ttlSecondsAfterFinished`` (``default_ttl_s`` when unset; 0 keeps a run
        for ever). The caller deletes only those whose AgentRun is gone (the operator), since a
        live AgentRun whose rows vanished would be registered and run again."""
        rows = self._retry(
            lambda c: c.execute(
                """SELECT run_id, run_uid FROM (
                   SELECT r.run_id, r.run_uid, coalesce((r.spec->'spec'->>'ttlSecondsAfterFinished')::bigint, %s) AS ttl,
                          coalesce(c.saved_at, (extract(epoch FROM r.created_at) * 1000)::bigint) AS ended_ms, c.phase
                   FROM agentfast_runs r
                   """
                + _LATEST_CHECKPOINT
                + """) t
               WHERE ttl > 0 AND (phase IS NULL OR phase = ANY(%s))
                 AND ended_ms < (extract(epoch FROM clock_timestamp()) * 1000)::bigint - ttl * 1000
               ORDER BY run_id""",
                (default_ttl_s, sorted(TERMINAL_PHASES)),
            ).fetchall()
        )
        return [(r["run_id"], r["run_uid"]) for r in rows]

    def change_marks(self) -> dict[str, RunMark]:
        """``run_id -> RunMark`` for every registered run, in one query: a mark changes whenever
        the store's side of a run does, and not on a runner's heartbeat. The operator's resync
        reconciles only runs whose mark moved (operator/main.py ``_resync_due``)."""
        rows = self._retry(
            lambda c: c.execute(
                """SELECT r.run_id, r.run_uid, r.epoch,
                      (SELECT max(checkpoint_id) FROM agentfast_checkpoints c WHERE c.run_id = r.run_id) AS checkpoint,
                      (SELECT count(*) FROM agentfast_approvals a WHERE a.run_id = r.run_id) AS decisions,
                      (SELECT count(*) FROM agentfast_void_decisions v WHERE v.run_id = r.run_id) AS voided,
                      EXISTS (SELECT 1 FROM agentfast_cancel_requests q WHERE q.run_id = r.run_id) AS cancel
               FROM agentfast_runs r"""
            ).fetchall()
        )
        return {
            r["run_id"]: RunMark(r["run_uid"], r["checkpoint"], (r["epoch"], r["decisions"], r["voided"], r["cancel"]))
            for r in rows
        }

    def orphans(self, live: dict[str, str]) -> list[str]:
        """Unfinished runs (not archived: no ``@`` in the id) whose AgentRun is gone: ``live``
        maps each existing AgentRun's ``NS/NAME`` to its uid. The operator cancels them (a
        deletion it did not see while it was down)."""
        rows = self._retry(
            lambda c: c.execute(
                """SELECT r.run_id, r.run_uid, c.phase FROM agentfast_runs r
               """
                + _LATEST_CHECKPOINT
                + """
               WHERE strpos(r.run_id, '@') = 0 AND c.phase IS NOT NULL AND NOT c.phase = ANY(%s)""",
                (sorted(TERMINAL_PHASES),),
            ).fetchall()
        )
        return [r["run_id"] for r in rows if live.get(r["run_id"]) != r["run_uid"]]

    def earlier_runs(self, run_id: str) -> list[RunRecord]:
        """Runs archived from the name ``run_id`` (:meth:`archive_run`), oldest first."""
        rows = self._retry(
            lambda c: c.execute(
                """SELECT run_id, run_uid, spec, epoch FROM agentfast_runs WHERE starts_with(run_id, %s)
               ORDER BY created_at""",
                (run_id + "@",),
            ).fetchall()
        )
        return [RunRecord(**r) for r in rows]

    # -- fork and replay (issue 17 item 4) ---------------------------------------------------

    def fork_run(
        self,
        source_id: str,
        iteration: int,
        new_id: str,
        new_uid: str,
        spec: dict[str, Any],
        *,
        prices: Prices | None,
        sdk_refs: Callable[[dict[str, Any]], tuple[Sequence[str], Sequence[tuple[str, str]]]] | None = None,
    ) -> RunRecord:
        """Make the run ``new_id`` (uid ``new_uid``, registered document ``spec``) whose state is
        the run ``source_id``'s as of its committed ``iteration``, in ONE transaction; returns
        the new run's record. A runner that then takes ``new_id`` (``agentfast resume``)
        continues at iteration ``iteration + 1``.

        The fork point is the latest kept checkpoint of ``iteration`` that is a finished iteration
        boundary: no call pending a decision, the run not ended there, and every call of
        iterations <= ``iteration`` done with its result in that checkpoint's transcript (a
        LangGraph run also checkpoints after the model's superstep, before the tools ran: not a
        boundary). Iteration 0 is the run's first checkpoint (its input, nothing done yet).

        ``prices``: what the fork's model charges (``AgentRun.prices()`` of ``spec``: its
        ModelConfig's ``spec.prices`` or the scripted model's ``spec.model.prices``; None: none).
        They replace the source's in the copied context, never the other way round: a fork onto a
        dearer model counts all its tokens at its own prices. Refused when the budget the fork goes
        on with (the source's, copied) has ``max_cost`` and ``prices`` is None (the limit could
        never be checked) or is in another currency than the source's prices (the limit's).

        Copied, as rows, into the new run: that checkpoint (context: counters, usage, budget and
        classification; its ``sdk_state`` unchanged), with ``prices`` as its prices, a fresh session
        (``run_uid`` = ``new_uid``, started now), ``counters.resumes`` 0 (a fork is a new run: its
        first runner, lease epoch 1, does not count a resume), no ``trace`` but a ``trace_link`` to
        the source's root span (as the source's latest checkpoint names it; None when it was not
        traced), phase ``Running`` (reason ``Forked``), no pending call and
        epoch 0 (the first runner's lease is 1); before it, the source's kept checkpoints of
        iterations < ``iteration`` (with the fork's uid, prices and trace link), so that every
        iteration the fork's history shows can be forked again; the transcript up to that checkpoint; the model
        turns and the journal entries of iterations <= ``iteration`` with their results (done:
        never run again, G3), each keeping its idempotency key (the key names the effect that
        happened, under the source's uid; the fork's own calls get keys of ``new_uid``, G4); the
        payload rows those rows refer to (``agentfast_payloads`` is per run); and the rows of
        the SDK's state that ``sdk_refs(sdk_state)`` names (``(keys, ranges)`` as
        :meth:`sdk_rows` takes them; the adapter's own reading of its state, since the store never
        interprets it, G8; None: no SDK rows). Not copied: decisions (the journal holds what
        they led to), cancel requests, the runner row, later checkpoints. ``agentfast_runs``
        records the provenance (``forked_from``, ``forked_at``: :meth:`fork_origin`).

        Raises ForkRefused (one line, the true reason: no such source, no such iteration, pruned by
        retention (in the source before a fork was made of it), waiting for a decision, the run's end, not a
        boundary, a cost limit without prices or in another currency), RunExists (``new_id`` is taken), UidTaken (``new_uid`` is another run's),
        StoreUnavailable.
        """

        def op(conn: psycopg.Connection[DictRow]) -> RunRecord:
            src = conn.execute("SELECT run_uid FROM agentfast_runs WHERE run_id = %s", (source_id,)).fetchone()
            if src is None:
                raise ForkRefused(f"no run {source_id} to fork")
            cp = conn.execute(
                """SELECT * FROM agentfast_checkpoints WHERE run_id = %s AND iteration = %s AND pending IS NULL
                   AND NOT phase = ANY(%s) ORDER BY checkpoint_id DESC LIMIT 1""",
                (source_id, iteration, sorted(TERMINAL_PHASES)),
            ).fetchone()
            if cp is None:
                raise ForkRefused(self._no_fork_point(conn, source_id, iteration))
            counts = _one(
                conn.execute(
                    """SELECT (SELECT count(*) FROM agentfast_tool_calls WHERE run_id = %(run)s AND iteration <= %(it)s) AS calls,
                          (SELECT count(*) FROM agentfast_tool_calls WHERE run_id = %(run)s AND iteration <= %(it)s
                               AND state <> 'done') AS unfinished,
                          (SELECT count(*) FROM agentfast_messages WHERE run_id = %(run)s AND seq < %(n)s
                               AND message->>'role' = 'tool') AS results,
                          (SELECT message->>'role' = 'assistant' AND coalesce(jsonb_array_length(message->'tool_calls'), 0) = 0
                           FROM agentfast_messages WHERE run_id = %(run)s AND seq = %(n)s - 1) AS final""",
                    {"run": source_id, "it": iteration, "n": cp["message_count"]},
                ).fetchone()
            )
            if counts["unfinished"] or counts["results"] != counts["calls"]:
                raise ForkRefused(
                    f"iteration {iteration} of {source_id} is not finished at its last kept checkpoint"
                    f" ({counts['calls'] - counts['results']} of its tool calls have no result there); fork at an earlier iteration"
                )
            if counts["final"]:
                raise ForkRefused(
                    f"iteration {iteration} of {source_id} is the model's final answer: nothing follows it; fork at an earlier iteration"
                )
            _check_fork_prices(cp["context"], prices, source_id)
            if conn.execute("SELECT 1 FROM agentfast_runs WHERE run_id = %s", (new_id,)).fetchone() is not None:
                raise RunExists(f"a run named {new_id} exists; choose another name (or `agentfast delete {new_id}`)")
            conn.execute(_UID_LOCK)
            if conn.execute("SELECT 1 FROM agentfast_runs WHERE run_uid = %s", (new_uid,)).fetchone() is not None:
                raise UidTaken(f"uid {new_uid} is already another run's: a uid names one run for good")
            conn.execute(
                "INSERT INTO agentfast_runs (run_id, run_uid, spec, forked_from, forked_at) VALUES (%s, %s, %s, %s, %s)",
                (new_id, new_uid, Jsonb(spec), source_id, iteration),
            )
            # The copies pass the fence as the new run's own rows: its uid, epoch 0 (no runner yet).
            _name_the_lease(conn, 0, new_uid)
            copy = {"new": new_id, "src": source_id, "it": iteration, "n": cp["message_count"]}
            conn.execute(
                """INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch)
                   SELECT %(new)s, seq, iteration, message, 0 FROM agentfast_messages WHERE run_id = %(src)s AND seq < %(n)s""",
                copy,
            )
            conn.execute(
                """INSERT INTO agentfast_turns (run_id, iteration, message, prompt_tokens, completion_tokens, epoch, created_at)
                   SELECT %(new)s, iteration, message, prompt_tokens, completion_tokens, 0, created_at
                   FROM agentfast_turns WHERE run_id = %(src)s AND iteration <= %(it)s""",
                copy,
            )
            conn.execute(
                """INSERT INTO agentfast_tool_calls (run_id, iteration, position, call_id, idempotency_key, tool_call_id, tool_name,
                                                    arguments, gated, idempotent, state, attempts, result, epoch, started_at,
                                                    finished_at)
                   SELECT %(new)s, iteration, position, call_id, idempotency_key, tool_call_id, tool_name, arguments, gated,
                          idempotent, state, attempts, result, 0, started_at, finished_at
                   FROM agentfast_tool_calls WHERE run_id = %(src)s AND iteration <= %(it)s""",
                copy,
            )
            # The source's trace as it is now (its latest checkpoint's: a fork traced since it
            # was made has its own): the fork's trace links to it, never continues it.
            latest = conn.execute(
                "SELECT context->'trace' AS trace FROM agentfast_checkpoints WHERE run_id = %s ORDER BY checkpoint_id DESC LIMIT 1",
                (source_id,),
            ).fetchone()
            src_trace = (latest or {}).get("trace") or {}
            link = (
                {
                    "trace_id": src_trace["trace_id"],
                    "span_id": src_trace["root_span_id"],
                    "kind": "forked_from",
                    "run_id": source_id,
                    "iteration": iteration,
                }
                if src_trace.get("trace_id") and src_trace.get("root_span_id")
                else None
            )
            model = ((spec.get("spec") or {}).get("model") or {}).get("name")

            def own(ctx: dict[str, Any]) -> dict[str, Any]:
                """A copied context as the fork's: its uid, model and prices, no trace of the source's."""
                context = dict(ctx)
                session = {**context.get("session", {}), "run_uid": new_uid}
                if model:  # the model the fork asks from here on (its spec's)
                    session["model"] = model
                context["session"] = session
                # The fork's own prices, never the source's (a source at 0 would make a paid fork free).
                context["prices"] = None if prices is None else prices.model_dump(mode="json")
                context.pop("trace", None)  # a trace of its own (runner/tracing.py), linked to the source's
                context["trace_link"] = link
                return context

            # The source's kept checkpoints of earlier iterations, as the fork's own history: any
            # iteration `agentfast history` shows of the fork can be forked again (issue 31 item 6).
            earlier = conn.execute(
                """SELECT iteration, message_count, phase, schema_version, context, pending, sdk_state, saved_at
                   FROM agentfast_checkpoints WHERE run_id = %s AND iteration < %s AND checkpoint_id < %s
                   ORDER BY checkpoint_id""",
                (source_id, iteration, cp["checkpoint_id"]),
            ).fetchall()
            for e in earlier:
                conn.execute(
                    """INSERT INTO agentfast_checkpoints (run_id, checkpoint_key, iteration, message_count, phase, schema_version,
                                                         context, pending, sdk_state, saved_at, epoch)
                       VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0)""",
                    (
                        new_id,
                        uuid.uuid4(),
                        e["iteration"],
                        e["message_count"],
                        e["phase"],
                        e["schema_version"],
                        Jsonb(own(e["context"])),
                        Jsonb(e["pending"]) if e["pending"] is not None else None,
                        Jsonb(e["sdk_state"]),
                        e["saved_at"],
                    ),
                )
            context = own(cp["context"])
            context["session"]["started_at"] = now_ms()
            # Its first start is a start, not a resume: the fork's count is its own.
            context["counters"] = {**context.get("counters", {}), "resumes": 0}
            context["status"] = {
                "phase": names.Phase.RUNNING.value,
                "reason": "Forked",
                "message": f"forked from {source_id} at iteration {iteration}",
            }
            conn.execute(
                """INSERT INTO agentfast_checkpoints (run_id, checkpoint_key, iteration, message_count, phase, schema_version,
                                                     context, pending, sdk_state, saved_at, epoch)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, NULL, %s, %s, 0)""",
                (
                    new_id,
                    uuid.uuid4(),
                    iteration,
                    cp["message_count"],
                    names.Phase.RUNNING.value,
                    cp["schema_version"],
                    Jsonb(context),
                    Jsonb(cp["sdk_state"]),
                    now_ms(),
                ),
            )
            keys: list[str] = []
            ranges: list[tuple[str, str]] = []
            for state in [e["sdk_state"] for e in earlier] + [cp["sdk_state"]]:
                if sdk_refs is not None and state:
                    k, r = sdk_refs(state)
                    keys += k
                    ranges += r
            if keys or ranges:
                # Rows as they are (G8): the ones the checkpoint's sdk_state names, by the adapter's own reading.
                conn.execute(
                    """INSERT INTO agentfast_sdk_blobs (run_id, key, type, value, epoch)
                       SELECT %(new)s, b.key, b.type, b.value, 0 FROM agentfast_sdk_blobs b WHERE b.run_id = %(src)s
                         AND (b.key = ANY(%(keys)s::text[]) OR EXISTS (
                              SELECT 1 FROM unnest(%(lo)s::text[], %(hi)s::text[]) AS r(lo, hi)
                              WHERE b.key COLLATE "C" >= r.lo AND b.key COLLATE "C" < r.hi))""",
                    {**copy, "keys": list(keys), "lo": [lo for lo, _ in ranges], "hi": [hi for _, hi in ranges]},
                )
            # Payloads are per run: the ones the copied rows refer to are copied too (a string that
            # merely quotes a reference may copy one more row: harmless, content-addressed).
            conn.execute(
                """INSERT INTO agentfast_payloads (run_id, digest, size_bytes, content, epoch)
                   SELECT %(new)s, p.digest, p.size_bytes, p.content, 0 FROM agentfast_payloads p
                   WHERE p.run_id = %(src)s AND p.digest IN (
                       SELECT (regexp_matches(t, '@agentfast/payload:sha256:([0-9a-f]{64}):', 'g'))[1] FROM (
                           SELECT message::text AS t FROM agentfast_messages WHERE run_id = %(new)s
                           UNION ALL SELECT message::text FROM agentfast_turns WHERE run_id = %(new)s
                           UNION ALL SELECT arguments || coalesce(result::text, '') FROM agentfast_tool_calls
                               WHERE run_id = %(new)s
                           UNION ALL SELECT context::text FROM agentfast_checkpoints WHERE run_id = %(new)s) s)""",
                copy,
            )
            conn.execute("SELECT agentfast_notify(%s, %s)", (PROGRESS_CHANNEL, new_id))
            return RunRecord(new_id, new_uid, spec, 0)

        return self._retry(op)

    @staticmethod
    def _no_fork_point(conn: psycopg.Connection[DictRow], run_id: str, iteration: int) -> str:
        """Why ``run_id`` has no checkpoint of ``iteration`` to fork from, in one line: the true
        reason of the three (not reached yet; pruned by retention, in the source before a fork
        was made of it too; only waiting for a decision, or the run's end, there)."""
        terminal = sorted(TERMINAL_PHASES)
        row = _one(
            conn.execute(
                """SELECT min(iteration) AS lo, max(iteration) AS hi,
                          count(*) FILTER (WHERE iteration = %s) AS here,
                          count(*) FILTER (WHERE iteration = %s AND pending IS NOT NULL AND NOT phase = ANY(%s)) AS waiting,
                          string_agg(DISTINCT phase, ', ') FILTER (WHERE iteration = %s AND phase = ANY(%s)) AS ended,
                          (SELECT forked_from FROM agentfast_runs WHERE run_id = %s) AS forked_from,
                          (SELECT forked_at FROM agentfast_runs WHERE run_id = %s) AS forked_at
                   FROM agentfast_checkpoints WHERE run_id = %s""",
                (iteration, iteration, terminal, iteration, terminal, run_id, run_id, run_id),
            ).fetchone()
        )
        if row["hi"] is None:
            return f"{run_id} has no checkpoint yet"
        if iteration > row["hi"]:
            return f"{run_id} has no iteration {iteration}: its last committed iteration is {row['hi']}"
        if iteration < row["lo"] or not row["here"]:
            before = (
                f", in {row['forked_from']} already when {run_id} was forked from it at iteration {row['forked_at']}"
                if row["forked_from"] is not None and iteration <= row["forked_at"]
                else ""
            )
            return (
                f"iteration {iteration} of {run_id} was pruned: retention keeps the latest checkpoints only{before}"
                f" (kept: iterations {row['lo']} to {row['hi']}); fork at a kept one"
            )
        why = [
            *(
                ["was waiting for a decision at every kept checkpoint of it (a call pending approval is never forked)"]
                if row["waiting"]
                else []
            ),
            *([f"ended the run ({row['ended']}): nothing follows it"] if row["ended"] else []),
        ]
        return (
            f"iteration {iteration} of {run_id} {' and '.join(why) or 'has no finished checkpoint'}; fork at an earlier iteration"
        )

    def fork_origin(self, run_id: str) -> tuple[str, int] | None:
        """``(source run id, iteration)`` of a run made by :meth:`fork_run`, else None (also for no such run)."""
        row = self._read("SELECT forked_from, forked_at FROM agentfast_runs WHERE run_id = %s", (run_id,))
        if row is None or row["forked_from"] is None:
            return None
        return row["forked_from"], row["forked_at"]

    def delete_run(self, run_id: str) -> bool:
        """Delete a run and all its data (transcript, journal, approvals, payloads: every run table
        cascades). Returns whether it existed."""
        self._payloads_stored = {k for k in self._payloads_stored if k[0] != run_id}
        return self._retry(lambda c: c.execute("DELETE FROM agentfast_runs WHERE run_id = %s", (run_id,)).rowcount > 0)

    def acquire_lease(self, run_id: str) -> Lease:
        """Take the run over: bump its fencing epoch. Any older holder's writes now fail (G6).

        Raises UnknownRun (a KeyError) if the run does not exist.
        """
        row = self._retry(
            lambda c: c.execute(
                "UPDATE agentfast_runs SET epoch = epoch + 1 WHERE run_id = %s RETURNING epoch, run_uid", (run_id,)
            ).fetchone()
        )
        if row is None:
            raise UnknownRun(run_id)
        return Lease(run_id, row["epoch"], row["run_uid"])

    # -- crash loops (migration 18) -------------------------------------------------------------

    def start_attempt(self, lease: Lease, iteration: int) -> int:
        """Record that this runner starts (or resumes) the run at ``iteration`` (1-based, the
        next model call's), and return how many runners before it crashed in that iteration in a
        row: the previous attempt counts as one if it never ended (:meth:`end_attempt`), since
        the checkpoint this runner starts from is its last commit. 0 at a new iteration. One
        statement. Raises LeaseLost, StoreUnavailable."""
        row = self._write_statement(
            lease,
            {},
            "SELECT agentfast_start_attempt(%s, %s, %s, %s) AS crashes",
            (lease.run_id, lease.epoch, lease.run_uid, iteration),
        )
        return int(row["crashes"]) if row is not None else 0

    def end_attempt(self, lease: Lease, iteration: int) -> None:
        """Record that this runner's attempt ended without crashing, at ``iteration`` (a stop, a
        pause, a committed ending; not the tool host's death): the next start does not count it.
        Raises LeaseLost, StoreUnavailable."""
        self._write_statement(
            lease, {}, "SELECT agentfast_end_attempt(%s, %s, %s, %s)", (lease.run_id, lease.epoch, lease.run_uid, iteration)
        )

    def attempts(self, run_id: str) -> tuple[int, int, bool] | None:
        """The run's crash count as stored: ``(iteration, crashes, running)``, or None when no
        runner started it yet. Raises StoreUnavailable."""
        row = self._retry(
            lambda c: c.execute(
                "SELECT iteration, crashes, running FROM agentfast_attempts WHERE run_id = %s", (run_id,)
            ).fetchone()
        )
        return None if row is None else (row["iteration"], row["crashes"], row["running"])

    # -- checkpoints --------------------------------------------------------------------------

    def commit_checkpoint(
        self, lease: Lease, snapshot: StateSnapshot, *, stored_messages: int, sdk_rows: Sequence[SdkRow] = ()
    ) -> int:
        """Commit one checkpoint in one transaction (G1); returns its checkpoint_id.

        Inserts only ``snapshot.messages[stored_messages:]`` (the ones not yet stored), the
        ``sdk_rows`` (rows of the SDK's state that ``snapshot.sdk_state`` names and that are not
        stored yet: written in the same transaction, so a committed sdk_state never names a
        missing row), then one small checkpoint row, prunes superseded checkpoints beyond the
        retention setting, and, once committed, notifies ``agentfast_progress``. The new messages, the context and
        the pending call of ``snapshot`` are replaced in place by their stored form
        (:mod:`.storable`), so the runner continues with exactly what a resume would read. A
        string over the payload threshold in the new messages, the context or the pending call is
        stored once in ``agentfast_payloads`` and the rows refer to it (:mod:`.payloads`); loads
        resolve it. Raises PayloadTooLarge (a string over the ceiling, or a value Postgres cannot
        store), LeaseLost, StoreUnavailable.
        """
        return self._commit_checkpoint(lease, snapshot, stored_messages, sdk_rows, read_ends=False)[0]

    def commit_checkpoint_then_read_end_requests(
        self, lease: Lease, snapshot: StateSnapshot, *, stored_messages: int, sdk_rows: Sequence[SdkRow] = ()
    ) -> tuple[int, EndRequests | None]:
        """:meth:`commit_checkpoint`, plus the run's :meth:`end_requests` read in the same
        transaction (no extra round trip), for a runner whose next step is a safe point: the
        read is as fresh as one made there, since nothing but its own computing lies between."""
        return self._commit_checkpoint(lease, snapshot, stored_messages, sdk_rows, read_ends=True)

    def sdk_rows(
        self, run_id: str, keys: Sequence[str] = (), ranges: Sequence[tuple[str, str]] = ()
    ) -> dict[str, tuple[str, bytes]]:
        """Rows of the run's SDK state (:class:`SdkRow`) by key: those named in ``keys``, and every
        row whose key ``k`` has ``lo <= k < hi`` (byte order) for some ``(lo, hi)`` of ``ranges``.
        Returns ``{key: (type, value)}``; a key with no row is absent. One query. Raises
        StoreUnavailable."""
        if not keys and not ranges:
            return {}
        rows = self._read(
            """SELECT key, type, value FROM agentfast_sdk_blobs WHERE run_id = %(run)s AND key = ANY(%(keys)s::text[])
               UNION ALL
               SELECT b.key, b.type, b.value FROM unnest(%(lo)s::text[], %(hi)s::text[]) AS r(lo, hi)
                   JOIN agentfast_sdk_blobs b ON b.run_id = %(run)s AND b.key COLLATE "C" >= r.lo AND b.key COLLATE "C" < r.hi""",
            {"run": run_id, "keys": list(keys), "lo": [lo for lo, _ in ranges], "hi": [hi for _, hi in ranges]},
            all=True,
        )
        return {r["key"]: (r["type"], bytes(r["value"])) for r in rows}

    def _commit_checkpoint(
        self, lease: Lease, snapshot: StateSnapshot, stored_messages: int, sdk_rows: Sequence[SdkRow], *, read_ends: bool
    ) -> tuple[int, EndRequests | None]:
        key = uuid.uuid4()
        iteration = snapshot.context.counters.iterations
        stored = [_stored_json(m, exclude_defaults=True) for m in snapshot.messages[stored_messages:]]
        snapshot.messages[stored_messages:] = [m for m, _ in stored]
        # Large strings go to agentfast_payloads (a tool's output is there already, from
        # record_result: not sent again); the rows keep references. sdk_state and sdk_rows are
        # the SDK's own, stored as they are (G8): sdk_state is small, its rows are written once.
        out: dict[str, str] = {}
        new = [
            self._out_of_line(text, out, f"message {stored_messages + i} of the transcript") for i, (_, text) in enumerate(stored)
        ]
        snapshot.context, context = _stored_json(snapshot.context)
        context = self._out_of_line(context, out, "the run's context")
        pending = None
        if snapshot.pending:
            snapshot.pending, pending = _stored_json(snapshot.pending)
            pending = self._out_of_line(pending, out, "the pending call")

        # A retry after a commit whose acknowledgement was lost finds its rows there (ON CONFLICT
        # keeps them); the id is read by the checkpoint's key either way. The new messages go as
        # one JSON array (no per-element quoting), the SDK rows as arrays.
        try:
            row = self._write_statement(
                lease,
                out,
                """SELECT * FROM agentfast_commit_checkpoint(%s, %s, %s, %s, %s, %s, %s::jsonb, %s::text[], %s::text[], %s::bytea[],
                                                             %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s, %s)""",
                (
                    snapshot.run_id,
                    lease.epoch,
                    lease.run_uid,
                    key,
                    iteration,
                    stored_messages,
                    "[" + ",".join(new) + "]" if new else None,
                    [r.key for r in sdk_rows],
                    [r.type for r in sdk_rows],
                    [r.value for r in sdk_rows],
                    len(snapshot.messages),
                    snapshot.context.status.phase,
                    snapshot.schema_version,
                    context,
                    pending,
                    Jsonb(snapshot.sdk_state),
                    snapshot.saved_at,
                    self.retention_keep,
                    read_ends,
                ),
                notify=PROGRESS_CHANNEL,
            )
        except PayloadTooLarge as err:
            raise err.about(
                f"the checkpoint of iteration {iteration} (its transcript, context, pending call or sdk_state)"
            ) from None
        self._payloads_committed(lease, out)
        row = _one(row)
        ends = None
        if read_ends and row["run_found"]:
            cancel = CancelRequest(row["cancel_by"], row["cancel_at"]) if row["cancel_by"] is not None else None
            ends = EndRequests(cancel, row["age_s"])
        return row["cid"], ends

    def load_snapshot(self, run_id: str) -> StateSnapshot | None:
        """The run's latest checkpoint with its transcript, or None if it has none.

        Raises UnreadableState for a checkpoint of a newer schema or a row that does not decode.
        """

        def op(conn: psycopg.Connection[DictRow]) -> tuple[dict[str, Any], list[Any]] | None:
            cp = conn.execute(
                "SELECT * FROM agentfast_checkpoints WHERE run_id = %s ORDER BY checkpoint_id DESC LIMIT 1", (run_id,)
            ).fetchone()
            if cp is None:
                return None
            # As text (what the server sends for jsonb anyway), decoded here: a substring test
            # finds the few rows that may hold a payload reference, not a walk of every message.
            texts = [
                m["message"]
                for m in conn.execute(
                    "SELECT message::text AS message FROM agentfast_messages WHERE run_id = %s AND seq < %s ORDER BY seq",
                    (run_id, cp["message_count"]),
                ).fetchall()
            ]
            msgs = [json.loads(t) for t in texts]
            refer = [i for i, t in enumerate(texts) if payloads.PREFIX in t]
            where = f"checkpoint {cp['checkpoint_id']} (iteration {cp['iteration']})"
            got = self._resolved(
                run_id,
                [
                    ("agentfast_checkpoints", where, cp["context"]),
                    ("agentfast_checkpoints", where, cp["pending"]),
                    *(("agentfast_messages", f"seq {i}", msgs[i]) for i in refer),
                ],
                conn,
            )
            cp["context"], cp["pending"] = got[0], got[1]
            for i, value in zip(refer, got[2:]):
                msgs[i] = value
            return cp, msgs

        got = self._retry(op)
        return decode_snapshot(run_id, *got) if got is not None else None

    def load_context(self, run_id: str) -> tuple[RunContext, PendingToolCall | None] | None:
        """The latest checkpoint's context and pending call, without the transcript (cheap).

        A reader's view (status, the operator, the inbox), never to be committed back: its
        ``usage`` is what the run has spent, counted once each: the checkpoint's, plus a turn
        saved since and not yet in it, plus every lost reply (:meth:`lost_replies`; their number
        in ``usage.lost_replies``). Decoded like a snapshot (version checked, older versions
        upgraded): raises UnreadableState.
        """
        row = self._retry(lambda c: self._latest_context(c, run_id))
        if row is None:
            return None
        snap = decode_snapshot(run_id, row, [])
        return _counted(snap.context, row), snap.pending

    def load_context_and_awaiting(self, run_id: str) -> tuple[RunContext, list[AwaitedCall]] | None:
        """The latest checkpoint's context and the calls awaiting a decision now (:meth:`awaiting`),
        from one read of the checkpoint; None when the run has none. Raises UnreadableState."""

        def op(conn: psycopg.Connection[DictRow]) -> tuple[RunContext, list[AwaitedCall]] | None:
            row = self._latest_context(conn, run_id)
            if row is None:
                return None
            snap = decode_snapshot(run_id, row, [])
            return _counted(snap.context, row), self._still_awaiting(conn, run_id, snap)

        return self._retry(op)

    def _latest_context(self, conn: psycopg.Connection[DictRow], run_id: str) -> dict[str, Any] | None:
        """The latest checkpoint row without ``sdk_state`` (its payload references resolved), or
        None; with what :func:`_counted` adds to its usage: ``later_turns`` (``[iteration,
        prompt, completion]`` of each turn saved after the checkpoint's iteration) and the
        run's lost replies (``lost_count``, ``lost_prompt``, ``lost_completion``), read in the
        same statement (one snapshot: a reply is either kept by its turn or lost, never both)."""
        row = conn.execute(
            """SELECT c.checkpoint_id, c.iteration, c.schema_version, c.context, c.pending, c.saved_at,
                      (SELECT coalesce(jsonb_agg(jsonb_build_array(t.iteration, t.prompt_tokens, t.completion_tokens)), '[]')
                       FROM agentfast_turns t WHERE t.run_id = c.run_id AND t.iteration > c.iteration) AS later_turns,
                      l.n AS lost_count, l.p AS lost_prompt, l.q AS lost_completion
               FROM agentfast_checkpoints c,
                    LATERAL (SELECT count(*) AS n, coalesce(sum(m.prompt_tokens), 0) AS p, coalesce(sum(m.completion_tokens), 0) AS q
                             FROM agentfast_model_replies m WHERE m.run_id = c.run_id AND NOT m.kept) l
               WHERE c.run_id = %s ORDER BY c.checkpoint_id DESC LIMIT 1""",
            (run_id,),
        ).fetchone()
        if row is not None:
            where = f"checkpoint {row['checkpoint_id']} (iteration {row['iteration']})"
            row["context"], row["pending"] = self._resolved(
                run_id, [("agentfast_checkpoints", where, row["context"]), ("agentfast_checkpoints", where, row["pending"])], conn
            )
        return row

    def list_checkpoints(self, run_id: str) -> list[CheckpointInfo]:
        rows = self._retry(
            lambda c: c.execute(
                """SELECT checkpoint_id, iteration, message_count, phase, saved_at, epoch, schema_version FROM agentfast_checkpoints
                   WHERE run_id = %s ORDER BY checkpoint_id""",
                (run_id,),
            ).fetchall()
        )
        return [CheckpointInfo(**r) for r in rows]

    # -- turns and the tool-call journal ------------------------------------------------------

    def save_turn(self, lease: Lease, turn: Turn, planned: list[JournalEntry]) -> Turn:
        """Persist the model's reply of an iteration and the intent of each call it asked for.

        One transaction, before any tool runs: a resume reuses this reply instead of asking the
        model again, so the calls (and their idempotency keys) can never change under a retry.
        Returns the turn as stored (text made storable: see :mod:`.storable`). Large strings (the
        content, a call's arguments) are stored once, out of line (:mod:`.payloads`). Raises
        PayloadTooLarge (naming the iteration and the size), LeaseLost, StoreUnavailable.
        """
        return self._save_turn(lease, turn, planned, None, None)[0]

    def save_turn_and_mark_started(
        self, lease: Lease, turn: Turn, planned: list[JournalEntry], position: int, *, deadline_s: float | None = None
    ) -> tuple[Turn, EndRequests | None]:
        """:meth:`save_turn`, then :meth:`mark_started` of the call at ``position`` (of ``planned``),
        in the same transaction (one write instead of two, for a runner that starts that call
        next). Returns ``(turn as stored, what mark_started returns)``: None when the call was
        marked (run it now), else the :class:`EndRequests` that stopped it (the turn and the plan
        are saved either way; the call stays planned). Raises as both do."""
        turn, row = self._save_turn(lease, turn, planned, position, deadline_s)
        return turn, self._intent_outcome(lease, turn.iteration, position, deadline_s, _one(row))

    def _save_turn(
        self, lease: Lease, turn: Turn, planned: list[JournalEntry], start: int | None, deadline_s: float | None
    ) -> tuple[Turn, dict[str, Any] | None]:
        message, text = _stored_json(turn.message)
        turn = Turn(turn.iteration, message, turn.prompt_tokens, turn.completion_tokens)
        what = f"the model's reply of iteration {turn.iteration}"
        out: dict[str, str] = {}
        text = self._out_of_line(text, out, what)
        arguments = [
            payloads.externalize(
                e.tool_call.arguments, self.payload_limits, out, what=f"the arguments of {e.call_id} ({e.tool_call.name})"
            )
            for e in planned
        ]

        calls = Jsonb(
            [
                {
                    "position": e.position,
                    "call_id": e.call_id,
                    "idempotency_key": e.idempotency_key,
                    "tool_call_id": e.tool_call.id,
                    "tool_name": e.tool_call.name,
                    "arguments": args,
                    "gated": e.gated,
                    "idempotent": e.idempotent,
                }
                for e, args in zip(planned, arguments)
            ]
        )
        query = "SELECT * FROM agentfast_save_turn(%s, %s, %s, %s, %s::jsonb, %s, %s, %s::jsonb, %s::integer, %s::float8)"
        params = (
            lease.run_id,
            lease.epoch,
            lease.run_uid,
            turn.iteration,
            text,
            turn.prompt_tokens,
            turn.completion_tokens,
            calls,
            start,
            deadline_s,
        )

        try:
            row = self._write_statement(lease, out, query, params)
        except PayloadTooLarge as err:
            raise err.about(what, len(text.encode())) from None
        self._payloads_committed(lease, out)
        return turn, row

    def record_reply(self, lease: Lease, iteration: int, prompt_tokens: int, completion_tokens: int, cost: float | None) -> None:
        """Record that the model answered iteration ``iteration`` under ``lease``, with its usage
        (counts of tokens) and ``cost`` (at the run's prices, in their currency; None: no prices),
        the moment the reply arrives: whatever dies before its turn is saved, the reply counts
        against ``max_tokens`` and ``max_cost`` (:meth:`lost_replies`). Once per (iteration,
        lease): a retry adds nothing. One statement committed asynchronously
        (``synchronous_commit = off``: no WAL flush to wait for; it is durable once the WAL
        writer flushes, within a few hundred ms, or at the turn's own commit, whichever is
        first: any runner death is covered, a Postgres crash in that window is not). Not
        fenced: a runner that lost its lease was still billed. Raises StoreUnavailable."""
        params = (lease.run_id, lease.epoch, lease.run_uid, iteration, prompt_tokens, completion_tokens, cost)
        self._attempt(
            lambda c: c.execute(
                "SELECT set_config('synchronous_commit', 'off', true), agentfast_record_reply(%s, %s, %s, %s, %s, %s, %s)",
                params,
            )
        )

    def lost_replies(self, run_id: str) -> LostReplies:
        """The run's model replies that were answered but never kept by a saved turn (a crash
        lost them after :meth:`record_reply`): their number and tokens. One query, over those
        rows only (a partial index). Raises StoreUnavailable."""
        row = _one(
            self._read(
                """SELECT count(*) AS n, coalesce(sum(prompt_tokens), 0) AS p, coalesce(sum(completion_tokens), 0) AS q
                   FROM agentfast_model_replies WHERE run_id = %s AND NOT kept""",
                (run_id,),
            )
        )
        return LostReplies(int(row["n"]), int(row["p"]), int(row["q"]))

    def last_turn_iteration(self, run_id: str) -> int:
        """The highest iteration with a saved model reply (0: none)."""
        row = self._read("SELECT coalesce(max(iteration), 0) AS it FROM agentfast_turns WHERE run_id = %s", (run_id,))
        iteration: int = _one(row)["it"]
        return iteration

    def load_turn(self, run_id: str, iteration: int) -> Turn | None:
        row = self._read(
            "SELECT iteration, message, prompt_tokens, completion_tokens FROM agentfast_turns WHERE run_id = %s AND iteration = %s",
            (run_id, iteration),
        )
        if row is None:
            return None
        [stored] = self._resolved(run_id, [("agentfast_turns", f"iteration {iteration}", row["message"])])
        message = decode_row(run_id, "agentfast_turns", f"iteration {iteration}", Message, stored)
        return Turn(row["iteration"], message, row["prompt_tokens"], row["completion_tokens"])

    def journal(self, run_id: str, iteration: int | None = None) -> list[JournalEntry]:
        """Journal entries of a run (of one iteration if given), in (iteration, position) order."""
        query = "SELECT * FROM agentfast_tool_calls WHERE run_id = %s"
        params: list[Any] = [run_id]
        if iteration is not None:
            query += " AND iteration = %s"
            params.append(iteration)
        rows = self._read(query + " ORDER BY iteration, position", params, all=True)
        values = []
        for r in rows:
            values += [
                ("agentfast_tool_calls", f"call {r['call_id']}", r["arguments"]),
                ("agentfast_tool_calls", f"call {r['call_id']}", r["result"]),
            ]
        resolved = self._resolved(run_id, values)
        for i, r in enumerate(rows):
            r["arguments"], r["result"] = resolved[2 * i], resolved[2 * i + 1]
        return [
            JournalEntry(
                iteration=r["iteration"],
                position=r["position"],
                call_id=r["call_id"],
                idempotency_key=r["idempotency_key"],
                tool_call=ToolCall(id=r["tool_call_id"], name=r["tool_name"], arguments=r["arguments"]),
                gated=r["gated"],
                idempotent=r["idempotent"],
                state=r["state"],
                attempts=r["attempts"],
                result=decode_row(run_id, "agentfast_tool_calls", f"call {r['call_id']}", ToolResult, r["result"])
                if r["result"]
                else None,
            )
            for r in rows
        ]

    def mark_started(self, lease: Lease, iteration: int, position: int, *, deadline_s: float | None = None) -> EndRequests | None:
        """Record that a call is about to run (the write-ahead intent, G4), unless the run was
        asked to end: one transaction checks the run's cancel request and its age against
        ``deadline_s`` (``spec.activeDeadlineSeconds``; None: none) and marks the call only if
        neither ends the run, so no call starts after a cancel was recorded. Never marks a done call.

        Returns None when the call was marked (run it now), else the :class:`EndRequests` that
        stopped it (the call stays as it was; don't run it). Raises LeaseLost, StoreError (not
        in the journal, or done), StoreUnavailable.
        """

        row = self._attempt(
            lambda conn: conn.execute(
                "SELECT * FROM agentfast_mark_started(%s, %s, %s, %s, %s, %s::float8)",
                (lease.run_id, lease.epoch, lease.run_uid, iteration, position, deadline_s),
            ).fetchone()
        )
        return self._intent_outcome(lease, iteration, position, deadline_s, _one(row))

    @staticmethod
    def _intent_outcome(
        lease: Lease, iteration: int, position: int, deadline_s: float | None, row: dict[str, Any]
    ) -> EndRequests | None:
        """What :meth:`mark_started` returns or raises, from the row of ``agentfast_mark_started``."""
        if row["marked"]:
            return None
        # No row changed, so the fence trigger never ran: a zombie whose successor already
        # finished this call lands here, and must stop as a lost lease (exit 76), not crash.
        if row["run_epoch"] is None or row["run_epoch"] != lease.epoch:
            raise LeaseLost(
                f"agentfast: run {lease.run_id} lease lost: epoch {lease.epoch} is stale (current {row['run_epoch']})"
            )
        if row["uid"] != lease.run_uid:
            raise LeaseLost(
                f"agentfast: run {lease.run_id} lease lost: the run was replaced: uid mismatch"
                f" (lease uid {lease.run_uid}, run uid {row['uid']})"
            )
        ends = EndRequests(
            CancelRequest(row["cancel_by"], row["cancel_at"]) if row["cancel_by"] is not None else None, row["age_s"]
        )
        if ends.cancel is not None or (deadline_s is not None and ends.age_s >= deadline_s):
            return ends
        raise StoreError(f"call {iteration}/{position} of {lease.run_id} is not in the journal or already done")

    def record_result(self, lease: Lease, iteration: int, position: int, result: ToolResult) -> ToolResult:
        """Persist a call's result; from now on it is never run again (G3).

        Returns the result as stored (text made storable: see :mod:`.storable`); a content over
        the payload threshold is stored once in ``agentfast_payloads`` and the row refers to it
        (:mod:`.payloads`). Raises PayloadTooLarge (naming the call and the size) for a content
        over the ceiling or one Postgres cannot store, LeaseLost, StoreUnavailable.
        """
        result, text = _stored_json(result)
        what = f"the result of {result.call_id} ({result.tool_name})"
        out: dict[str, str] = {}
        text = self._out_of_line(text, out, what)

        try:
            self._write_statement(
                lease,
                out,
                "SELECT agentfast_record_result(%s, %s, %s, %s, %s, %s::jsonb)",
                (lease.run_id, lease.epoch, lease.run_uid, iteration, position, text),
            )
        except PayloadTooLarge as err:
            raise err.about(what, len(text.encode())) from None
        self._payloads_committed(lease, out)
        return result

    # -- approvals ------------------------------------------------------------------------------

    def decide(
        self,
        run_id: str,
        call_id: str,
        decision: Literal["approve", "deny", "complete", "reply", "end"],
        *,
        reason: str | None = None,
        result: str | None = None,
        decided_by: str = "",
        once: bool = False,
        arguments_digest: str | None = None,
    ) -> Decision:
        """Record a human decision on a call that awaits one now, and wake the waiting runner.

        The one place the rule lives (the CLI, ``--kube`` through the operator, and
        ``spec.approvals`` all come here): ``call_id`` must be listed by :meth:`awaiting` at
        this moment, and undecided, and the run must still be able to use a decision: refused
        with DecisionUnusable (an UnknownCall) naming why once it has ended, a cancel was asked
        for, or it is past ``spec.activeDeadlineSeconds`` (:func:`.decisions.decisions_closed`).
        Raises InvalidDecision (see ``spec.check_decision``: a
        denial needs a reason, complete needs JSON ``result``), DecisionConflict when the call
        was already decided (``err.same`` tells a replay of the same decision), UnknownCall
        when it does not await a decision now. A question to the user (an awaited call whose
        reason is ``awaiting_input``) takes ``reply`` and nothing else; a gated call anything but
        ``reply`` (InvalidDecision).

        ``once`` (the operator, for ``spec.approvals``, which it replays on every reconcile): a
        refusal is final. A decision refused because its call did not await one is recorded
        void (``agentfast_void_decisions``) and refused again even once the call does await one,
        so an entry written before its call existed never fires later. (The admission policy
        admits entries only for calls status lists as pending; this holds when status was
        forged.) The CLI's direct decisions are not blocked by a void entry.

        ``arguments_digest`` (G13): the digest (:func:`.arguments.arguments_digest`) of the
        call's arguments as the decider was shown them. InvalidDecision when the call's
        arguments now have another digest (they changed since they were shown: nothing is
        recorded). Without it, the decision binds to the arguments the call has now. Either way
        the digest is stored with the decision, and the runner runs an approved call only with
        arguments of that digest.
        """
        reason, result = check_decision(decision, reason, result)

        def op(conn: psycopg.Connection[DictRow]) -> Decision:
            self._refuse_if_decided(conn, run_id, call_id, decision, reason, result)
            if once:
                void = conn.execute(
                    "SELECT why FROM agentfast_void_decisions WHERE run_id = %s AND call_id = %s", (run_id, call_id)
                ).fetchone()
                if void is not None:
                    raise UnknownCall(
                        f"{call_id} of run {run_id}: this decision was written before its call awaited one"
                        f" ({void['why']}); it is void for good and never applied"
                    )
            snap = self._decidable_snapshot(conn, run_id, f"{call_id} of run {run_id} cannot be decided")
            awaiting = self._undecided(conn, run_id, snap) if snap is not None else []
            if call_id not in [a.call_id for a in awaiting]:
                raise UnknownCall(self._not_awaiting(conn, run_id, call_id, awaiting))
            awaited = next(a for a in awaiting if a.call_id == call_id)
            check_decision_fits(decision, awaited)
            digest = digest_of_arguments(awaited.tool_call.arguments)
            if arguments_digest is not None and arguments_digest != digest:
                raise InvalidDecision(
                    f"{call_id} of run {run_id}: its arguments are not the ones you were shown (shown {arguments_digest[:19]}..., now"
                    f" {digest[:19]}...); nothing was decided: read the call again and decide on what it holds now"
                )
            row = conn.execute(
                """INSERT INTO agentfast_approvals (run_id, call_id, decision, reason, result, decided_by, arguments_digest)
                   VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id, call_id) DO NOTHING
                   RETURNING call_id, decision, reason, result, decided_by, arguments_digest""",
                (run_id, call_id, decision, reason, result, decided_by, digest),
            ).fetchone()
            if row is None:  # decided concurrently, between the check above and this insert
                self._refuse_if_decided(conn, run_id, call_id, decision, reason, result)
            conn.execute("SELECT agentfast_notify(%s, %s)", (APPROVAL_CHANNEL, run_id))
            return Decision(**_one(row))

        try:
            return self._retry(op)
        except UnknownCall as err:
            if once:
                self.void_decision(run_id, call_id, str(err))
            raise

    def reply(self, run_id: str, text: str, *, call_id: str | None = None, decided_by: str = "") -> Decision:
        """Answer the model's question to the user with ``text`` (a ``reply`` decision, :meth:`decide`).

        ``call_id``: the question's call id; None: the one question that awaits a reply now, and
        only it. A reply is never kept for a question to come: when none awaits, it is refused,
        and a second reply to a question already answered is refused as such. Raises
        DecisionConflict (the question that waits, or the one the run last asked, was already
        answered: ``err.existing`` is that reply), DecisionUnusable (the run can use no decision:
        ended, cancel asked for, past its deadline), UnknownCall (no such run; no question
        awaits a reply; ``call_id`` is not one), InvalidDecision (several questions await and no
        ``call_id``; the text breaks :func:`.decisions.check_decision`'s rules)."""
        return self.decide(run_id, self.question_now(run_id, call_id), "reply", result=text, decided_by=decided_by)

    def question_now(self, run_id: str, call_id: str | None = None) -> str:
        """The call id of the question of ``run_id`` that a person's answer (a reply, or ending
        the conversation) goes to: ``call_id`` if it awaits one now, else (None) the one question
        that does. Never one to come. Raises as :meth:`reply` says."""
        return self._retry(lambda c: self._question_now(c, run_id, call_id))

    def _decidable_snapshot(self, conn: psycopg.Connection[DictRow], run_id: str, refused: str) -> StateSnapshot | None:
        """The latest snapshot of ``run_id`` that a decision or a reply is checked against (None:
        no checkpoint yet). Decoded as every reader decodes a checkpoint: a decision is never
        accepted on the word of a row this release cannot read. Raises UnknownCall (no such run),
        DecisionUnusable (``refused: why``: the run has ended, a cancel was asked for, it is past
        its deadline; issue 31 item 5: refused with why, never recorded and then ignored),
        UnreadableState."""
        if conn.execute("SELECT 1 FROM agentfast_runs WHERE run_id = %s", (run_id,)).fetchone() is None:
            raise UnknownCall(f"no run {run_id}")
        latest = self._latest_context(conn, run_id)
        snap = decode_snapshot(run_id, latest, []) if latest is not None else None
        if snap is not None and (closed := self._closed(conn, run_id, snap.context.status)) is not None:
            raise DecisionUnusable(f"{refused}: {closed.message}", closed)
        return snap

    def _question_now(self, conn: psycopg.Connection[DictRow], run_id: str, call_id: str | None) -> str:
        """The call id of the question of ``run_id`` a reply answers: ``call_id`` if it awaits a
        reply now, else (None) the one question that does; raises as :meth:`reply` says."""
        snap = self._decidable_snapshot(conn, run_id, f"run {run_id} takes no reply")
        asked = [a for a in snap.pending.awaiting if a.reason == "awaiting_input"] if snap and snap.pending else []
        decided = self._decisions(conn, run_id, [a.call_id for a in asked])
        waiting = [a.call_id for a in asked if a.call_id not in decided]
        if call_id is not None:
            if call_id in waiting:
                return call_id
            if call_id in decided:
                self._refuse_if_decided(conn, run_id, call_id, REPLY, None, None)
            raise UnknownCall(
                f"{call_id} of run {run_id} is not a question awaiting a reply; questions awaiting one:"
                f" {', '.join(waiting) or 'none'}"
            )
        if len(waiting) == 1:
            return waiting[0]
        if len(waiting) > 1:
            raise InvalidDecision(
                f"run {run_id} asks {len(waiting)} questions ({', '.join(waiting)}); say which one this reply answers with --call"
            )
        last = conn.execute(
            """SELECT call_id, decision, reason, result, decided_by, arguments_digest FROM agentfast_approvals
               WHERE run_id = %s AND decision = 'reply' ORDER BY decided_at DESC, call_id DESC LIMIT 1""",
            (run_id,),
        ).fetchone()
        if asked and last is not None and last["call_id"] in decided:
            existing = Decision(**last)
            raise DecisionConflict(
                f"{existing.call_id} of run {run_id} was already answered by {existing.decided_by or 'unknown'}"
                f" ({_quoted(existing.result)}); a question takes one reply, so this one was not recorded, and it is"
                " never kept for a question to come: no other question awaits a reply now",
                existing,
                False,
            )
        told = f" (its last question, {last['call_id']}, was answered by {last['decided_by'] or 'unknown'})" if last else ""
        raise UnknownCall(
            f"run {run_id} asks the user nothing now{told}: this reply was not recorded, and a reply is never kept for a"
            " question to come; reply when status shows a question (WaitingForInput)"
        )

    def void_decision(self, run_id: str, call_id: str, why: str) -> None:
        """Mark ``call_id`` of ``run_id`` as never decidable through ``decide(once=True)`` (the
        operator's path for ``spec.approvals``); ``why`` (cut to 1024 characters) is quoted when
        it is refused. No-op for an unknown run or an already void call."""
        self._retry(
            lambda c: c.execute(
                """INSERT INTO agentfast_void_decisions (run_id, call_id, why)
               SELECT %s, %s, %s WHERE EXISTS (SELECT 1 FROM agentfast_runs WHERE run_id = %s)
               ON CONFLICT (run_id, call_id) DO NOTHING""",
                (run_id, call_id, why[:1024], run_id),
            )
        )

    def _refuse_if_decided(
        self, conn: psycopg.Connection[DictRow], run_id: str, call_id: str, decision: str, reason: str | None, result: str | None
    ) -> None:
        existing = self._decisions(conn, run_id, [call_id]).get(call_id)
        if existing is None:
            return
        same = (existing.decision, existing.reason, existing.result) == (decision, reason, result)
        said = (
            existing.decision
            + (f" ({existing.reason})" if existing.reason else "")
            + (f" with result {existing.result}" if existing.result else "")
        )
        raise DecisionConflict(
            f"{call_id} of run {run_id} was already decided: {said}, by {existing.decided_by or 'unknown'}; "
            "a decision is write-once" + (" (this is the same decision)" if same else ", so this one was not recorded"),
            existing,
            same,
        )

    def decision_log(self, run_id: str, *, last: int | None = None) -> list[dict[str, Any]]:
        """Every decision recorded for a run (only the ``last`` N when given), oldest first: one
        dict per row of ``agentfast_approvals`` (``call_id``, ``decision``, ``reason``,
        ``result``, ``decided_by``, ``decided_at`` as a datetime, and any column a later schema
        adds)."""
        if last is None:
            query, params = "SELECT * FROM agentfast_approvals WHERE run_id = %s ORDER BY decided_at, call_id", (run_id,)
        else:
            query = """SELECT * FROM (SELECT * FROM agentfast_approvals WHERE run_id = %s
                       ORDER BY decided_at DESC, call_id DESC LIMIT %s) newest ORDER BY decided_at, call_id"""
            params = (run_id, last)  # type: ignore[assignment]
        return self._retry(lambda c: c.execute(query, params).fetchall())

    @staticmethod
    def _decisions(conn: psycopg.Connection[DictRow], run_id: str, call_ids: list[str]) -> dict[str, Decision]:
        rows = conn.execute(
            """SELECT call_id, decision, reason, result, decided_by, arguments_digest FROM agentfast_approvals
               WHERE run_id = %s AND call_id = ANY(%s)""",
            (run_id, list(call_ids)),
        ).fetchall()
        return {r["call_id"]: Decision(**r) for r in rows}

    def _awaiting(self, conn: psycopg.Connection[DictRow], run_id: str) -> list[AwaitedCall]:
        row = self._latest_context(conn, run_id)
        if row is None:
            return []
        # Decoded as every reader decodes a checkpoint: a decision is never accepted on the word
        # of a row this release cannot read (raises UnreadableState, not a traceback).
        return self._still_awaiting(conn, run_id, decode_snapshot(run_id, row, []))

    @staticmethod
    def _still_awaiting(conn: psycopg.Connection[DictRow], run_id: str, snap: StateSnapshot) -> list[AwaitedCall]:
        """The calls of ``snap``'s paused batch that have no decision yet: none once the run can
        use no decision (:meth:`_closed`: ended, cancel asked for, past its deadline)."""
        if snap.pending is None or Store._closed(conn, run_id, snap.context.status) is not None:
            return []
        return Store._undecided(conn, run_id, snap)

    @staticmethod
    def _undecided(conn: psycopg.Connection[DictRow], run_id: str, snap: StateSnapshot) -> list[AwaitedCall]:
        """The calls of ``snap``'s paused batch that have no decision yet."""
        pending = snap.pending
        if pending is None:
            return []
        decided = Store._decisions(conn, run_id, pending.call_ids)
        return [a for a in pending.awaiting if a.call_id not in decided]

    @staticmethod
    def _closed(conn: psycopg.Connection[DictRow], run_id: str, status: RunStatus) -> DecisionsClosed | None:
        """:func:`.decisions.decisions_closed` for the run whose latest checkpoint has ``status``:
        its cancel request, its age and its ``spec.activeDeadlineSeconds`` read in one query (by
        the database's clock, as the runner reads them)."""
        if status.phase in TERMINAL_PHASES:
            return decisions_closed(phase=status.phase, phase_reason=status.reason)
        row = conn.execute(
            """SELECT extract(epoch FROM clock_timestamp() - r.created_at)::float8 AS age_s,
                      CASE WHEN jsonb_typeof(r.spec->'spec'->'activeDeadlineSeconds') = 'number'
                           THEN (r.spec->'spec'->>'activeDeadlineSeconds')::float8 END AS deadline_s,
                      q.requested_by, q.requested_at
               FROM agentfast_runs r LEFT JOIN agentfast_cancel_requests q ON q.run_id = r.run_id
               WHERE r.run_id = %s""",
            (run_id,),
        ).fetchone()
        if row is None:
            return None
        return decisions_closed(
            phase=status.phase,
            phase_reason=status.reason,
            cancel_by=row["requested_by"],
            cancel_at=row["requested_at"],
            age_s=row["age_s"],
            deadline_s=row["deadline_s"],
        )

    def decisions_closed(self, run_id: str) -> DecisionsClosed | None:
        """Why the run ``run_id`` can use no decision any more (it has ended, a cancel was asked
        for, it is past ``spec.activeDeadlineSeconds``: :func:`.decisions.decisions_closed`), or
        None when it still can, or has no checkpoint (or no run). What :meth:`decide` refuses
        with and what status shows. Raises UnreadableState, StoreUnavailable."""

        def op(conn: psycopg.Connection[DictRow]) -> DecisionsClosed | None:
            row = self._latest_context(conn, run_id)
            if row is None:
                return None
            return self._closed(conn, run_id, decode_snapshot(run_id, row, []).context.status)

        return self._retry(op)

    def run_clock(self, run_id: str) -> tuple[float, float | None] | None:
        """``(age_s, deadline_s)`` of the run: seconds since it was registered (the database's
        clock) and its ``spec.activeDeadlineSeconds`` (None: none); None for no such run."""
        row = self._read(
            """SELECT extract(epoch FROM clock_timestamp() - created_at)::float8 AS age_s,
                      CASE WHEN jsonb_typeof(spec->'spec'->'activeDeadlineSeconds') = 'number'
                           THEN (spec->'spec'->>'activeDeadlineSeconds')::float8 END AS deadline_s
               FROM agentfast_runs WHERE run_id = %s""",
            (run_id,),
        )
        return None if row is None else (row["age_s"], row["deadline_s"])

    def awaiting(self, run_id: str) -> list[AwaitedCall]:
        """The calls of a run awaiting a human decision now, in the model's order.

        Those the latest checkpoint's ``pending`` lists (the run paused on them) and that have
        no decision yet. Empty when the run is not paused, or every awaited call is decided
        (then a runner, or a resume, goes on). Status, the operator and :meth:`decide` use it.
        """
        return self._retry(lambda c: self._awaiting(c, run_id))

    @staticmethod
    def _not_awaiting(conn: psycopg.Connection[DictRow], run_id: str, call_id: str, awaiting: list[AwaitedCall]) -> str:
        """Why ``call_id`` awaits no decision: one sentence, then what does await one."""
        base, sep, rerun = call_id.rpartition("-rerun")
        row = conn.execute(
            "SELECT tool_name, gated, idempotent, state FROM agentfast_tool_calls WHERE run_id = %s AND call_id = %s",
            (run_id, base if sep and rerun.isdigit() else call_id),
        ).fetchone()
        if row is None:
            why = "the run has no such tool call (yet)"
        elif sep and rerun.isdigit():
            why = (
                f"{row['tool_name']} is idempotent: an interrupted call is re-run with its key, never asked about"
                if row["idempotent"]
                else f"it is not an interrupted call of {base} that awaits a human"
            )
        elif row["state"] == "done":
            why = f"it is finished ({row['tool_name']})"
        elif not row["gated"]:
            why = f"{row['tool_name']} needs no approval"
        else:
            why = "the run has not paused on it"
        now = (
            f"awaiting a decision now: {', '.join(a.call_id for a in awaiting)}"
            if awaiting
            else "no call of this run awaits a decision now"
        )
        return f"{call_id} of run {run_id} does not await a decision: {why}; {now}"

    def get_decision(self, run_id: str, call_id: str) -> Decision | None:
        """The decision recorded for ``call_id``, or None."""
        return self.get_decisions(run_id, [call_id]).get(call_id)

    def get_decisions(self, run_id: str, call_ids: list[str]) -> dict[str, Decision]:
        """The decisions recorded for any of ``call_ids``, by call id (undecided ones absent)."""
        return self._retry(lambda c: self._decisions(c, run_id, call_ids))

    def notify_token(self, run_id: str) -> str | None:
        """The payload of ``run_id``'s notifications on ``agentfast_progress`` and
        ``agentfast_approval`` (32 hex digits, random per run; None: no such run, or not this
        role's to see). A payload never names a run: any session may LISTEN on any channel, and
        only the run's namespace and the owner can tell whose token this is (migration 16)."""
        row = self._read("SELECT notify_token FROM agentfast_runs WHERE run_id = %s", (run_id,))
        return None if row is None else str(row["notify_token"])

    def runs_for_tokens(self, tokens: Collection[str]) -> dict[str, str]:
        """The runs that notification payloads ``tokens`` stand for: token -> run id, for the
        tokens of runs this role can see (unknown ones are left out). One indexed read."""
        rows = self._read(
            "SELECT notify_token, run_id FROM agentfast_runs WHERE notify_token = ANY(%s)", (list(tokens),), all=True
        )
        return {r["notify_token"]: r["run_id"] for r in rows}

    def wait_for_decision(self, run_id: str, call_id: str, stop: threading.Event, *, poll_s: float = 30.0) -> Decision | None:
        """Block until the call is decided or ``stop`` is set (then None)."""
        got = self.wait_for_decisions(run_id, [call_id], stop, poll_s=poll_s)
        return got[call_id] if got is not None else None

    def wait_for_decisions(
        self,
        run_id: str,
        call_ids: list[str],
        stop: threading.Event,
        *,
        poll_s: float = 30.0,
        until: float | None = None,
    ) -> dict[str, Decision] | None:
        """Block until every one of ``call_ids`` is decided (returns them by id), or return None
        when ``stop`` is set, the run has a cancel request (:meth:`request_cancel`), or
        ``time.monotonic()`` reaches ``until`` (a deadline; None: none). The caller tells which.

        LISTENs on ``agentfast_approval`` on a dedicated autocommit connection and re-reads the
        decisions and the cancel request after every wake-up (a decision or a cancel request of
        this run NOTIFYs it) and at least every ``poll_s`` seconds. A dropped connection is
        re-opened with backoff; a decision or request made meanwhile is found by the re-read.
        """
        delay = 0.2

        def late() -> bool:
            return until is not None and time.monotonic() >= until

        def read(conn: psycopg.Connection[DictRow]) -> tuple[dict[str, Decision], bool]:
            ends = self._end_requests(conn, run_id)
            return self._decisions(conn, run_id, call_ids), ends is not None and ends.cancel is not None

        token = self.notify_token(run_id)  # what this run's notifications carry (never its id)

        while not stop.is_set() and not late():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {APPROVAL_CHANNEL}")
                    delay = 0.2
                    woke, last_read = True, 0.0  # read once right after LISTEN: nothing can slip between
                    while not stop.is_set() and not late():
                        if woke or time.monotonic() - last_read >= poll_s:
                            decided, cancelled = self._retry(read)
                            last_read = time.monotonic()
                            if len(decided) == len(set(call_ids)):
                                return decided
                            if cancelled:
                                return None
                        woke = False
                        for note in conn.notifies(timeout=0.5, stop_after=1):
                            woke = note.payload == token
            except psycopg.OperationalError:
                stop.wait(delay)
                delay = min(delay * 2, 5.0)
        return None


class _StorableStrDumper(StrDumperUnknown):
    """The default ``str`` dumper (text format, unknown oid), after :func:`storable_text`."""

    def dump(self, obj: str) -> bytes | bytearray | memoryview | None:
        return super().dump(storable_text(obj))


class _StorableStrBinaryDumper(StrBinaryDumper):
    """The binary ``str`` dumper (text oid), after :func:`storable_text`."""

    def dump(self, obj: str) -> bytes | bytearray | memoryview | None:
        return super().dump(storable_text(obj))


def _quoted(text: str | None, limit: int = 60) -> str:
    """``text`` on one line in quotes, cut to ``limit`` characters (for a refusal's message)."""
    flat = " ".join((text or "").split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")


def _counted(ctx: RunContext, row: dict[str, Any]) -> RunContext:
    """``ctx`` (a checkpoint's, whose usage counts the turns up to ``ctx.turns_accounted``) with
    what the run has spent since added to its usage, from a :meth:`Store._latest_context` row:
    each turn saved after it (a runner counts one when it resumes) and every lost reply."""
    prompt, completion = int(row["lost_prompt"]), int(row["lost_completion"])
    for iteration, p, c in row["later_turns"]:
        if iteration > ctx.turns_accounted:
            prompt, completion = prompt + p, completion + c
    if prompt or completion or row["lost_count"]:
        ctx.usage = ctx.usage.plus(prompt, completion, int(row["lost_count"]))
    return ctx


def _storable_json_dumps(obj: Any) -> str:
    # The walk in storable() costs more than the encoding: do it only when the text shows a
    # NUL (escaped) or a lone surrogate (kept as is with ensure_ascii=False). A false alarm (a
    # literal backslash-u0000 in the text) only takes the slow path.
    text = json.dumps(obj, ensure_ascii=False)
    if "\\u0000" in text or SURROGATE.search(text):
        text = json.dumps(storable(obj), ensure_ascii=False)
    return text


def _stored_json(model: M, **dump: Any) -> tuple[M, str]:
    """``model`` as the store writes it (:func:`_stored_form`) and its JSON text
    (``model_dump_json(**dump)``). The quick way when there is nothing to replace: pydantic's
    serializer refuses any surrogate and escapes NUL as ``\\u0000``, so only a model whose text
    shows either is walked (a literal backslash-u0000 is a harmless false alarm)."""
    try:
        text = model.model_dump_json(**dump)
        if "\\u0000" not in text:
            return model, text
    except pydantic_core.PydanticSerializationError:
        pass
    model = _stored_form(model)
    return model, model.model_dump_json(**dump)


def _stored_form(model: M) -> M:
    """``model`` as the store writes it: the same object if nothing in it needs replacing,
    else a copy whose strings are made storable (:func:`storable`)."""
    dumped = model.model_dump(mode="json")
    clean = storable(dumped)
    return model if clean is dumped else type(model).model_validate(clean)


def _configure(conn: psycopg.Connection[DictRow], idle_in_transaction_timeout_s: float) -> None:
    """Session settings of every pooled connection (the pool's ``configure`` hook).

    Registers the storable dumpers: every ``str`` parameter and every ``Json``/``Jsonb`` value
    this connection sends has NUL and lone surrogates replaced (:mod:`.storable`).
    """
    conn.adapters.register_dumper(str, _StorableStrDumper)
    conn.adapters.register_dumper(str, _StorableStrBinaryDumper)
    conn.adapters.register_dumper(str, _StorableStrDumper)  # the last one registered is the default (text format)
    set_json_dumps(_storable_json_dumps, context=conn)
    conn.autocommit = True
    conn.execute(
        "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
        (str(max(1, int(idle_in_transaction_timeout_s * 1000))),),
    )
    pin_search_path(conn)
    # Left in autocommit: a lone read then costs no BEGIN/COMMIT round trips (Store._read);
    # Store._retry opens its transactions explicitly (conn.transaction()).


def pin_search_path(conn: psycopg.Connection[Any]) -> None:
    """Drop ``"$user"`` from this session's search_path (the rest, the DSN's or the server's
    default, stays), so the store's table names never resolve in the login role's own schema:
    releases before the tool host gave each runner role a schema of its name for its tools'
    tables, and an ``agentfast_approvals`` made there must never be what a runner reads. Call on
    an autocommit connection (or inside a transaction)."""
    path = _one(conn.cursor(row_factory=tuple_row).execute("SELECT current_setting('search_path')").fetchone())[0]
    entries = [e.strip() for e in path.split(",")]
    kept = [e for e in entries if e and e not in ('"$user"', "$user")]
    conn.execute("SELECT set_config('search_path', %s, false)", (", ".join(kept) or "public",))


DSN_FORMS = (
    "a libpq URI (postgresql://USER:PASSWORD@HOST:PORT/DBNAME?OPTION=VALUE, with reserved "
    "characters such as @ : / ? # % and spaces percent-encoded) or a key=value string "
    "(host=HOST port=PORT dbname=DBNAME user=USER password=PASSWORD, a value with spaces or "
    "quotes in single quotes, \\' for a quote)"
)
# Options libpq reads as integers at connect time (its error then quotes the value).
_INT_OPTIONS = (
    "port",
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
_HOST_NAME = re.compile(r"[A-Za-z0-9_.:%-]+\Z")  # a DNS name (compose-style _ too), IPv4, or IPv6 (zone after %)


def parse_dsn(dsn: str) -> dict[str, str]:
    """The DSN's options as libpq parses them (``{"host": ..., "password": ..., ...}``, options
    given with no value left out), checked beyond libpq's own parse: every ``host`` (comma
    separated) is empty, a socket directory (``/...``), an abstract socket (``@...``) or a host
    name/IP address; every ``hostaddr`` an address; ``port`` and the other integer options digits.
    Those checks catch a password whose unencoded ``@`` or ``/`` pushed part of it into the host or
    port, which a connection error would then quote. An empty DSN parses to ``{}`` (libpq's
    defaults). No connection is made.

    Raises :class:`InvalidDsn` (quoting none of the DSN, chaining no libpq error) otherwise.
    """
    info: dict[str, str] | None = None
    reason = "libpq cannot parse it"
    if isinstance(dsn, str) and "\x00" not in dsn:
        try:
            info = {k: str(v) for k, v in psycopg.conninfo.conninfo_to_dict(dsn).items() if v is not None}
        except (psycopg.Error, ValueError, TypeError, UnicodeError):
            info = None
    if info is not None:
        for opt in _INT_OPTIONS:
            parts = info.get(opt, "").split(",") if opt == "port" else [info.get(opt, "")]
            if not all(p.strip() == "" or (p.strip().isascii() and p.strip().isdigit()) for p in parts):
                info, reason = None, f"its {opt} is not a number"
                break
    if info is not None:
        for opt in ("host", "hostaddr"):
            for part in info.get(opt, "").split(","):
                part = part.strip()
                ok = not part or _HOST_NAME.match(part) is not None or (opt == "host" and part[0] in "/@")
                if not ok:
                    info, reason = None, f"its {opt} is not a host name, address or socket directory"
                    break
            if info is None:
                break
    if info is None:  # raised outside any except block: no libpq message rides along as __context__
        raise InvalidDsn(
            f"the Postgres DSN is not valid ({reason}; its text is not shown: it may hold a password). Expected {DSN_FORMS}"
        )
    return info


def redact_dsn(dsn: str) -> str:
    """The one form in which a DSN appears in a message or a log line: its parsed options as JSON
    (sorted keys) with ``password`` and ``sslpassword`` replaced by ``***``, e.g.
    ``{"dbname": "postgres", "host": "db", "password": "***", "user": "agentfast"}``; a DSN that
    :func:`parse_dsn` refuses becomes ``(an invalid DSN, not shown)``. Never raises."""
    try:
        info = parse_dsn(dsn)
    except InvalidDsn:
        return "(an invalid DSN, not shown)"
    for secret in ("password", "sslpassword"):
        if info.get(secret):
            info[secret] = "***"
    return json.dumps(info, sort_keys=True)


_redact = redact_dsn  # the store's own short name for it
