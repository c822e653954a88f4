"""Tools for the chaos suite (tests/chaos/): effects a test can count from rows, never mocks.

Every body writes to the examples' own database (``EXAMPLE_TOOLS_DSN``:
``agentfast.runner.examples``), never the run's store, in tables of its own:

- ``chaos_invocations``: one row each time a tool body starts, with the call's idempotency key,
  the runner's fencing epoch and its pid. Keyed by nothing, so every execution is visible.
- ``chaos_ledger``: the effect of an idempotent tool, keyed by the idempotency key (a re-run with
  the same key cannot apply it twice, like a payment API's ``Idempotency-Key``).
- ``chaos_outbox``: the effect of the non-idempotent ``chaos_notify`` ("an email was sent"): one
  row per execution, keyed by nothing. Two rows with one key are a duplicated effect.
  ``chaos_notify`` is a service that accepts a fencing token (``ToolContext.epoch``): it refuses a
  send from a runner whose epoch is no longer the run's (it learns the current one from
  ``run_epoch``, the one function of the store its role may call), so a paused zombie that wakes up inside
  the call cannot send after its successor did (fencing the runtime's own writes, G6, cannot stop
  an effect already in flight in a tool; only the tool's service can).

Results are deterministic functions of the arguments and the key, so a resumed run's transcript
can be compared with an uninterrupted one's. ``work_ms`` makes a call take that long (half
before its effect, half after), so a kill at a random time can land inside a tool.

Each body retries its own connection for up to a minute: the chaos suite restarts Postgres under
running tools, and a tool that gave up would put a connection error in the transcript (a correct
outcome, but not the one the comparison with an uninterrupted run expects).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from typing import Any

import psycopg

from agentfast.runner.examples import examples_dsn
from agentfast.runner.tools import ToolContext, tool

_DDL = """
CREATE TABLE IF NOT EXISTS chaos_invocations (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tool text NOT NULL,
    idempotency_key text NOT NULL,
    call_id text NOT NULL,
    epoch bigint NOT NULL,
    pid integer NOT NULL,
    execution uuid NOT NULL UNIQUE,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_ledger (
    idempotency_key text PRIMARY KEY,
    tool text NOT NULL,
    payload jsonb NOT NULL,
    epoch bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key text NOT NULL,
    execution uuid NOT NULL UNIQUE,
    tool text NOT NULL,
    payload jsonb NOT NULL,
    epoch bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

_RETRY_FOR_S = 60.0


def _connect(ctx: ToolContext) -> psycopg.Connection:
    deadline = time.monotonic() + _RETRY_FOR_S
    delay = 0.1
    while True:
        try:
            conn = psycopg.connect(examples_dsn(), autocommit=True, connect_timeout=5)
            # A frozen runner (the zombie tests SIGSTOP them) must not hold the DDL lock for ever.
            conn.execute("SET idle_in_transaction_session_timeout = '5s'")
            exists = conn.execute("SELECT to_regclass('chaos_outbox')").fetchone()
            if exists is None or exists[0] is None:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentfast_chaos_ddl'))")
                    conn.execute(_DDL)
            return conn
        except psycopg.OperationalError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _write(ctx: ToolContext, sql: str, params: tuple[Any, ...]) -> None:
    """One autocommit statement, retried over a new connection when Postgres goes away.

    Every statement here is safe to repeat: the ledger row is keyed by the idempotency key; the
    invocation and outbox rows by ``execution``, a token drawn once per execution of a tool body,
    so a client retry of one execution cannot look like a second execution to the suite.
    """
    deadline = time.monotonic() + _RETRY_FOR_S
    delay = 0.1
    while True:
        try:
            with _connect(ctx) as conn:
                conn.execute(sql, params)
            return
        except psycopg.OperationalError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _begin(ctx: ToolContext, name: str, work_ms: int) -> str:
    """Log this execution; returns its token."""
    execution = str(uuid.uuid4())
    _write(
        ctx,
        """INSERT INTO chaos_invocations (tool, idempotency_key, call_id, epoch, pid, execution)
           VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (execution) DO NOTHING""",
        (name, ctx.idempotency_key, ctx.call_id, ctx.epoch, os.getpid(), execution),
    )
    time.sleep(max(0, work_ms) / 2000)
    return execution


def _end(work_ms: int) -> None:
    time.sleep(max(0, work_ms) / 2000)


def _ledger(ctx: ToolContext, name: str, payload: dict[str, Any]) -> None:
    _write(
        ctx,
        "INSERT INTO chaos_ledger (idempotency_key, tool, payload, epoch) VALUES (%s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
        (ctx.idempotency_key, name, json.dumps(payload, sort_keys=True), ctx.epoch),
    )


def _sent(ctx: ToolContext, execution: str) -> bool:
    deadline = time.monotonic() + _RETRY_FOR_S
    while True:
        try:
            with _connect(ctx) as conn:
                return conn.execute("SELECT 1 FROM chaos_outbox WHERE execution = %s", (execution,)).fetchone() is not None
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _digest(*parts: object) -> int:
    return int(hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:6], 16)


@tool
def chaos_read(ctx: ToolContext, item: str, work_ms: int = 0) -> dict[str, Any]:
    """Read the stock level of an item (no effect)."""
    _begin(ctx, "chaos_read", work_ms)
    _end(work_ms)
    return {"item": item, "in_stock": _digest(item) % 100}


@tool
def chaos_write(ctx: ToolContext, item: str, qty: int, work_ms: int = 0) -> dict[str, Any]:
    """Reserve qty units of an item (an idempotent effect, keyed by the idempotency key)."""
    _begin(ctx, "chaos_write", work_ms)
    _ledger(ctx, "chaos_write", {"item": item, "qty": qty})
    _end(work_ms)
    return {"reserved": item, "qty": qty, "reservation": ctx.idempotency_key}


@tool(requires_approval=True)
def chaos_pay(ctx: ToolContext, account: str, cents: int, work_ms: int = 0) -> dict[str, Any]:
    """Pay an account (gated: a human approves each call; idempotent by key)."""
    _begin(ctx, "chaos_pay", work_ms)
    _ledger(ctx, "chaos_pay", {"account": account, "cents": cents})
    _end(work_ms)
    return {"payment_id": ctx.idempotency_key, "account": account, "cents": cents, "status": "paid"}


@tool(idempotent=False)
def chaos_notify(ctx: ToolContext, to: str, text: str, work_ms: int = 0) -> dict[str, Any]:
    """Send a notification (NOT idempotent: every execution sends one more)."""
    execution = _begin(ctx, "chaos_notify", work_ms)
    # The send and the fencing-token check in one statement: a stale epoch sends nothing.
    _write(
        ctx,
        """INSERT INTO chaos_outbox (idempotency_key, execution, tool, payload, epoch)
           SELECT %s, %s, %s, %s, %s WHERE run_epoch(%s) = %s
           ON CONFLICT (execution) DO NOTHING""",
        (
            ctx.idempotency_key,
            execution,
            "chaos_notify",
            json.dumps({"to": to, "text": text}, sort_keys=True),
            ctx.epoch,
            ctx.run_id,
            ctx.epoch,
        ),
    )
    if not _sent(ctx, execution):
        raise RuntimeError(f"fencing token {ctx.epoch} is stale: another runner owns run {ctx.run_id}; nothing was sent")
    _end(work_ms)
    return {"sent": True, "to": to}
