"""Part 7 (`payloads`): large payloads (issue 15 item 6): a 2 MiB tool output per iteration, stored once.

Three subjects, each in a database of its own on the same server (so its growth is its own),
stepped in rotation inside every repetition (the machine's load hits them at the same moments):

- ``small``: the baseline: the same iteration with a ~300 B tool output.
- ``large``: a 2 MiB output with the store as shipped (threshold 1 MiB): the output goes once into
  ``agentfast_payloads``; the journal, transcript and checkpoint rows hold a reference.
- ``inline``: the same 2 MiB output with the threshold above it: stored inline as before this
  change, in the journal's result and again in the transcript row (jsonb both times).

One iteration is what the vanilla loop writes for one model turn with one tool call, through the
real :class:`~agentfast.runner.store.Store`: ``save_turn_and_mark_started``, ``record_result``,
then ``commit_checkpoint`` of the assistant message and the tool message. Outputs are
pseudo-random hex (a fresh one per iteration), which Postgres's pglz compresses little, as real
output. Measured: the stored bytes of the hot rows an iteration writes (``pg_column_size`` of the
journal, transcript, turn and checkpoint rows), the database's growth over the run
(``pg_database_size``) against the output bytes produced, the wall time of the iteration's store
calls, WAL per iteration, and ``load_snapshot`` of the finished run. Plus the ceiling: a value
over ``max_bytes`` is refused at once (:class:`~agentfast.runner.payloads.PayloadTooLarge`).
"""

from __future__ import annotations

import hashlib
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from agentfast.runner.payloads import Limits, PayloadTooLarge
from agentfast.runner.snapshot import (
    Message,
    RunContext,
    RunStatus,
    Session,
    StateSnapshot,
    ToolCall,
    ToolResult,
    call_id,
    idempotency_key,
)
from agentfast.runner.store import JournalEntry, Lease, Store, Turn

from .pg import wal_lsn
from .stats import Spread

SUBJECTS = ["small", "large", "inline"]
LABELS = {
    "small": "baseline: ~300 B output",
    "large": "2 MiB output, stored once (as shipped)",
    "inline": "2 MiB output, inline (threshold above it)",
}
SMALL_BYTES = 300
HOT = """SELECT (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM agentfast_tool_calls t WHERE run_id = %(r)s AND iteration = %(i)s)
              + (SELECT coalesce(sum(pg_column_size(m.*)), 0) FROM agentfast_messages m WHERE run_id = %(r)s AND iteration = %(i)s)
              + (SELECT coalesce(sum(pg_column_size(u.*)), 0) FROM agentfast_turns u WHERE run_id = %(r)s AND iteration = %(i)s)
              + (SELECT pg_column_size(c.*) FROM agentfast_checkpoints c WHERE run_id = %(r)s ORDER BY checkpoint_id DESC LIMIT 1)"""


@dataclass
class PayloadsConfig:
    payload_bytes: int = 2 << 20
    iterations: int = 3  # per run; one run per subject and repetition
    reps: int = 2


@dataclass
class PayloadsResult:
    config: PayloadsConfig
    write_s: dict[str, list[list[float]]] = field(default_factory=dict)  # per subject, per repetition: seconds per iteration
    hot_bytes: dict[str, list[float]] = field(default_factory=dict)  # per subject: stored bytes of the hot rows, per iteration
    wal_bytes: dict[str, list[float]] = field(default_factory=dict)
    growth_bytes: dict[str, list[float]] = field(default_factory=dict)  # per subject, per repetition: database growth per run
    output_bytes: dict[str, int] = field(default_factory=dict)  # per run
    load_ms: dict[str, list[float]] = field(default_factory=dict)
    ceiling_ms: float = float("nan")
    ceiling_message: str = ""

    def hot_ratio(self) -> float:
        """Hot-row bytes per iteration, 2 MiB output stored once ÷ the small-output baseline (medians)."""
        return statistics.median(self.hot_bytes["large"]) / statistics.median(self.hot_bytes["small"])

    def growth_ratio(self, subject: str) -> Spread:
        """Per repetition: the database's growth over a run ÷ the output bytes the run produced."""
        return Spread.of(g / self.output_bytes[subject] for g in self.growth_bytes[subject])

    def write_ratio(self) -> Spread:
        """Per repetition: p50 write time of a 2 MiB iteration, stored once ÷ inline."""
        return Spread.of(
            statistics.median(a) / statistics.median(b) for a, b in zip(self.write_s["large"], self.write_s["inline"])
        )

    def ok(self) -> bool:
        return self.hot_ratio() <= 1.1 and self.growth_ratio("large").median <= 1.1 and self.write_ratio().median <= 1.0


