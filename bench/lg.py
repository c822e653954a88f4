"""The two LangGraph subjects of the checkpoint benchmark.

``SaverSteps``: langgraph-checkpoint-postgres's ``PostgresSaver`` storing what LangGraph stores
per superstep of a graph whose ``messages`` channel (the default ``add_messages`` reducer) holds
the transcript: ``put_writes`` with the step's task writes (the three new messages), then ``put``
of the new checkpoint, whose ``messages`` blob is the whole list. LangChain message objects,
serialized by LangGraph's own serde. This is the cheap end of LangGraph's per-iteration cost: a
tool-calling iteration of a ReAct-style graph is two supersteps (agent, then tools), i.e. two
``put``s of the whole list.

``AdapterRun``: agentfast's own LangGraph adapter (runner/adapters/langgraph.py), measured by
running a real compiled graph under ``LangGraphRunner._step_done``, the code that runs after
every superstep of a real run: ``graph.get_state``, the transcript mirror (the new messages),
``export_state`` of the adapter's saver, the journal read for the counters, and
``Store.commit_checkpoint`` with the new sdk rows and the small ``sdk_state`` naming them. The
graph's one node appends the three messages of an iteration per superstep (same caveat: a real
iteration is two supersteps).

Part ``langgraph`` (:func:`run`, issue 15 item 3) puts the adapter beside LangGraph itself on
the same graph: without a checkpointer (the graph's own step) and on LangGraph's PostgresSaver;
then the bytes a superstep writes, and a real run of large tool outputs through both adapters.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from agentfast.runner.snapshot import Message
from agentfast.runner.store import Store

from .stats import Spread
from .workload import Prefiller, iteration_messages, transcript


def lc_message(m: Message, msg_id: str) -> Any:
    """A plain LangChain message, as a LangGraph user's graph holds it (no agentfast extras)."""
    from agentfast.runner.adapters.langgraph import to_langchain_message

    return to_langchain_message(m, msg_id, keep_original=False)


class SaverSteps:
    """PostgresSaver put_writes + put per superstep, on its own autocommit connection (as
    ``PostgresSaver.from_conn_string`` opens it)."""

    def __init__(self, dsn: str):
        from langgraph.checkpoint.postgres import PostgresSaver

        self.conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row)
        self.saver = PostgresSaver(self.conn)
        self.saver.setup()

    def close(self) -> None:
        self.conn.close()

    def thread(self, n: int) -> SaverThread:
        return SaverThread(self.saver, n)


class SaverThread:
    def __init__(self, saver: Any, n: int):
        from langgraph.checkpoint.base import empty_checkpoint

        self.saver = saver
        self.thread_id = str(uuid.uuid4())
        self.messages = [lc_message(m, f"m-{i}") for i, m in enumerate(transcript(n))]
        self.it = (n + 2) // 3
        self.step = 0
        self.version = saver.get_next_version(None, None)
        cp = empty_checkpoint()
        cp["channel_values"] = {"messages": list(self.messages)}
        cp["channel_versions"] = {"messages": self.version}
        self.checkpoint = cp
        self.config = saver.put(
            {"configurable": {"thread_id": self.thread_id, "checkpoint_ns": ""}},
            cp,
            {"source": "input", "step": -1, "parents": {}},
            {"messages": self.version},
        )

    def step_once(self) -> None:
        """One superstep's persistence: the task's writes, then the new checkpoint."""
        from langgraph.checkpoint.base.id import uuid6

        self.it += 1
        self.step += 1
        self.parent_id = self.config["configurable"]["checkpoint_id"]
        new = [lc_message(m, f"it-{self.it}-{i}") for i, m in enumerate(iteration_messages(self.it))]
        self.saver.put_writes(self.config, [("messages", new)], str(uuid.uuid4()), "agent")
        self.messages = self.messages + new
        self.version = self.saver.get_next_version(self.version, None)
        cp = {
            "v": self.checkpoint["v"],
            "id": str(uuid6(clock_seq=self.step)),
            "ts": datetime.now(UTC).isoformat(),
            "channel_values": {"messages": self.messages},
            "channel_versions": {"messages": self.version},
            "versions_seen": {"agent": {"messages": self.version}},
            "pending_sends": [],
            "updated_channels": ["messages"],
        }
        self.checkpoint = cp
        self.config = self.saver.put(
            self.config, cp, {"source": "loop", "step": self.step, "parents": {}}, {"messages": self.version}
        )

    def row_bytes(self, conn: psycopg.Connection) -> int:
        """Bytes of the rows the last step wrote: the messages blob, the checkpoint, the writes."""
        cid = self.config["configurable"]["checkpoint_id"]
        row = conn.execute(
            """SELECT (SELECT coalesce(sum(pg_column_size(b.*)), 0) FROM checkpoint_blobs b
                       WHERE b.thread_id = %(t)s AND b.channel = 'messages' AND b.version = %(v)s)
                    + (SELECT coalesce(sum(pg_column_size(c.*)), 0) FROM checkpoints c
                       WHERE c.thread_id = %(t)s AND c.checkpoint_id = %(c)s)
                    + (SELECT coalesce(sum(pg_column_size(w.*)), 0) FROM checkpoint_writes w
                       WHERE w.thread_id = %(t)s AND w.checkpoint_id = %(p)s)""",
            {"t": self.thread_id, "v": self.version, "c": cid, "p": self.parent_id},
        ).fetchone()
        return int(row[0])


