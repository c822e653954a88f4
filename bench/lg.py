"""The two LangGraph subjects of the checkpoint benchmark.

``SaverSteps``: langgraph-checkpoint-postgres's ``PostgresSaver`` storing what LangGraph stores
per superstep of a graph whose ``messages`` channel (the default ``add_messages`` reducer) holds
the transcript: ``put_writes`` with the step's task writes (the three new messages), then ``put``
of the new checkpoint, whose ``messages`` blob is the whole list. LangChain message objects,
serialized by LangGraph's own serde. This is the cheap end of LangGraph's per-iteration cost: a
tool-calling iteration of a ReAct-style graph is two supersteps (agent, then tools), i.e. two
``put``s of the whole list.

``AdapterSteps``: agentfast's own LangGraph adapter (runner/adapters/langgraph.py), measured by
running a real compiled graph under ``LangGraphRunner._step_done``, the code that runs after
every superstep of a real run: ``graph.get_state``, the transcript mirror, ``export_state`` of
the in-memory saver, the journal read for the counters, and ``Store.commit_checkpoint`` with the
whole channel state as ``sdk_state``. The graph's one node appends the three messages of an
iteration per superstep (same caveat: a real iteration is two supersteps).
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Any, Iterator

import psycopg
from psycopg.rows import dict_row

from agentfast.runner.snapshot import Message
from agentfast.runner.store import Store

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

    def thread(self, n: int) -> "SaverThread":
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
        self.config = saver.put({"configurable": {"thread_id": self.thread_id, "checkpoint_ns": ""}}, cp,
                                {"source": "input", "step": -1, "parents": {}}, {"messages": self.version})

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
            "ts": datetime.now(timezone.utc).isoformat(),
            "channel_values": {"messages": self.messages},
            "channel_versions": {"messages": self.version},
            "versions_seen": {"agent": {"messages": self.version}},
            "pending_sends": [],
            "updated_channels": ["messages"],
        }
        self.checkpoint = cp
        self.config = self.saver.put(self.config, cp, {"source": "loop", "step": self.step, "parents": {}},
                                     {"messages": self.version})

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

        from agentfast.runner.adapters.langgraph import LangGraphRunner, SnapshotSaver, to_langchain_message
        from agentfast.runner.spec import parse_agentrun
        from agentfast.runner.tools import ToolRegistry

        lease, snap = prefiller.make_run(n, journal=True)
        ns, name = lease.run_id.split("/")
        run = parse_agentrun({
            "apiVersion": "agentfast.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": name, "namespace": ns, "uid": snap.context.session.run_uid},
            "spec": {"adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"},
                     "model": {"name": "bench", "script": "refund"}, "input": "bench"},
        }, check_imports=False)
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
            return {"messages": [to_langchain_message(m, msg_id=f"agentfast-turn-{self.it}-{i}")
                                 for i, m in enumerate(iteration_messages(self.it))]}

        def more(state):  # noqa: ANN001,ANN202
            self.remaining -= 1
            return "agent" if self.remaining > 0 else END

        g = StateGraph(MessagesState)
        g.add_node("agent", agent)
        g.add_edge(START, "agent")
        g.add_conditional_edges("agent", more, ["agent", END])
        runner.graph = g.compile(checkpointer=runner.saver)
        self.runner = runner
        self.config = {"configurable": {"thread_id": self.thread_id}, "recursion_limit": 10**6}
        self.graph_input = {"messages": [to_langchain_message(m, msg_id=f"agentfast-input-{i}") for i, m in enumerate(snap.messages)]}

    def supersteps(self) -> Iterator[None]:
        """Yields after each superstep has been committed (exactly what the adapter does)."""
        for _ in self.runner.graph.stream(self.graph_input, self.config, stream_mode="updates", durability="sync"):
            self.runner._step_done(self.thread_id, self.config)
            yield None
