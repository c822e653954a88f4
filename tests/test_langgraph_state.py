"""The LangGraph adapter's state in the store (issue 15 item 3): deltas, not the channel state.

A real compiled graph (``MessagesState``, LangGraph's ``add_messages``) runs on the adapter's
``SnapshotSaver``; after each superstep its export is committed with ``Store.commit_checkpoint``
to a real PostgreSQL, as ``LangGraphRunner._step_done`` does; a new saver is then seeded from
what the store holds. Asserted: what a superstep writes and every stored value stay the same
size whether the transcript holds 12 messages or 1,200; a resume rebuilds the same state and
goes on; a 2 MB message is stored once; the old format (/1) still loads; DeltaChannel is
refused with a clear error; writes for a superseded checkpoint are dropped.
"""

from __future__ import annotations

import base64
import json
import operator
import uuid
from typing import Annotated, Any

import psycopg
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.channels import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from typing_extensions import TypedDict

from agentfast.runner.adapters.langgraph import SDK_STATE_FORMAT, GraphRuntime, SnapshotSaver, build_graph
from agentfast.runner.snapshot import RunContext, Session, StateSnapshot
from agentfast.runner.spec import SpecError
from agentfast.runner.store import Lease, Store


def _loop(saver: Any, steps: int, agent: Any) -> Any:
    """The graph agent -> agent -> ... (``steps`` times) on ``saver``, with ``agent`` as its node, compiled."""
    left = [steps]

    def more(state: MessagesState) -> str:
        left[0] -= 1
        return "agent" if left[0] > 0 else END

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", more, ["agent", END])
    return g.compile(checkpointer=saver)


def _graph(saver: Any, steps: int, big: int = 0) -> Any:
    """agent -> agent -> ... (``steps`` times): each step appends an AI message and two tool
    results (the second one ``big`` bytes long when given) to ``messages``."""

    def agent(state: MessagesState) -> dict:
        i = len(state["messages"])
        return {
            "messages": [
                AIMessage(content=f"turn {i}", id=f"a{i}"),
                ToolMessage(content="r" * 300, tool_call_id=f"c{i}", id=f"t{i}"),
                ToolMessage(content=("B" * big) if big else "s" * 300, tool_call_id=f"d{i}", id=f"u{i}"),
            ]
        }

    return _loop(saver, steps, agent)


def _run(store: Store, n: int) -> tuple[Lease, StateSnapshot]:
    uid = str(uuid.uuid4())
    run_id = f"lg/state-{uid[:8]}"
    store.create_run(run_id, uid, {"spec": {"adapter": "langgraph"}})
    lease = store.acquire_lease(run_id)
    snap = StateSnapshot(
        run_id=run_id, context=RunContext(session=Session(run_uid=uid, adapter="langgraph", model="m")), messages=[]
    )
    return lease, snap


def _drive(
    store: Store,
    lease: Lease,
    snap: StateSnapshot,
    saver: SnapshotSaver,
    graph: Any,
    graph_input: Any,
    largest: list[int] | None = None,
) -> list[int]:
    """Stream the graph, committing after every superstep as the runner does; returns the
    number of sdk rows each commit wrote (and appends its largest value's bytes to ``largest``)."""
    thread = snap.context.session.run_uid
    config = {"configurable": {"thread_id": thread}, "recursion_limit": 10_000}
    written = []
    for _ in graph.stream(graph_input, config, stream_mode="updates", durability="sync"):
        snap.sdk_state = saver.export_state(thread)
        rows = saver.take_rows()
        store.commit_checkpoint(lease, snap, stored_messages=len(snap.messages), sdk_rows=rows)
        saver.rows_stored(rows)
        written.append(len(rows))
        if largest is not None:
            largest.append(max((len(r.value) for r in rows), default=0))
    return written


