"""The refund demo's tools: a support agent looks up an order and refunds a duplicate charge.

They keep real records so tests count effects from rows, not mocks, in the examples' own database
(``EXAMPLE_TOOLS_DSN``: ``runner/examples/__init__.py``), never the run's store:

- ``demo_refund_ledger``: one row per refund, keyed by the idempotency key (a re-run with the same
  key cannot refund twice; this is how a payment API's ``Idempotency-Key`` behaves).
- ``demo_case_notes``: one row per note, keyed the same way.
- ``demo_tool_invocations``: one row every time a tool body actually runs, keyed by nothing, so a
  duplicated execution is visible even where the ledger's key absorbed it.

``issue_refund`` declares a recovery check: when a runner died while the refund was in flight,
the runtime asks the ledger (by the call's idempotency key) whether the refund happened before
running the body again or asking a human; if it did, the call is recorded done with the
refund the ledger holds.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ..tools import Recovery, ToolContext, tool
from . import examples_dsn

_DDL = """
CREATE TABLE IF NOT EXISTS demo_refund_ledger (
    idempotency_key text PRIMARY KEY,
    order_id text NOT NULL,
    amount_cents integer NOT NULL CHECK (amount_cents > 0),
    reason text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS demo_case_notes (
    idempotency_key text PRIMARY KEY,
    order_id text NOT NULL,
    note text NOT NULL
);
CREATE TABLE IF NOT EXISTS demo_tool_invocations (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tool text NOT NULL,
    idempotency_key text NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
);
"""

_ORDERS = {
    "A-1042": {
        "order_id": "A-1042",
        "customer": "Dana Ruiz",
        "total_cents": 4999,
        "charges": [4999, 4999],
        "status": "delivered",
    },
}


def _connect(ctx: ToolContext) -> psycopg.Connection:
    conn = psycopg.connect(examples_dsn(), autocommit=True)
    # Serialised by an advisory lock: concurrent first calls would race on CREATE TABLE IF NOT EXISTS.
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentfast_demo_ddl'))")
        conn.execute(_DDL)
    return conn


def _log_invocation(conn: psycopg.Connection, name: str, ctx: ToolContext) -> None:
    conn.execute("INSERT INTO demo_tool_invocations (tool, idempotency_key) VALUES (%s, %s)", (name, ctx.idempotency_key))


@tool
def lookup_order(ctx: ToolContext, order_id: str) -> dict[str, Any]:
    """Look up an order by id: customer, total and the charges made (amounts in cents)."""
    with _connect(ctx) as conn:
        _log_invocation(conn, "lookup_order", ctx)
    order = _ORDERS.get(order_id)
    if order is None:
        return {"error": f"no order {order_id}"}
    return order


@tool(requires_approval=True)
def issue_refund(ctx: ToolContext, order_id: str, amount_cents: int, reason: str) -> dict[str, Any]:
    """Refund part of an order to the customer's card. Amount in cents. Needs a human's approval."""
    with _connect(ctx) as conn:
        _log_invocation(conn, "issue_refund", ctx)
        conn.execute(
            """INSERT INTO demo_refund_ledger (idempotency_key, order_id, amount_cents, reason)
               VALUES (%s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING""",
            (ctx.idempotency_key, order_id, amount_cents, reason),
        )
        # Like a payment API's Idempotency-Key: a repeat returns the original refund, unchanged.
        refund = _refund_of(conn, ctx)
    assert refund is not None
    return refund


def _refund_of(conn: psycopg.Connection, ctx: ToolContext) -> dict[str, Any] | None:
    """The refund the ledger holds for this call's idempotency key, as issue_refund returns it."""
    row = conn.execute(
        "SELECT order_id, amount_cents FROM demo_refund_ledger WHERE idempotency_key = %s", (ctx.idempotency_key,)
    ).fetchone()
    if row is None:
        return None
    return {"refund_id": ctx.idempotency_key, "order_id": row[0], "refunded_cents": row[1], "status": "succeeded"}


@issue_refund.recovery_check
def issue_refund_happened(ctx: ToolContext) -> Recovery:
    """Did the interrupted refund reach the ledger? Then it is done with that refund; else it did not happen."""
    with _connect(ctx) as conn:
        refund = _refund_of(conn, ctx)
    return Recovery.happened(refund) if refund is not None else Recovery.not_happened()


@tool
def add_case_note(ctx: ToolContext, order_id: str, note: str) -> dict[str, Any]:
    """Add an internal note to the support case of an order."""
    with _connect(ctx) as conn:
        _log_invocation(conn, "add_case_note", ctx)
        conn.execute(
            "INSERT INTO demo_case_notes (idempotency_key, order_id, note) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
            (ctx.idempotency_key, order_id, note),
        )
    return {"ok": True}