class AdapterRun:
    """A run of agentfast's LangGraph adapter prefilled to ``n`` messages, driven superstep by
    superstep through the real ``LangGraphRunner._step_done``."""

    def __init__(self, store: Store, prefiller: Prefiller, n: int, steps: int):
        from langgraph.graph import END, START, MessagesState, StateGraph

        from agentfast.runner.adapters.langgraph import LangGraphRunner, SnapshotSaver, speed_up_reducers, to_langchain_message
        from agentfast.runner.spec import parse_agentrun
        from agentfast.runner.tools import ToolRegistry

        lease, snap = prefiller.make_run(n, journal=True)
        ns, name = lease.run_id.split("/")
        run = parse_agentrun(
            {
                "apiVersion": "agentfast.dev/v1alpha1",
                "kind": "AgentRun",
                "metadata": {"name": name, "namespace": ns, "uid": snap.context.session.run_uid},
                "spec": {
                    "adapter": "langgraph",
                    "graph": {"ref": "agentfast.runner.examples.refund_graph:build"},
                    "model": {"name": "bench", "script": "refund"},
                    "input": "bench",
                },
            },
            check_imports=False,
        )
        snap.context.session.adapter = "langgraph"
        runner = LangGraphRunner(store, run, model=None, tools=ToolRegistry([]))  # type: ignore[arg-type]
        runner.lease = lease
        runner.snap = snap
        runner._stored = len(snap.messages)
        runner._active_since = time.monotonic()
        runner.saver = SnapshotSaver()
        self.thread_id = snap.context.session.run_uid
        self.it = (n + 2) // 3
        self.remaining = steps

        def agent(state):  # noqa: ANN001,ANN202 - no annotations: LangGraph evaluates them
            self.it += 1
            runner.snap.context.counters.iterations = self.it  # as RuntimeChatModel does for a model call
            return {
                "messages": [
                    to_langchain_message(m, msg_id=f"agentfast-turn-{self.it}-{i}")
                    for i, m in enumerate(iteration_messages(self.it))
                ]
            }

        def more(state):  # noqa: ANN001,ANN202
            self.remaining -= 1
            return "agent" if self.remaining > 0 else END

        g = StateGraph(MessagesState)
        g.add_node("agent", agent)
        g.add_edge(START, "agent")
        g.add_conditional_edges("agent", more, ["agent", END])
        runner.graph = speed_up_reducers(g.compile(checkpointer=runner.saver))  # as build_graph compiles a user's graph
        self.runner = runner
        self.config = {"configurable": {"thread_id": self.thread_id}, "recursion_limit": 10**6}
        self.graph_input = {
            "messages": [to_langchain_message(m, msg_id=f"agentfast-input-{i}") for i, m in enumerate(snap.messages)]
        }

    def supersteps(self) -> Iterator[None]:
        """Yields after each superstep has been committed (exactly what the adapter does)."""
        for _ in self.runner.graph.stream(self.graph_input, self.config, stream_mode="updates", durability="sync"):
            self.runner._step_done(self.thread_id, self.config)
            yield None