def _stored(dsn: str, run_id: str) -> tuple[int, int]:
    """(rows, largest stored value in bytes) of the run's sdk rows."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT count(*), coalesce(max(octet_length(value)), 0) FROM agentfast_sdk_blobs WHERE run_id = %s", (run_id,)
        ).fetchone()


def _loader(store: Store, run_id: str) -> Any:
    return lambda keys, ranges: store.sdk_rows(run_id, keys, ranges)


def test_a_superstep_writes_the_same_few_rows_and_a_small_state_at_any_length(store: Store, dsn: str) -> None:
    sizes = {}
    for n in (12, 1200):
        lease, snap = _run(store, n)
        saver = SnapshotSaver()
        graph_input = {"messages": [HumanMessage(content="q" * 300, id=f"in{i}") for i in range(n)]}
        largest: list[int] = []
        written = _drive(store, lease, snap, saver, _graph(saver, 6), graph_input, largest)
        # After the input step: each superstep writes one row, its three new messages (the small
        # values that changed ride in sdk_state): never the transcript.
        assert written[1:] == [1] * (len(written) - 1), written
        state_bytes = len(json.dumps(snap.sdk_state))
        rows, _ = _stored(dsn, lease.run_id)
        assert rows == sum(written)  # every row sent was new: none written twice
        # The first superstep also stores the graph's input (the run's first messages), once.
        sizes[n] = (state_bytes, written[1:], max(largest[1:]))
        # What a superstep stores depends on the graph, not the transcript: one range of message rows.
        assert snap.sdk_state["format"] == SDK_STATE_FORMAT
        assert snap.sdk_state["namespaces"][""]["channels"]["messages"] == {"items": [[0, n + 18]]}
    (s_lo, w_lo, big_lo), (s_hi, w_hi, big_hi) = sizes[12], sizes[1200]
    assert w_lo == w_hi and abs(big_hi - big_lo) <= 16, sizes  # the same rows; numbers in the text have more digits
    assert abs(s_hi - s_lo) <= 16, sizes  # only the digits of the larger numbers differ


def test_a_new_saver_seeded_from_the_store_has_the_same_state_and_goes_on(store: Store, dsn: str) -> None:
    lease, snap = _run(store, 30)
    saver = SnapshotSaver()
    thread = snap.context.session.run_uid
    config = {"configurable": {"thread_id": thread}}
    _drive(
        store, lease, snap, saver, _graph(saver, 4), {"messages": [HumanMessage(content=f"q{i}", id=f"in{i}") for i in range(30)]}
    )
    before = _graph(saver, 1).get_state(config)

    committed = store.load_snapshot(lease.run_id)
    fresh = SnapshotSaver()
    fresh.import_state(thread, committed.sdk_state, _loader(store, lease.run_id))
    assert fresh.take_rows() == []  # nothing to write again
    graph = _graph(fresh, 2)
    after = graph.get_state(config)
    assert [(m.id, m.content, type(m)) for m in after.values["messages"]] == [
        (m.id, m.content, type(m)) for m in before.values["messages"]
    ]
    assert (
        after.next == before.next
        and after.config["configurable"]["checkpoint_id"] == before.config["configurable"]["checkpoint_id"]
    )

    # It goes on where the first one stopped: new input appends, the rows continue the range.
    snap.sdk_state = committed.sdk_state
    written = _drive(store, lease, snap, fresh, graph, {"messages": [HumanMessage(content="more", id="more")]})
    assert len(written) == 2 and all(w <= 8 for w in written), written
    again = SnapshotSaver()
    again.import_state(thread, store.load_snapshot(lease.run_id).sdk_state, _loader(store, lease.run_id))
    msgs = _graph(again, 1).get_state(config).values["messages"]
    assert len(msgs) == len(before.values["messages"]) + 1 + 3 * 2 and msgs[-3].id == f"a{len(msgs) - 3}"
    assert len({m.id for m in msgs}) == len(msgs)
    assert store.load_snapshot(lease.run_id).sdk_state["namespaces"][""]["channels"]["messages"] == {"items": [[0, len(msgs)]]}


def test_a_large_message_is_stored_once(store: Store, dsn: str) -> None:
    lease, snap = _run(store, 3)
    saver = SnapshotSaver()
    _drive(store, lease, snap, saver, _graph(saver, 5, big=2_000_000), {"messages": [HumanMessage(content="q", id="in0")]})
    with psycopg.connect(dsn) as conn:
        big = conn.execute(
            "SELECT count(*) FROM agentfast_sdk_blobs WHERE run_id = %s AND octet_length(value) > 1000000", (lease.run_id,)
        ).fetchone()[0]
        state = conn.execute(
            "SELECT max(pg_column_size(sdk_state)) FROM agentfast_checkpoints WHERE run_id = %s", (lease.run_id,)
        ).fetchone()[0]
    assert big == 5  # one row per 2 MB message, however many checkpoints followed it
    assert state < 4096


def _export_v1(saver: InMemorySaver, thread_id: str) -> dict[str, Any]:
    """What the adapter's export_state wrote before format /2 (a fixture: old rows in the field)."""

    def enc(typed: tuple[str, bytes]) -> list[str]:
        return [typed[0], base64.b64encode(typed[1]).decode()]

    namespaces = {}
    for ns, checkpoints in saver.storage.get(thread_id, {}).items():
        cid = max(checkpoints)
        cp_typed, md_typed, parent_id = checkpoints[cid]
        versions = saver.serde.loads_typed(cp_typed)["channel_versions"]
        blobs = [
            [ch, ver, *enc(saver.blobs[(thread_id, ns, ch, ver)])]
            for ch, ver in versions.items()
            if (thread_id, ns, ch, ver) in saver.blobs
        ]
        writes = [
            [task_id, idx, channel, *enc(value), task_path]
            for (task_id, idx), (_, channel, value, task_path) in saver.writes.get((thread_id, ns, cid), {}).items()
        ]
        namespaces[ns] = {
            "checkpoint_id": cid,
            "parent_id": parent_id,
            "checkpoint": enc(cp_typed),
            "metadata": enc(md_typed),
            "blobs": blobs,
            "writes": writes,
        }
    return {"format": "agentfast.langgraph-saver/1", "namespaces": namespaces}


