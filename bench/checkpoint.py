"""Part 1: what one checkpoint costs, at transcript lengths 10 to 10,000.

Subjects, all against the same server, in blocks rotated inside every repetition; within a
block every step of the subject is followed by one step of the floor, so that the machine's
background load hits a subject and its baseline at the same moments:

- ``floor``: a bare single-row INSERT + COMMIT through psycopg (non-autocommit, dict rows: the
  store's connection settings). The cheapest durable write there is: one fsync'ed commit.
- ``store``: ``Store.commit_checkpoint`` of one iteration: three new messages (the assistant
  reply with two tool calls, two ~300 B tool results) plus the context, on a run prefilled to n.
- ``iteration``: every store call of one vanilla iteration with two idempotent tool calls, as
  the loop makes them (save_turn with the first call's intent, that call's result, the second
  call's intent and result, then the checkpoint; pinned by tests/test_bench_smoke.py): the whole durable overhead
  of an iteration, not only its checkpoint.
- ``lg_saver``: langgraph-checkpoint-postgres ``PostgresSaver``, put_writes + put per superstep.
- ``lg_adapter``: agentfast's LangGraph adapter, one superstep through ``_step_done``.
- ``proto``: not the product: the store's statements sent as one pipeline (bench/prototype.py),
  to show what bounds the store's figure.

A block of a subject at length n uses fresh runs prefilled to n and takes at most 10 steps per
run, so the transcript stays within n..n+30. Bytes per checkpoint are measured in a separate,
untimed pass: the WAL written (``pg_current_wal_insert_lsn`` before/after, the benchmark being the
server's only client and autovacuum paused) and the stored size of the rows written
(``pg_column_size``, i.e. after TOAST compression).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psycopg
from psycopg.rows import dict_row

from agentfast.runner.snapshot import call_id, idempotency_key
from agentfast.runner.store import JournalEntry, Store, Turn

from .pg import wal_lsn
from .prototype import pipelined_commit
from .stats import Spread, pct
from .workload import Prefiller, advance, assistant_message, tool_result

FLOOR_PAYLOAD = '{"kind": "floor", "note": "' + "x" * 280 + '"}'
STEPS_PER_RUN = 10
SUBJECTS = ["floor", "store", "iteration", "lg_saver", "lg_adapter", "proto"]
LABELS = {
    "floor": "floor: bare INSERT + COMMIT (psycopg)",
    "store": "agentfast Store.commit_checkpoint",
    "iteration": "agentfast, all store calls of one vanilla iteration",
    "lg_saver": "LangGraph PostgresSaver, put_writes + put (1 superstep)",
    "lg_adapter": "agentfast LangGraph adapter, 1 superstep (_step_done)",
    "proto": "what-if: the store's statements pipelined (bench/prototype.py)",
}


@dataclass
class CheckpointConfig:
    lengths: list[int]
    reps: int
    samples: int  # timed steps per block (per subject, length, repetition)
    heavy_samples: int  # for the LangGraph subjects at lengths >= 1,000 (each step is O(n))
    bytes_samples: int
    subjects: list[str] = field(default_factory=lambda: list(SUBJECTS))


@dataclass
class CheckpointResult:
    config: CheckpointConfig
    # samples[subject][n] = one list of seconds per repetition
    samples: dict[str, dict[int, list[list[float]]]]
    wal_bytes: dict[str, dict[int, float]]
    row_bytes: dict[str, dict[int, float]]
    # cpu[subject][n] = (client CPU seconds, server backend CPU seconds) per step, pooled over repetitions
    cpu: dict[str, dict[int, list[tuple[float, float]]]]
    # pairs[subject][n] = per repetition, the floor steps interleaved with that subject's steps
    pairs: dict[str, dict[int, list[list[float]]]]

    def cpu_us(self, subject: str, n: int) -> tuple[float, float]:
        xs = self.cpu[subject][n]
        if not xs:
            return math.nan, math.nan
        return statistics.median(c for c, _ in xs) * 1e6, statistics.median(b for _, b in xs) * 1e6

    def p50(self, subject: str, n: int) -> Spread:
        return Spread.of(statistics.median(r) for r in self.samples[subject][n] if r)

    def pooled(self, subject: str, n: int) -> list[float]:
        return [x for r in self.samples[subject][n] for x in r]

    def p99(self, subject: str, n: int) -> float:
        return pct(self.pooled(subject, n), 99)

    def ratio_to_floor(self, subject: str, n: int) -> Spread:
        """Per repetition: p50(subject) / p50(the floor steps interleaved with it); median and range."""
        out = []
        floors = self.pairs[subject][n] if subject != "floor" else self.samples["floor"][n]
        for rs, rf in zip(self.samples[subject][n], floors):
            if rs and rf:
                out.append(statistics.median(rs) / statistics.median(rf))
        return Spread.of(out)

    def p99_ratio(self, subject: str, n: int) -> float:
        if subject == "floor":
            return 1.0
        return self.p99(subject, n) / pct([x for r in self.pairs[subject][n] for x in r], 99)

    def growth(self, subject: str, lo: int, hi: int) -> Spread:
        """Per repetition: p50 at ``hi`` / p50 at ``lo``."""
        out = []
        for a, b in zip(self.samples[subject][lo], self.samples[subject][hi]):
            if a and b:
                out.append(statistics.median(b) / statistics.median(a))
        return Spread.of(out)

    def growth_vs_floor(self, subject: str, lo: int, hi: int) -> float:
        """Growth of the floor-normalised p50 (robust against drift between blocks)."""
        a, b = self.ratio_to_floor(subject, lo).median, self.ratio_to_floor(subject, hi).median
        return b / a if a and not math.isnan(a) else math.nan


class Bench:
    """Holds the connections and prefiller; each ``block_*`` returns seconds per step."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.store = Store(dsn, pool_max=1)
        self.store.migrate()
        self.prefill = Prefiller(self.store, dsn)
        self.floor_conn = psycopg.connect(dsn, row_factory=dict_row)
        self.floor_conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, run_id text NOT NULL, payload jsonb NOT NULL)"
        )
        self.floor_conn.commit()
        self.lsn_conn = psycopg.connect(dsn, autocommit=True)
        self._saver = None
        self.proto_conn = psycopg.connect(dsn)
        with self.store._pool.connection() as c:  # pool_max=1: the store's one backend
            self.store_pid = c.info.backend_pid
        self.cpu: list[tuple[float, float]] = []  # filled by block(): per timed step

    def _backend(self, subject: str) -> int:
        if subject == "floor":
            return self.floor_conn.info.backend_pid
        if subject == "lg_saver":
            return self.saver.conn.info.backend_pid
        if subject == "proto":
            return self.proto_conn.info.backend_pid
        return self.store_pid

    @property
    def saver(self):  # noqa: ANN201 - created on first use (imports LangGraph)
        if self._saver is None:
            from .lg import SaverSteps

            self._saver = SaverSteps(self.dsn)
        return self._saver

    def close(self) -> None:
        if self._saver is not None:
            self._saver.close()
        self.floor_conn.close()
        self.proto_conn.close()
        self.lsn_conn.close()
        self.store.close()

    # -- one step of each subject --------------------------------------------------------------

    def floor_step(self) -> None:
        self.floor_conn.execute("INSERT INTO bench_floor (run_id, payload) VALUES (%s, %s)", ("floor", FLOOR_PAYLOAD))
        self.floor_conn.commit()

    @staticmethod
    def iteration_inputs(snap):  # noqa: ANN001, ANN205
        """What one iteration writes (the model's reply, its plan, the two results), made before
        the timed step: generating the synthetic text is the workload's cost, not the store's.
        Advances ``snap`` by the iteration; returns the inputs of :meth:`iteration_step`."""
        it = snap.context.counters.iterations + 1
        uid = snap.context.session.run_uid
        msg = assistant_message(it)
        planned = [
            JournalEntry(it, p, call_id(it, p), idempotency_key(uid, it, p), c, False, True, "planned", 0, None)
            for p, c in enumerate(msg.tool_calls)
        ]
        results = [tool_result(uid, it, p) for p in range(len(planned))]
        stored = advance(snap)
        return it, Turn(it, msg, 900, 100), planned, results, stored

    @staticmethod
    def iteration_step(store, lease, snap, inputs) -> None:  # noqa: ANN001
        """What the vanilla loop asks of the store in one iteration of two idempotent tool calls,
        in its order (tests/test_bench_smoke.py records the real loop's calls and compares): the
        reply's usage recorded as it arrives (asynchronous commit), the model's reply with the plan and the first call's intent, per call the intent (the first
        one's already written; an intent also checks for a cancel or the deadline) and the
        result, then the checkpoint with the read of the next iteration's safe point."""
        it, turn, planned, results, stored = inputs
        store.record_reply(lease, it, turn.prompt_tokens, turn.completion_tokens, None)
        store.save_turn_and_mark_started(lease, turn, planned, 0, deadline_s=None)
        for p, result in enumerate(results):
            if p > 0:
                store.mark_started(lease, it, p, deadline_s=None)
            store.record_result(lease, it, p, result)
        store.commit_checkpoint_then_read_end_requests(lease, snap, stored_messages=stored)

    # -- blocks ----------------------------------------------------------------------------------

    def block(self, subject: str, n: int, k: int, *, on_step: Callable[[object], None] | None = None) -> list[float]:
        """``k`` timed steps of ``subject`` at transcript length ``n``; returns seconds per step.

        Unless ``on_step`` is given (the bytes pass: ``on_step(ctx)`` runs after each step,
        untimed), every step is followed by one floor step, timed too (``self.pair_floor``): the
        subject and its baseline see the machine's load at the same moments, so their ratio is
        not at the mercy of when a block happened to run. Runs are prefilled before the first
        timed step, so a prefill never lands between timed steps.
        """
        out: list[float] = []
        self.cpu = []
        self.pair_floor: list[float] = []
        self.pair_floor_cpu: list[tuple[float, float]] = []
        clock = time.perf_counter
        pid = self._backend(subject)
        floor_pid = self.floor_conn.info.backend_pid
        cpu_marks: list[tuple[float, int]] = []
        pair = on_step is None and subject != "floor"

        def mark() -> None:
            cpu_marks.append((time.process_time(), backend_cpu_ns(pid)))

        def took(t: float) -> None:
            now = clock()
            (c0, s0) = cpu_marks.pop()
            self.cpu.append((time.process_time() - c0, (backend_cpu_ns(pid) - s0) / 1e9))
            out.append(now - t)
            if pair:
                c0, s0 = time.process_time(), backend_cpu_ns(floor_pid)
                t = clock()
                self.floor_step()
                self.pair_floor.append(clock() - t)
                self.pair_floor_cpu.append((time.process_time() - c0, (backend_cpu_ns(floor_pid) - s0) / 1e9))

        if subject == "floor":
            for _ in range(k):
                mark()
                t = clock()
                self.floor_step()
                took(t)
                if on_step:
                    on_step(("floor", None))
            return out
        plan = [min(STEPS_PER_RUN, k - i) for i in range(0, k, STEPS_PER_RUN)]
        if subject in ("store", "iteration", "proto"):
            runs = [self.prefill.make_run(n) for _ in plan]
            for (lease, snap), steps in zip(runs, plan):
                for _ in range(steps):
                    if subject == "store":
                        stored = advance(snap)
                        mark()
                        t = clock()
                        self.store.commit_checkpoint(lease, snap, stored_messages=stored)
                    elif subject == "proto":
                        stored = advance(snap)
                        mark()
                        t = clock()
                        pipelined_commit(self.proto_conn, lease, snap, stored_messages=stored)
                    else:
                        inputs = self.iteration_inputs(snap)
                        mark()
                        t = clock()
                        self.iteration_step(self.store, lease, snap, inputs)
                    took(t)
                    if on_step:
                        on_step(("store", (lease, snap)))
        elif subject == "lg_saver":
            threads = [self.saver.thread(n) for _ in plan]
            for th, steps in zip(threads, plan):
                for _ in range(steps):
                    mark()
                    t = clock()
                    th.step_once()
                    took(t)
                    if on_step:
                        on_step(("lg_saver", th))
        elif subject == "lg_adapter":
            from .lg import AdapterRun

            skip = 2  # the input superstep, and the first agent step (LangGraph warms its caches)
            adapter_runs = [AdapterRun(self.store, self.prefill, n, steps + skip) for steps in plan]
            for run in adapter_runs:
                mark()
                t = clock()
                for i, _ in enumerate(run.supersteps()):
                    # A superstep is timed from the end of the previous one: LangGraph's own step
                    # (node, reducer, in-memory put) plus the adapter's _step_done.
                    if i >= skip:
                        took(t)
                        if on_step:
                            on_step(("store", (run.runner.lease, run.runner.snap)))
                    else:
                        cpu_marks.pop()
                    mark()
                    t = clock()
                cpu_marks.clear()
        else:
            raise ValueError(subject)
        self.cpu = self.cpu[:k]
        return out[:k]

    # -- bytes -----------------------------------------------------------------------------------

    def measure_bytes(self, subject: str, n: int, k: int) -> tuple[float, float]:
        """Median WAL bytes and median stored row bytes per step of ``subject`` at length n."""
        wal: list[float] = []
        rows: list[float] = []
        before = [wal_lsn(self.lsn_conn)]

        def on_step(ctx: object) -> None:
            after = wal_lsn(self.lsn_conn)
            wal.append(after - before[0])
            kind, obj = ctx  # type: ignore[misc]
            if kind == "floor":
                r = self.lsn_conn.execute("SELECT pg_column_size(f.*) FROM bench_floor f ORDER BY id DESC LIMIT 1").fetchone()[0]
            elif kind == "store":
                lease, snap = obj  # type: ignore[misc]
                r = self.lsn_conn.execute(
                    """WITH last2 AS (SELECT c.*, pg_column_size(c.*) AS size FROM agentfast_checkpoints c
                                      WHERE c.run_id = %(r)s ORDER BY checkpoint_id DESC LIMIT 2)
                       SELECT (SELECT coalesce(sum(pg_column_size(m.*)), 0) FROM agentfast_messages m
                               WHERE m.run_id = %(r)s AND m.seq >= (SELECT min(message_count) FROM last2)
                                 AND m.seq < (SELECT max(message_count) FROM last2))
                            + (SELECT size FROM last2 ORDER BY checkpoint_id DESC LIMIT 1)""",
                    {"r": lease.run_id},
                ).fetchone()[0]
            else:
                r = obj.row_bytes(self.lsn_conn)  # type: ignore[union-attr]
            rows.append(float(r))
            before[0] = wal_lsn(self.lsn_conn)

        # The first step after a prefill touches fresh pages (full-page images): measure k, report the median.
        self.block(subject, n, k, on_step=on_step)
        return statistics.median(wal), statistics.median(rows)