# -- part `langgraph` (issue 15 item 3): the adapter against LangGraph itself -----------------------

SUBJECTS = {
    "bare": "LangGraph alone: the same graph, no checkpointer (the graph's own step)",
    "bare_fast": "the same, with the adapter's add_messages (IncrementalAddMessages), no checkpointer",
    "adapter": "agentfast LangGraph adapter: the graph's step + _step_done (export, commit)",
    "lg_pg": "LangGraph on its own PostgresSaver: the same graph, durability=sync",
}


class GraphSteps:
    """The graph :class:`AdapterRun` drives (one node appending an iteration's three messages per
    superstep, ``MessagesState``), compiled without a checkpointer (``pg=None``: LangGraph's own
    cost; ``fast``: with the adapter's reducer) or on LangGraph's PostgresSaver (``pg``: a
    SaverSteps), fed a transcript of ``n``."""

    def __init__(self, n: int, steps: int, pg: SaverSteps | None, *, fast: bool = False):
        from langgraph.graph import END, START, MessagesState, StateGraph

        from agentfast.runner.adapters.langgraph import to_langchain_message

        self.it = (n + 2) // 3
        self.remaining = steps
        self.pg = pg
        self.thread_id = str(uuid.uuid4())

        def agent(state):  # noqa: ANN001,ANN202 - no annotations: LangGraph evaluates them
            self.it += 1
            return {
                "messages": [
                    to_langchain_message(m, msg_id=f"agentfast-turn-{self.it}-{i}")
                    for i, m in enumerate(iteration_messages(self.it))
                ]
            }

        def more(state):  # noqa: ANN001,ANN202
            self.remaining -= 1
            return "agent" if self.remaining > 0 else END

        g = StateGraph(MessagesState)
        g.add_node("agent", agent)
        g.add_edge(START, "agent")
        g.add_conditional_edges("agent", more, ["agent", END])
        self.graph = g.compile(checkpointer=pg.saver if pg is not None else None)
        if fast:
            from agentfast.runner.adapters.langgraph import speed_up_reducers

            speed_up_reducers(self.graph)
        self.config = {"configurable": {"thread_id": self.thread_id}, "recursion_limit": 10**6}
        self.graph_input = {
            "messages": [to_langchain_message(m, msg_id=f"agentfast-input-{i}") for i, m in enumerate(transcript(n))]
        }

    def supersteps(self) -> Iterator[None]:
        kw = {"durability": "sync"} if self.pg is not None else {}
        for _ in self.graph.stream(self.graph_input, self.config, stream_mode="updates", **kw):
            yield None


@dataclass
class LgConfig:
    lengths: list[int]
    reps: int
    samples: int  # timed supersteps per block (subject, length, repetition)
    bytes_samples: int
    big_outputs: int  # tool outputs of big_bytes each, in one run per adapter
    big_bytes: int


