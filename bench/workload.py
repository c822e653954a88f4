"""The benchmark's workload: realistic messages and runs prefilled to a transcript length.

One iteration of a tool-calling agent appends three messages: the assistant's reply with two tool
calls, and the two tool results (~300 bytes of content each, about what an order lookup or a
search hit returns). A prefilled run looks like a run that got there by iterating: its transcript,
its journal (two calls per iteration) and its retained checkpoints are in the tables.
"""

from __future__ import annotations

import functools
import json
import random
import string
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from agentfast.runner.snapshot import Message, RunContext, RunStatus, Session, StateSnapshot, ToolCall, ToolResult
from agentfast.runner.store import Lease, Store

TOOL_RESULT_BYTES = 300


_ALPHABET = string.ascii_lowercase + string.digits + "      "


def _result_text(it: int, pos: int) -> str:
    """~300 B of JSON whose free text is pseudo-random (seeded per call), so that Postgres's
    compression gets no more out of it than out of real tool output (a repeated filler would
    compress ~50x and flatter every subject that stores the transcript again)."""
    body = {
        "order_id": f"A-{1000 + it}",
        "position": pos,
        "customer": "Dana Ruiz",
        "status": "delivered",
        "charges": [4999, 4999],
        "note": "",
    }
    raw = json.dumps(body)
    body["note"] = _note(it % 97, pos)[: max(0, TOOL_RESULT_BYTES - len(raw))]
    return json.dumps(body)


@functools.cache
def _note(seed: int, pos: int) -> str:
    rng = random.Random(seed * 16 + pos)
    return "".join(rng.choice(_ALPHABET) for _ in range(TOOL_RESULT_BYTES))


def assistant_message(it: int) -> Message:
    return Message(
        role="assistant",
        content="Let me look that order up and note it on the case.",
        tool_calls=[
            ToolCall(id=f"call_{it}_0", name="lookup_order", arguments=json.dumps({"order_id": f"A-{1000 + it}"})),
            ToolCall(
                id=f"call_{it}_1",
                name="add_case_note",
                arguments=json.dumps({"order_id": f"A-{1000 + it}", "note": "Customer asked about a duplicate charge."}),
            ),
        ],
    )


def tool_message(it: int, pos: int) -> Message:
    name = "lookup_order" if pos == 0 else "add_case_note"
    return Message(role="tool", content=_result_text(it, pos), tool_call_id=f"call_{it}_{pos}", name=name)


def iteration_messages(it: int) -> list[Message]:
    """The three messages one iteration appends."""
    return [assistant_message(it), tool_message(it, 0), tool_message(it, 1)]


def transcript(n: int) -> list[Message]:
    """A transcript of exactly ``n`` messages: system, user, then iterations of three."""
    msgs = [
        Message(role="system", content="You are a support agent for an online shop. Look up the order before acting."),
        Message(role="user", content="Hi, I was charged twice for order A-1042. Please refund the duplicate charge."),
    ]
    it = 0
    while len(msgs) < n:
        it += 1
        msgs.extend(iteration_messages(it))
    return msgs[:n]


def context_for(run_uid: str, iterations: int) -> RunContext:
    ctx = RunContext(session=Session(run_uid=run_uid, model="bench-model"), status=RunStatus(phase="Running"))
    ctx.budget.max_iterations = 100_000
    ctx.budget.max_tokens = 10**9
    ctx.counters.iterations = iterations
    ctx.counters.model_calls = iterations
    ctx.counters.tool_calls = 2 * iterations
    ctx.usage.prompt_tokens = 900 * iterations
    ctx.usage.completion_tokens = 100 * iterations
    ctx.usage.total_tokens = 1000 * iterations
    ctx.turns_accounted = iterations
    return ctx