@contextlib.contextmanager
def autovacuum_paused(dsn: str) -> Iterator[None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET autovacuum = off")
        conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline
            and conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'").fetchone()[0]
        ):
            time.sleep(0.1)
        try:
            yield
        finally:
            conn.execute("ALTER SYSTEM RESET autovacuum")
            conn.execute("SELECT pg_reload_conf()")


def backend_cpu_ns(pid: int) -> int:
    """CPU time a process has used so far, in ns (/proc/PID/schedstat: exact, unlike ticks)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def run(dsn: str, cfg: CheckpointConfig, log: Callable[[str], None]) -> CheckpointResult:
    b = Bench(dsn)
    samples: dict[str, dict[int, list[list[float]]]] = {s: {n: [] for n in cfg.lengths} for s in cfg.subjects}
    wal_b: dict[str, dict[int, float]] = {s: {} for s in cfg.subjects}
    row_b: dict[str, dict[int, float]] = {s: {} for s in cfg.subjects}
    cpu: dict[str, dict[int, list[tuple[float, float]]]] = {s: {n: [] for n in cfg.lengths} for s in cfg.subjects}
    pairs: dict[str, dict[int, list[list[float]]]] = {s: {n: [] for n in cfg.lengths} for s in cfg.subjects}
    try:
        # Warm-up: prepared statements, PL/pgSQL caches, imports, LangGraph's first compile.
        for s in cfg.subjects:
            b.block(s, cfg.lengths[0], 5)
        for rep in range(cfg.reps):
            t0 = time.monotonic()
            lengths = cfg.lengths if rep % 2 == 0 else list(reversed(cfg.lengths))
            for n in lengths:
                # Rotate the subjects' order per repetition. The floor is measured inside every
                # subject's block, one floor step after each of the subject's steps.
                subjects = [s for s in cfg.subjects if s != "floor"]
                order = subjects[rep % len(subjects) :] + subjects[: rep % len(subjects)]
                floor_all: dict[int, list[float]] = {n: []}
                for s in order:
                    k = cfg.heavy_samples if s.startswith("lg_") and n >= 1000 else cfg.samples
                    samples[s][n].append(b.block(s, n, k))
                    cpu[s][n].extend(b.cpu)
                    if s != "floor":
                        pairs[s][n].append(b.pair_floor)
                        floor_all[n].extend(b.pair_floor)
                        cpu["floor"][n].extend(b.pair_floor_cpu)
                if "floor" in cfg.subjects:  # the floor row: every floor step of this round
                    samples["floor"][n].append(floor_all.pop(n))
            log(f"  checkpoint rep {rep + 1}/{cfg.reps} done in {time.monotonic() - t0:.1f}s")
        # WAL is counted server-wide, so nothing else may write meanwhile: autovacuum (busy after
        # the timed part) is paused for this pass and resumed after it.
        with autovacuum_paused(dsn):
            for s in cfg.subjects:
                for n in cfg.lengths:
                    wal_b[s][n], row_b[s][n] = b.measure_bytes(s, n, cfg.bytes_samples)
        log("  checkpoint bytes measured")
    finally:
        b.close()
    return CheckpointResult(cfg, samples, wal_b, row_b, cpu, pairs)


def measure_load(dsn: str, n: int, reps: int) -> dict[str, Spread]:
    """``Store.load_snapshot`` of a run of ``n`` messages: whole call, and its SQL alone."""
    store = Store(dsn, pool_max=2)
    store.migrate()
    pf = Prefiller(store, dsn)
    lease, snap = pf.make_run(n)
    store.commit_checkpoint(lease, snap, stored_messages=n)  # a real latest checkpoint row
    whole, sql = [], []
    try:
        for _ in range(3):
            store.load_snapshot(lease.run_id)
        with psycopg.connect(dsn, row_factory=dict_row) as conn:
            for _ in range(reps):
                t = time.perf_counter()
                s = store.load_snapshot(lease.run_id)
                whole.append(time.perf_counter() - t)
                assert s is not None and len(s.messages) == n
                t = time.perf_counter()
                cp = conn.execute(
                    "SELECT * FROM agentfast_checkpoints WHERE run_id = %s ORDER BY checkpoint_id DESC LIMIT 1", (lease.run_id,)
                ).fetchone()
                conn.execute(
                    "SELECT message FROM agentfast_messages WHERE run_id = %s AND seq < %s ORDER BY seq",
                    (lease.run_id, cp["message_count"]),
                ).fetchall()
                conn.commit()
                sql.append(time.perf_counter() - t)
    finally:
        store.close()
    return {
        "load_snapshot": Spread.of(x * 1000 for x in whole),
        "sql_only": Spread.of(x * 1000 for x in sql),
        "p99_ms": Spread.of([pct(whole, 99) * 1000]),
    }


def new_thread_id() -> str:
    return str(uuid.uuid4())