@dataclass
class LgResult:
    config: LgConfig
    # samples[subject][n]: per repetition, seconds per superstep; floor[subject][n]: the floor steps interleaved
    samples: dict[str, dict[int, list[list[float]]]]
    floor: dict[str, dict[int, list[list[float]]]]
    cpu: dict[str, dict[int, list[float]]]  # this process's CPU seconds per superstep, pooled (the backend's not included)
    # per length, medians over the bytes pass: WAL and stored row bytes per superstep, the largest
    # value one superstep stored, and the latest checkpoint's sdk_state (adapter) / checkpoint row (lg_pg)
    wal: dict[str, dict[int, float]]
    rows: dict[str, dict[int, float]]
    largest: dict[str, dict[int, float]]
    state: dict[str, dict[int, float]]
    big: dict[str, dict[str, float]]  # adapter -> wall_s, bytes, outputs, peak_mib

    def p50_ms(self, subject: str, n: int) -> Spread:
        return Spread.of(statistics.median(r) * 1000 for r in self.samples[subject][n] if r)

    def norm(self, subject: str, n: int) -> float:
        """p50 ÷ the p50 of the floor steps interleaved with it, median over repetitions."""
        return statistics.median(
            statistics.median(s) / statistics.median(f)
            for s, f in zip(self.samples[subject][n], self.floor[subject][n])
            if s and f
        )

    def growth(self, subject: str, lo: int, hi: int) -> tuple[float, float]:
        """(raw p50 growth, floor-normalised p50 growth) from ``lo`` to ``hi`` messages."""
        return self.p50_ms(subject, hi).median / self.p50_ms(subject, lo).median, self.norm(subject, hi) / self.norm(subject, lo)

    def cpu_ms(self, subject: str, n: int) -> float:
        return statistics.median(self.cpu[subject][n]) * 1000

    def own_ms(self, n: int) -> float:
        """The adapter's persistence per superstep: its p50 minus the p50 of the same graph step
        without a checkpointer (with the adapter's reducer), same run."""
        return self.p50_ms("adapter", n).median - self.p50_ms("bare_fast", n).median

    def pg_own_ms(self, n: int) -> float:
        return self.p50_ms("lg_pg", n).median - self.p50_ms("bare", n).median


class _LgBench:
    def __init__(self, dsn: str):
        from .checkpoint import Bench

        self.b = Bench(dsn)  # the store (pool of one), the prefiller, the floor connection
        self.dsn = dsn

    def close(self) -> None:
        self.b.close()

    def _make(self, subject: str, n: int, steps: int) -> Any:
        if subject == "adapter":
            return AdapterRun(self.b.store, self.b.prefill, n, steps)
        return GraphSteps(n, steps, self.b.saver if subject == "lg_pg" else None, fast=subject == "bare_fast")

    def block(self, subject: str, n: int, k: int, on_step: Any = None) -> tuple[list[float], list[float], list[float]]:
        """``k`` timed supersteps of ``subject`` at ``n`` messages (after 2 untimed ones: the input
        step and LangGraph's first, which warms its caches), each followed by one floor step
        (unless ``on_step``: the bytes pass, which calls it untimed after each step instead).
        Returns seconds per step, the floor steps' seconds, and this process's CPU seconds per step."""
        skip = 2
        out, floor, cpu = [], [], []
        clock = time.perf_counter
        while len(out) < k:
            run = self._make(subject, n, min(10, k - len(out)) + skip)
            t, c = clock(), time.process_time()
            for i, _ in enumerate(run.supersteps()):
                if i >= skip:
                    out.append(clock() - t)
                    cpu.append(time.process_time() - c)
                    if on_step is not None:
                        on_step(run)
                    else:
                        f = clock()
                        self.b.floor_step()
                        floor.append(clock() - f)
                elif on_step is not None and i == skip - 1:
                    on_step(run)  # the baseline of the first measured step
                t, c = clock(), time.process_time()
        return out[:k], floor[:k], cpu[:k]