def _output(size: int, seed: str) -> str:
    return hashlib.shake_256(seed.encode()).hexdigest((size + 1) // 2)[:size]


class _Run:
    """One run of one subject: its store calls, iteration by iteration, as the vanilla loop makes them."""

    def __init__(self, store: Store, size: int):
        self.store, self.size = store, size
        self.run_id = f"bench/{uuid.uuid4().hex[:12]}"
        self.uid = str(uuid.uuid4())
        store.create_run(self.run_id, self.uid, {"bench": True})
        self.lease: Lease = store.acquire_lease(self.run_id)
        ctx = RunContext(session=Session(run_uid=self.uid, model="bench-model"), status=RunStatus(phase="Running"))
        self.snap = StateSnapshot(
            run_id=self.run_id,
            context=ctx,
            messages=[
                Message(role="system", content="You are a research agent."),
                Message(role="user", content="Fetch the report."),
            ],
        )
        store.commit_checkpoint(self.lease, self.snap, stored_messages=0)

    def iteration(self) -> float:
        """One iteration's store calls; returns their wall time in seconds."""
        it = self.snap.context.counters.iterations + 1
        content = _output(self.size, f"{self.run_id}/{it}")  # made before the clock starts: the tool's work
        call = ToolCall(id=f"c{it}", name="fetch_report", arguments='{"page": %d}' % it)
        message = Message(role="assistant", content="Fetching the next page.", tool_calls=[call])
        entry = JournalEntry(
            iteration=it,
            position=0,
            call_id=call_id(it, 0),
            idempotency_key=idempotency_key(self.uid, it, 0),
            tool_call=call,
            gated=False,
            idempotent=True,
            state="planned",
            attempts=0,
            result=None,
        )
        result = ToolResult(
            call_id=entry.call_id,
            position=0,
            tool_call_id=call.id,
            tool_name=call.name,
            content=content,
            idempotency_key=entry.idempotency_key,
        )
        t0 = time.perf_counter()
        turn, _ = self.store.save_turn_and_mark_started(self.lease, Turn(it, message, 900, 100), [entry], 0)
        stored_result = self.store.record_result(self.lease, it, 0, result)
        stored = len(self.snap.messages)
        self.snap.messages += [turn.message, stored_result.to_message()]
        self.snap.context.counters.iterations = it
        self.store.commit_checkpoint(self.lease, self.snap, stored_messages=stored)
        return time.perf_counter() - t0


def _db_size(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]


def run(new_database: Callable[[str], str], cfg: PayloadsConfig, log: Callable[[str], None]) -> PayloadsResult:
    """Measure the three subjects (see the module docstring); ``new_database(prefix)`` makes an
    empty database on the server and returns its DSN (``BenchServer.create_database``)."""
    res = PayloadsResult(cfg)
    sizes = {"small": SMALL_BYTES, "large": cfg.payload_bytes, "inline": cfg.payload_bytes}
    limits = {"small": Limits(), "large": Limits(), "inline": Limits(threshold_bytes=1 << 30, max_bytes=1 << 30)}
    stores, conns = {}, {}
    try:
        for s in SUBJECTS:
            dsn = new_database(f"pay_{s}")
            stores[s] = Store(dsn, payload_limits=limits[s])
            stores[s].migrate()
            conns[s] = psycopg.connect(dsn, autocommit=True)
            res.write_s[s], res.hot_bytes[s], res.wal_bytes[s], res.growth_bytes[s], res.load_ms[s] = [], [], [], [], []
            res.output_bytes[s] = sizes[s] * cfg.iterations
        for rep in range(cfg.reps):
            order = SUBJECTS[rep % 3 :] + SUBJECTS[: rep % 3]
            runs = {s: _Run(stores[s], sizes[s]) for s in order}
            before = {s: _db_size(conns[s]) for s in order}
            times: dict[str, list[float]] = {s: [] for s in order}
            for _ in range(cfg.iterations):
                for s in order:
                    lsn = wal_lsn(conns[s])
                    times[s].append(runs[s].iteration())
                    res.wal_bytes[s].append(wal_lsn(conns[s]) - lsn)
                    it = runs[s].snap.context.counters.iterations
                    res.hot_bytes[s].append(conns[s].execute(HOT, {"r": runs[s].run_id, "i": it}).fetchone()[0])
            for s in order:
                res.write_s[s].append(times[s])
                res.growth_bytes[s].append(_db_size(conns[s]) - before[s])
                t0 = time.perf_counter()
                loaded = stores[s].load_snapshot(runs[s].run_id)
                res.load_ms[s].append((time.perf_counter() - t0) * 1000)
                assert loaded is not None and loaded.messages[-1].content == runs[s].snap.messages[-1].content  # resolved, whole
            log(
                f"payloads: repetition {rep + 1}/{cfg.reps}: p50 ms "
                + ", ".join(f"{s} {statistics.median(times[s]) * 1000:.1f}" for s in SUBJECTS)
            )
        # The ceiling: a value over max_bytes is refused before anything is written, never retried.
        with Store(new_database("pay_ceiling"), payload_limits=Limits(max_bytes=1 << 20)) as st:
            st.migrate()
            r = _Run(st, cfg.payload_bytes)
            t0 = time.perf_counter()
            try:
                r.iteration()
            except PayloadTooLarge as err:
                res.ceiling_message = str(err)
            res.ceiling_ms = (time.perf_counter() - t0) * 1000
    finally:
        for c in conns.values():
            c.close()
        for st in stores.values():
            st.close()
    return res
