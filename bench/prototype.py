"""A what-if, not the product: ``Store.commit_checkpoint``'s statements sent as one pipeline.

``Store.commit_checkpoint`` (runner/store.py) spends most of its wall time waiting on ~10
sequential client/server round trips: the pool's health check, BEGIN, set_config, the
idempotency SELECT, the message INSERTs, the checkpoint INSERT, the retention DELETE, pg_notify,
COMMIT. This function writes the same rows with the same fencing, retention and notification in
one transaction, but queues every statement in psycopg's pipeline mode so the client waits for
the server about twice (the results, then COMMIT) and skips the per-checkout health check. The
idempotent retry of a lost acknowledgement is kept by ``ON CONFLICT (run_id, checkpoint_key) DO
NOTHING``. It exists to measure what the store's design could reach (docs/benchmarks.md); it is
not used by the runtime.
"""

from __future__ import annotations

import uuid

import psycopg
from psycopg.types.json import Jsonb

from agentfast.runner.snapshot import StateSnapshot
from agentfast.runner.store import PROGRESS_CHANNEL, Lease


def pipelined_commit(
    conn: psycopg.Connection, lease: Lease, snapshot: StateSnapshot, *, stored_messages: int, retention_keep: int = 20
) -> int | None:
    key = uuid.uuid4()
    iteration = snapshot.context.counters.iterations
    new = snapshot.messages[stored_messages:]
    context = snapshot.context.model_dump(mode="json")
    pending = snapshot.pending.model_dump(mode="json") if snapshot.pending else None
    with conn.pipeline():
        with conn.transaction():
            conn.execute(
                "SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', %s, true)",
                (str(lease.epoch), lease.run_uid),
            )
            if new:
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch) VALUES (%s, %s, %s, %s, 0)",
                        [
                            (
                                snapshot.run_id,
                                stored_messages + i,
                                iteration,
                                Jsonb(m.model_dump(mode="json", exclude_defaults=True)),
                            )
                            for i, m in enumerate(new)
                        ],
                    )
            cp = conn.execute(
                """INSERT INTO agentfast_checkpoints (run_id, checkpoint_key, iteration, message_count, phase, schema_version,
                                                      context, pending, sdk_state, saved_at, epoch)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0)
                   ON CONFLICT (run_id, checkpoint_key) DO NOTHING RETURNING checkpoint_id""",
                (
                    snapshot.run_id,
                    key,
                    iteration,
                    len(snapshot.messages),
                    snapshot.context.status.phase,
                    snapshot.schema_version,
                    Jsonb(context),
                    Jsonb(pending) if pending is not None else None,
                    Jsonb(snapshot.sdk_state),
                    snapshot.saved_at,
                ),
            )
            conn.execute(
                """DELETE FROM agentfast_checkpoints WHERE run_id = %s AND checkpoint_id <
                       (SELECT checkpoint_id FROM agentfast_checkpoints WHERE run_id = %s
                        ORDER BY checkpoint_id DESC OFFSET %s LIMIT 1)""",
                (snapshot.run_id, snapshot.run_id, retention_keep - 1),
            )
            conn.execute("SELECT pg_notify(%s, %s)", (PROGRESS_CHANNEL, snapshot.run_id))
    row = cp.fetchone()
    return row[0] if row else None