def _sizes(conn: psycopg.Connection, subject: str, run: Any) -> tuple[dict[str, int], float]:
    """What the run has stored: its rows' stored sizes by key, and its latest state's size."""
    if subject == "adapter":
        run_id = run.runner.run_id
        rows = conn.execute(
            """SELECT 'b:' || key, pg_column_size(b.*) FROM agentfast_sdk_blobs b WHERE run_id = %(r)s
               UNION ALL SELECT 'm:' || seq, pg_column_size(m.*) FROM agentfast_messages m WHERE run_id = %(r)s
               UNION ALL SELECT 'c:' || checkpoint_id, pg_column_size(c.*) FROM agentfast_checkpoints c WHERE run_id = %(r)s""",
            {"r": run_id},
        ).fetchall()
        state = conn.execute(
            "SELECT pg_column_size(sdk_state) FROM agentfast_checkpoints WHERE run_id = %s ORDER BY checkpoint_id DESC LIMIT 1",
            (run_id,),
        ).fetchone()[0]
    else:
        t = run.thread_id
        rows = conn.execute(
            """SELECT 'b:' || channel || version, pg_column_size(b.*) FROM checkpoint_blobs b WHERE thread_id = %(t)s
               UNION ALL SELECT 'w:' || checkpoint_id || task_id || idx, pg_column_size(w.*) FROM checkpoint_writes w WHERE thread_id = %(t)s
               UNION ALL SELECT 'c:' || checkpoint_id, pg_column_size(c.*) FROM checkpoints c WHERE thread_id = %(t)s""",
            {"t": t},
        ).fetchall()
        state = conn.execute(
            "SELECT pg_column_size(c.*) FROM checkpoints c WHERE thread_id = %s ORDER BY checkpoint_id DESC LIMIT 1", (t,)
        ).fetchone()[0]
    return {r[0]: r[1] for r in rows}, float(state)


def measure_bytes(lb: _LgBench, subject: str, n: int, k: int) -> tuple[float, float, float, float]:
    """Medians per superstep of: WAL bytes, stored bytes of the rows it added, the largest row it
    added; and the latest state's size at the end."""
    from .pg import wal_lsn

    wal, added, largest, state = [], [], [], [0.0]
    seen: dict[str, int] = {}
    lsn = [0]
    with psycopg.connect(lb.dsn, autocommit=True) as conn:

        def on_step(run: Any) -> None:
            now = wal_lsn(conn)
            sizes, state[0] = _sizes(conn, subject, run)
            if seen:
                new = [v for key, v in sizes.items() if key not in seen]
                wal.append(now - lsn[0])
                added.append(sum(new))
                largest.append(max(new, default=0))
            seen.clear()
            seen.update(sizes)
            lsn[0] = wal_lsn(conn)

        lb.block(subject, n, k, on_step)
    return statistics.median(wal), statistics.median(added), max(largest), state[0]


def write_big_script(path: Path, outputs: int, size: int) -> Path:
    """A scripted model: ``outputs`` turns, each one call of ``blob`` (``size`` bytes), then an answer."""
    import yaml

    turns = [
        {
            "content": "Fetching the next export.",
            "tool_calls": [{"id": "call_a", "name": "blob", "arguments": {"size": size, "seed": i}}],
            "usage": {"prompt_tokens": 900, "completion_tokens": 100},
        }
        for i in range(1, outputs + 1)
    ]
    turns.append({"content": "All exports fetched.", "usage": {"prompt_tokens": 900, "completion_tokens": 20}})
    path.write_text(yaml.safe_dump({"model": "scripted-bench", "turns": turns}, sort_keys=False))
    return path