def test_a_state_of_format_1_still_loads_and_is_stored_as_rows_from_then_on(store: Store, dsn: str) -> None:
    old = InMemorySaver()
    thread = str(uuid.uuid4())
    config = {"configurable": {"thread_id": thread}}
    graph = _graph(old, 3)
    graph.invoke({"messages": [HumanMessage(content="q", id="in0")]}, config)
    v1 = _export_v1(old, thread)
    want = [(m.id, m.content) for m in graph.get_state(config).values["messages"]]

    saver = SnapshotSaver()
    saver.import_state(thread, v1)
    assert [(m.id, m.content) for m in _graph(saver, 1).get_state(config).values["messages"]] == want
    lease, snap = _run(store, 0)
    snap.sdk_state = saver.export_state(thread)
    rows = saver.take_rows()
    assert snap.sdk_state["format"] == SDK_STATE_FORMAT and [r.key for r in rows] == ["i000000000000"]  # the list, as one row
    store.commit_checkpoint(lease, snap, stored_messages=0, sdk_rows=rows)
    saver.rows_stored(rows)
    again = SnapshotSaver()
    again.import_state(thread, store.load_snapshot(lease.run_id).sdk_state, _loader(store, lease.run_id))
    assert [(m.id, m.content) for m in _graph(again, 1).get_state(config).values["messages"]] == want


def test_a_foreign_format_or_a_missing_row_is_refused() -> None:
    with pytest.raises(ValueError, match="format"):
        SnapshotSaver().import_state("t", {"format": "something/9", "namespaces": {}})
    state = {
        "format": SDK_STATE_FORMAT,
        "next_item": 1,
        "namespaces": {
            "": {
                "checkpoint_id": "x",
                "parent_id": None,
                "checkpoint": ["msgpack", ""],
                "metadata": ["msgpack", ""],
                "channels": {"messages": {"items": [[0, 1]]}},
                "writes": [],
            }
        },
    }
    with pytest.raises(ValueError, match="not stored"):
        SnapshotSaver().import_state("t", state, lambda keys, ranges: {})