class Prefiller:
    """Creates runs whose tables look like ``n`` messages' worth of iterations.

    The transcript template is written once per length into ``bench_template``; each run copies
    it server-side (fast even at 10,000 messages). Journal rows (two per iteration) and the
    retained checkpoints are generated the same way.
    """

    def __init__(self, store: Store, dsn: str):
        self.store = store
        self.dsn = dsn
        self._templates: set[int] = set()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS bench_template (n integer, seq integer, iteration integer, message jsonb, "
                "PRIMARY KEY (n, seq))"
            )

    def _template(self, n: int) -> None:
        if n in self._templates:
            return
        with psycopg.connect(self.dsn) as conn:
            if conn.execute("SELECT 1 FROM bench_template WHERE n = %s LIMIT 1", (n,)).fetchone():
                self._templates.add(n)
                return
        rows = [
            (n, i, max(0, (i - 2) // 3 + 1), Jsonb(m.model_dump(mode="json", exclude_defaults=True)))
            for i, m in enumerate(transcript(n))
        ]
        with psycopg.connect(self.dsn) as conn, conn.cursor() as cur:
            with cur.copy("COPY bench_template (n, seq, iteration, message) FROM STDIN") as copy:
                for r in rows:
                    copy.write_row(r)
        self._templates.add(n)

    def make_run(self, n: int, *, journal: bool = False, keep_checkpoints: int = 20) -> tuple[Lease, StateSnapshot]:
        """A run with ``n`` stored messages and its latest checkpoints; returns its lease and snapshot."""
        self._template(n)
        run_id = f"bench/{uuid.uuid4().hex[:12]}"
        uid = str(uuid.uuid4())
        self.store.create_run(run_id, uid, {"bench": True})
        lease = self.store.acquire_lease(run_id)
        iterations = max(0, (n - 2 + 2) // 3)
        ctx = context_for(uid, iterations)
        with psycopg.connect(self.dsn) as conn:
            conn.execute(
                "SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', %s, true)",
                (str(lease.epoch), lease.run_uid),
            )
            conn.execute(
                "INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch) "
                "SELECT %s, seq, iteration, message, 0 FROM bench_template WHERE n = %s",
                (run_id, n),
            )
            if journal and iterations:
                conn.execute(
                    """INSERT INTO agentfast_tool_calls (run_id, iteration, position, call_id, idempotency_key, tool_call_id,
                           tool_name, arguments, gated, idempotent, state, attempts, result, epoch)
                       SELECT %(r)s, i, p, 'call-' || i || '-' || p, %(u)s || ':' || i || ':' || p, 'call_' || i || '_' || p,
                              'lookup_order', '{"order_id": "A-1042"}', false, true, 'done', 1,
                              jsonb_build_object('call_id', 'call-' || i || '-' || p, 'position', p,
                                                 'tool_call_id', 'call_' || i || '_' || p, 'tool_name', 'lookup_order',
                                                 'content', repeat('x', %(b)s), 'idempotency_key', %(u)s || ':' || i || ':' || p), 0
                       FROM generate_series(1, %(it)s) i, generate_series(0, 1) p""",
                    {"r": run_id, "u": uid, "it": iterations, "b": TOOL_RESULT_BYTES},
                )
            ctx_json = Jsonb(ctx.model_dump(mode="json"))
            conn.execute(
                """INSERT INTO agentfast_checkpoints (run_id, checkpoint_key, iteration, message_count, phase, schema_version,
                                                      context, pending, sdk_state, saved_at, epoch)
                   SELECT %s, gen_random_uuid(), %s - %s + g, %s, 'Running', 1, %s, NULL, '{}', 0, 0
                   FROM generate_series(1, %s) g""",
                (run_id, iterations, keep_checkpoints, n, ctx_json, keep_checkpoints),
            )
        snap = StateSnapshot(run_id=run_id, context=ctx, messages=transcript(n))
        return lease, snap


def advance(snap: StateSnapshot) -> int:
    """Append one iteration's three messages to ``snap``; returns how many were stored before."""
    stored = len(snap.messages)
    it = snap.context.counters.iterations + 1
    snap.messages.extend(iteration_messages(it))
    c = snap.context.counters
    c.iterations = it
    c.model_calls += 1
    c.tool_calls += 2
    snap.context.usage.total_tokens += 1000
    return stored


def tool_result(uid: str, it: int, pos: int) -> ToolResult:
    m = tool_message(it, pos)
    return ToolResult(
        call_id=f"call-{it}-{pos}",
        position=pos,
        tool_call_id=m.tool_call_id or "",
        tool_name=m.name or "",
        content=m.content or "",
        idempotency_key=f"{uid}:{it}:{pos}",
    )


def message_bytes(m: Message) -> int:
    return len(json.dumps(m.model_dump(mode="json", exclude_defaults=True)))


def describe_iteration() -> dict[str, Any]:
    ms = iteration_messages(1)
    return {"messages": len(ms), "bytes": [message_bytes(m) for m in ms]}