def run_big(dsn: str, workdir: Path, outputs: int, size: int) -> dict[str, dict[str, float]]:
    """One real run per adapter (runner process, scripted model server in its own process) of
    ``outputs`` tool outputs of ``size`` bytes: wall time, stored bytes of all its rows, peak RSS."""
    import yaml

    from .procs import ModelServer, Proc, cli, write_agentrun

    out: dict[str, dict[str, float]] = {}
    tag = uuid.uuid4().hex[:6]
    for adapter in ("vanilla", "langgraph"):
        name = f"bench-big-{adapter[:2]}-{tag}"
        script = write_big_script(workdir / f"{name}-script.yaml", outputs, size)
        server = ModelServer(script, dsn, workdir)
        manifest = write_agentrun(workdir / f"{name}.yaml", name, script, outputs, adapter, base_url=server.base_url)
        docs = list(yaml.safe_load_all(manifest.read_text()))
        docs[0]["spec"]["tools"] = [{"name": "blob", "ref": "bench.tools:blob"}]
        manifest.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        p = Proc(cli("run", str(manifest), "--dsn", dsn, "--no-wait"), dsn, workdir, name)
        try:
            rc = p.wait(1800)
        finally:
            server.stop()
        if rc != 0:
            raise RuntimeError(f"{name} exited {rc}:\n{p.output()[-3000:]}")
        run_id = f"default/{name}"
        with psycopg.connect(dsn) as conn:
            stored = conn.execute(
                """SELECT (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM agentfast_messages t WHERE run_id = %(r)s)
                        + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM agentfast_tool_calls t WHERE run_id = %(r)s)
                        + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM agentfast_turns t WHERE run_id = %(r)s)
                        + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM agentfast_checkpoints t WHERE run_id = %(r)s)
                        + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM agentfast_sdk_blobs t WHERE run_id = %(r)s)
                        + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM agentfast_payloads t WHERE run_id = %(r)s)""",
                {"r": run_id},
            ).fetchone()[0]
            done = conn.execute(
                "SELECT count(*) FROM agentfast_tool_calls WHERE run_id = %s AND state = 'done'", (run_id,)
            ).fetchone()[0]
        if done != outputs:
            raise RuntimeError(f"{name}: {done} of {outputs} outputs done")
        out[adapter] = {
            "wall_s": p.ended - p.started,
            "bytes": float(stored),
            "outputs": float(done),  # type: ignore[operator]
            "peak_mib": p.maxrss_kib / 1024,
        }
    return out


def run(dsn: str, workdir: Path, cfg: LgConfig, log: Any) -> LgResult:
    """The whole part: timed blocks (subjects rotated per repetition), the bytes pass, the big run."""
    from .checkpoint import autovacuum_paused

    lb = _LgBench(dsn)
    subjects = list(SUBJECTS)
    samples: dict[str, dict[int, list[list[float]]]] = {s: {n: [] for n in cfg.lengths} for s in subjects}
    floor: dict[str, dict[int, list[list[float]]]] = {s: {n: [] for n in cfg.lengths} for s in subjects}
    cpu: dict[str, dict[int, list[float]]] = {s: {n: [] for n in cfg.lengths} for s in subjects}
    wal: dict[str, dict[int, float]] = {s: {} for s in ("adapter", "lg_pg")}
    rows: dict[str, dict[int, float]] = {s: {} for s in ("adapter", "lg_pg")}
    largest: dict[str, dict[int, float]] = {s: {} for s in ("adapter", "lg_pg")}
    state: dict[str, dict[int, float]] = {s: {} for s in ("adapter", "lg_pg")}
    try:
        for s in subjects:  # warm-up: imports, compiles, prepared statements
            lb.block(s, cfg.lengths[0], 3)
        for rep in range(cfg.reps):
            for n in cfg.lengths if rep % 2 == 0 else list(reversed(cfg.lengths)):
                for s in subjects[rep % len(subjects) :] + subjects[: rep % len(subjects)]:
                    got, fl, c = lb.block(s, n, cfg.samples)
                    samples[s][n].append(got)
                    floor[s][n].append(fl)
                    cpu[s][n].extend(c)
            log(f"  langgraph rep {rep + 1}/{cfg.reps} done")
        with autovacuum_paused(dsn):
            for s in ("adapter", "lg_pg"):
                for n in cfg.lengths:
                    wal[s][n], rows[s][n], largest[s][n], state[s][n] = measure_bytes(lb, s, n, cfg.bytes_samples)
        log("  langgraph bytes measured")
    finally:
        lb.close()
    big = run_big(dsn, workdir, cfg.big_outputs, cfg.big_bytes) if cfg.big_outputs else {}
    log(f"  langgraph: {cfg.big_outputs} outputs of {cfg.big_bytes:,} B run through both adapters")
    return LgResult(cfg, samples, floor, cpu, wal, rows, largest, state, big)