def test_writes_for_a_superseded_checkpoint_are_dropped() -> None:
    saver = SnapshotSaver()
    thread = str(uuid.uuid4())
    config = {"configurable": {"thread_id": thread}}
    _graph(saver, 2).invoke({"messages": [HumanMessage(content="q", id="in0")]}, config)
    latest = saver.get_tuple(config)
    parent = latest.parent_config
    saver.put_writes(parent, [("messages", [AIMessage(content="late", id="late")])], "task-late")
    assert saver.get_tuple(config).pending_writes == latest.pending_writes
    assert saver.get_tuple(parent) is None  # only the latest checkpoint is kept
    saver.put_writes(latest.config, [("messages", [AIMessage(content="now", id="now")])], "task-now")
    assert [w[0] for w in saver.get_tuple(config).pending_writes] == ["task-now"]


class DeltaState(TypedDict):
    messages: Annotated[list, DeltaChannel(lambda state, writes: (state or []) + [x for w in writes for x in w])]
    count: Annotated[int, operator.add]


def delta_graph(rt: GraphRuntime) -> StateGraph:
    """A user graph whose state uses DeltaChannel (referenced by the test below)."""
    g = StateGraph(DeltaState)
    g.add_node("a", lambda s: {"count": 1})
    g.add_edge(START, "a")
    return g


def test_a_graph_with_a_delta_channel_is_refused_clearly() -> None:
    with pytest.raises(SpecError, match="DeltaChannel.*messages"):
        build_graph("tests.test_langgraph_state:delta_graph", None, SnapshotSaver())  # type: ignore[arg-type]


def test_a_namespaces_runner_role_writes_and_reads_only_its_own_sdk_rows(store: Store, dsn: str) -> None:
    lease, snap = _run(store, 3)  # namespace "lg"
    theirs, _ = _run(store, 3)
    role, _ = store.set_tenant_password("lg", "pw-lg")
    other, _ = store.set_tenant_password("lg-other", "pw-other")
    with Store(psycopg.conninfo.make_conninfo(dsn, user=role, password="pw-lg")) as mine:
        saver = SnapshotSaver()
        _drive(mine, lease, snap, saver, _graph(saver, 2), {"messages": [HumanMessage(content="q", id="in0")]})
        fresh = SnapshotSaver()
        fresh.import_state(snap.context.session.run_uid, mine.load_snapshot(lease.run_id).sdk_state, _loader(mine, lease.run_id))
        assert (
            len(_graph(fresh, 1).get_state({"configurable": {"thread_id": snap.context.session.run_uid}}).values["messages"]) == 7
        )
    with psycopg.connect(psycopg.conninfo.make_conninfo(dsn, user=other, password="pw-other"), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM agentfast_sdk_blobs").fetchone()[0] == 0  # not even seen
        with pytest.raises(psycopg.Error) as err:
            with conn.transaction():
                conn.execute(
                    "SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', %s, true)",
                    (str(lease.epoch), lease.run_uid),
                )
                conn.execute(
                    "INSERT INTO agentfast_sdk_blobs (run_id, key, type, value, epoch) VALUES (%s, 'x', 't', '', 0)",
                    (lease.run_id,),
                )
        assert err.value.sqlstate in ("AF001", "42501"), err.value
    assert _stored(dsn, lease.run_id)[0] > 0 and _stored(dsn, theirs.run_id)[0] == 0


def test_the_incremental_add_messages_gives_what_langgraphs_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from langchain_core.messages import AIMessageChunk, RemoveMessage
    from langgraph.graph.message import add_messages

    import agentfast.runner.adapters.langgraph as adapter

    full_path = []
    monkeypatch.setattr(adapter, "add_messages", lambda *a, **kw: full_path.append(1) or add_messages(*a, **kw))
    rng = random.Random(7)
    fast = adapter.IncrementalAddMessages()
    ours = theirs = [HumanMessage(content="start", id="m0")]
    appends = 0
    for step in range(300):
        k = len(theirs)
        kind = rng.random()
        if kind < 0.7:  # the common case: new messages appended
            right = [
                AIMessage(content=f"a{step}", id=f"a{step}"),
                ToolMessage(content=f"t{step}", tool_call_id="c", id=f"t{step}"),
            ]
        elif kind < 0.8:  # a replacement of an existing id
            right = [AIMessage(content=f"edit{step}", id=theirs[rng.randrange(k)].id)]
        elif kind < 0.85 and k > 2:  # a removal
            right = [RemoveMessage(id=theirs[rng.randrange(k)].id)]
        elif kind < 0.9:  # no id: one is assigned (compared below by content and position only)
            right = [HumanMessage(content=f"noid{step}")]
        elif kind < 0.95:  # a chunk, converted to a message
            right = [AIMessageChunk(content=f"chunk{step}", id=f"k{step}")]
        else:  # a duplicate id inside one update
            right = [AIMessage(content=f"d{step}", id=f"d{step}"), AIMessage(content=f"d{step}b", id=f"d{step}")]
        # The same message objects go to both: compare what each returns.
        appends += kind < 0.7
        ours = fast(ours, list(right))
        theirs = add_messages(theirs, list(right))
        assert [(type(m), m.content) for m in ours] == [(type(m), m.content) for m in theirs], step
        assert [m.id for m in ours if not m.content.startswith("noid")] == [
            m.id for m in theirs if not m.content.startswith("noid")
        ]
        assert len({m.id for m in ours}) == len(ours)
        if step % 50 == 0:  # a list the reducer has not seen (as a resumed process's first update): the full path
            ours = list(ours)
    assert len(full_path) <= 300 - appends + 7  # every append but the first ones after a list it never returned: fast
    assert appends > 150


def test_with_the_adapters_reducer_the_saver_keeps_what_the_graph_holds_even_if_a_node_changes_it_in_place(
    store: Store, dsn: str
) -> None:
    """Under ``speed_up_reducers`` the saver keeps the reducer's copies of the list (no copy of its
    own); a node that changes the channel's list in place (LangGraph hands it the live list) must
    still be seen, step after step, by the saver, the store and a resumed saver."""
    from agentfast.runner.adapters.langgraph import speed_up_reducers

    def graph_on(saver: Any, steps: int) -> Any:
        def agent(state: MessagesState) -> dict:
            msgs = state["messages"]
            i = len(msgs)
            if i % 4 == 1:  # in place, behind the reducer's back: an edit and an append
                msgs[-1] = HumanMessage(content=f"edited {i}", id=msgs[-1].id)
                msgs.append(HumanMessage(content=f"sneaked {i}", id=f"s{i}"))
            return {
                "messages": [
                    AIMessage(content=f"turn {i}", id=f"a{i}"),
                    ToolMessage(content="r", tool_call_id=f"c{i}", id=f"t{i}"),
                ]
            }

        return speed_up_reducers(_loop(saver, steps, agent))

    lease, snap = _run(store, 3)
    saver = SnapshotSaver()
    thread = snap.context.session.run_uid
    config = {"configurable": {"thread_id": thread}, "recursion_limit": 10_000}
    graph = graph_on(saver, 12)
    theirs = graph_on(InMemorySaver(), 12)
    graph_input = {"messages": [HumanMessage(content=f"q{i}", id=f"in{i}") for i in range(3)]}
    seen = []
    for _ours, _theirs in zip(
        graph.stream(graph_input, config, stream_mode="updates", durability="sync"),
        theirs.stream(graph_input, config, stream_mode="updates", durability="sync"),
        strict=True,
    ):
        kept = saver.settled("messages")
        live = graph.get_state(config).values["messages"]
        assert [(m.id, m.content) for m in kept] == [(m.id, m.content) for m in live]
        assert [(m.id, m.content) for m in kept] == [(m.id, m.content) for m in theirs.get_state(config).values["messages"]]
        seen.append(len(kept))
        snap.sdk_state = saver.export_state(thread)
        rows = saver.take_rows()
        store.commit_checkpoint(lease, snap, stored_messages=len(snap.messages), sdk_rows=rows)
        saver.rows_stored(rows)
    assert len(seen) == 12 and any("sneaked" in m.content for m in kept) and any("edited" in m.content for m in kept)
    fresh = SnapshotSaver()
    fresh.import_state(thread, store.load_snapshot(lease.run_id).sdk_state, _loader(store, lease.run_id))
    assert [(m.id, m.content) for m in fresh.settled("messages")] == [(m.id, m.content) for m in kept]
