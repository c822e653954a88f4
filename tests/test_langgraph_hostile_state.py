"""Issue 30 item 9: the LangGraph adapter decodes stored state with an allow-list of types.

LangGraph's own serializer revives a msgpack extension value by importing and calling whatever
module and name the stored bytes spell: a row of ``agentfast_sdk_blobs`` spelling ``os.system``
ran a command when its run resumed. Here each kind of hostile payload (a module-level function
called with positional, single or keyword arguments, a method call, a class whose construction
has side effects, pydantic v1 and v2, one nested inside an allowed message, pickle, LangChain's
json revival, unknown extension codes, a numpy object array) is first shown to run code through
LangGraph's permissive decoder (where it does) and then refused by the adapter's, naming the
type, with nothing run. The legit types (LangGraph's and langchain_core's, the standard ones,
a graph's declared state types) round-trip; a graph holding an undeclared type fails at once
when it is written, not at its first resume.

On real parts: a real LangGraph run paused for approval in a real PostgreSQL; the table owner
(a stand-in for any write path) rewrites a list row, a pending write, a channel value, the
checkpoint or its metadata, or a row's tag (pickle); the approved run is resumed by a real
runner process: the marker file the payload would create never appears, the run ends
``Failed``/``StateRefused`` naming the type, exit 1 (never 75, never retried), and the approved
refund never runs.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import os
import pickle
import re
import time
import uuid
from collections import deque
from datetime import UTC, date, datetime, timedelta, timezone
from datetime import time as dtime
from decimal import Decimal
from ipaddress import IPv4Address, IPv6Network
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any
from zoneinfo import ZoneInfo

import ormsgpack
import psycopg
import pytest
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, Interrupt, Send
from pydantic import BaseModel, model_validator
from pydantic.v1 import BaseModel as BaseModelV1
from pydantic.v1 import root_validator
from typing_extensions import TypedDict

from agentfast.runner.adapters.langgraph import GraphRuntime, SnapshotSaver, build_graph
from agentfast.runner.adapters.langgraph_serde import AllowListSerializer, StateRefused
from agentfast.runner.store import Store

from .conformance import LANGGRAPH, invocations, refunds, wait_for_approval_request
from .helpers import agentrun_file, run_cli

# -- hostile payloads ------------------------------------------------------------------------------


class Boom(BaseModel):
    """A class whose construction has a side effect: creates the file ``path`` names."""

    path: str

    @model_validator(mode="after")
    def _touch(self) -> Boom:
        Path(self.path).touch()
        return self


class BoomV1(BaseModelV1):
    """The same as a pydantic v1 model."""

    path: str

    @root_validator(skip_on_failure=True)
    def _touch(cls, values: dict) -> dict:  # noqa: N805 - pydantic v1's signature
        Path(values["path"]).touch()
        return values


class _Pickled:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple:
        return (os.system, (self.cmd,))


def _ext(code: int, *parts: Any) -> ormsgpack.Ext:
    return ormsgpack.Ext(code, ormsgpack.packb(parts))


def _msgpack(value: Any) -> tuple[str, bytes]:
    return "msgpack", ormsgpack.packb(value)


def hostile(kind: str, marker: Path) -> tuple[tuple[str, bytes], str]:
    """A stored value that runs code creating ``marker`` when LangGraph's permissive decoder
    reads it, and the type name the adapter's refusal names."""
    m = str(marker)
    here = __name__
    payloads: dict[str, tuple[tuple[str, bytes], str]] = {
        # a module-level function, positional arguments (EXT_CONSTRUCTOR_POS_ARGS)
        "function-args": (_msgpack([_ext(1, "os", "system", (f"touch {m}",))]), "os.system"),
        # one argument (EXT_CONSTRUCTOR_SINGLE_ARG)
        "eval": (_msgpack({"x": _ext(0, "builtins", "eval", f"open({m!r}, 'w').close()")}), "builtins.eval"),
        # keyword arguments (EXT_CONSTRUCTOR_KW_ARGS)
        "popen-kwargs": (_msgpack([_ext(2, "subprocess", "Popen", {"args": ["touch", m]})]), "subprocess.Popen"),
        # a method of any name (EXT_METHOD_SINGLE_ARG)
        "method": (_msgpack(_ext(3, "os", "system", f"touch {m}", "__call__")), "os.system.__call__"),
        # a class whose construction has side effects, with arguments (pydantic v2 and v1)
        "class-v2": (_msgpack([_ext(5, here, "Boom", {"path": m}, "model_validate_json")]), f"{here}.Boom"),
        "class-v1": (_msgpack([_ext(4, here, "BoomV1", {"path": m})]), f"{here}.BoomV1"),
        # nested inside an allowed type: an AIMessage's additional_kwargs
        "nested": (
            _msgpack(
                [
                    _ext(
                        5,
                        "langchain_core.messages.ai",
                        "AIMessage",
                        {"content": "hi", "additional_kwargs": {"x": _ext(1, "os", "system", (f"touch {m}",))}},
                        "model_validate_json",
                    )
                ]
            ),
            "os.system",
        ),
        # a tag LangGraph reads with pickle (pickle_fallback) or LangChain's json reviver
        "pickle": (("pickle", pickle.dumps(_Pickled(f"touch {m}"))), "serialization 'pickle'"),
        "json": (
            ("json", json.dumps({"lc": 2, "type": "constructor", "id": ["os", "system"], "args": [f"touch {m}"]}).encode()),
            "serialization 'json'",
        ),
        # extension codes the adapter never writes
        "unknown-ext": (_msgpack([ormsgpack.Ext(42, b"\x90")]), "msgpack ext type 42"),
        "delta-snapshot": (_msgpack([ormsgpack.Ext(7, ormsgpack.packb([1]))]), "msgpack ext type 7"),
        "numpy-object": (_msgpack([_ext(6, "|O", [1], "C", b"\0" * 8)]), "numpy.ndarray"),
        "malformed": (_msgpack([_ext(1, "os")]), "malformed ext type 1"),
    }
    return payloads[kind]


#: kind -> how LangGraph's own serializer runs it (None: it does not, but it is refused all the same)
PERMISSIVE: dict[str, Any] = {
    "function-args": JsonPlusSerializer,
    "eval": JsonPlusSerializer,
    "popen-kwargs": JsonPlusSerializer,
    "method": None,  # LangGraph checks methods against its own list: refused here too
    "class-v2": JsonPlusSerializer,
    "class-v1": JsonPlusSerializer,
    "nested": JsonPlusSerializer,
    "pickle": lambda: JsonPlusSerializer(pickle_fallback=True),
    "json": None,
    "unknown-ext": None,
    "delta-snapshot": None,
    "numpy-object": None,
    "malformed": None,
}


def _appears(marker: Path, within: float = 1.0) -> bool:
    """Whether ``marker`` exists within ``within`` seconds (a Popen creates it a moment later)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if marker.exists():
            return True
        time.sleep(0.05)
    return marker.exists()


@pytest.mark.parametrize("kind", list(PERMISSIVE))
def test_each_kind_of_hostile_payload_is_refused_naming_its_type_and_runs_nothing(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "ran"
    typed, name = hostile(kind, marker)
    permissive = PERMISSIVE[kind]
    if permissive is not None:  # the attack is real: LangGraph's own decoder runs it
        try:
            permissive().loads_typed(typed)
        except Exception:  # noqa: BLE001, S110 - what matters is the file it made
            pass
        assert _appears(marker), f"{kind}: the payload did not run under LangGraph's decoder"
        marker.unlink()

    for decoder in (AllowListSerializer(), SnapshotSaver().serde):
        with pytest.raises(StateRefused) as refused:
            decoder.loads_typed(typed)
        assert refused.value.type_name.startswith(name)  # numpy's names its dtype when numpy is imported
        assert name in str(refused.value) and "Traceback" not in str(refused.value)
        assert isinstance(refused.value, ValueError)  # what an undecodable state always raised
    assert not _appears(marker, 0.3)


# -- legit types round-trip ------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"


class Point(BaseModel):
    x: int
    color: Color


@dataclasses.dataclass
class Note:
    text: str
    at: datetime


class Undeclared(BaseModel):
    """A type no schema of the graphs below names."""

    n: int


class DeclaredState(TypedDict):
    messages: Annotated[list, add_messages]
    point: Point
    notes: list[Note]
    extra: Any


def _standard_values() -> dict[str, Any]:
    """One of each type LangGraph's serializer writes for the safe types."""
    return {
        "messages": [
            SystemMessage(content="s", id="1"),
            HumanMessage(content="h", id="2"),
            AIMessage(content="", tool_calls=[{"id": "c", "name": "t", "args": {"a": 1}, "type": "tool_call"}], id="3"),
            ToolMessage(content="r", tool_call_id="c", id="4"),
            RemoveMessage(id="2"),
        ],
        "send": Send("tools", {"iteration": 1, "position": 0}),
        "interrupt": Interrupt(value={"call_id": "x"}, id="i"),
        "command": Command(resume={"i": {"decision": "approve"}}),
        "when": datetime(2026, 12, 5, 13, 0, tzinfo=UTC),
        "naive": datetime(2026, 12, 5, 13, 0),
        "day": date(2026, 12, 5),
        "clock": dtime(13, 5, 7),
        "delta": timedelta(days=1, seconds=2),
        "tz": timezone(timedelta(hours=2)),
        "zone": ZoneInfo("Europe/Paris"),
        "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "decimal": Decimal("12.50"),
        "set": {1, 2},
        "frozenset": frozenset({"a"}),
        "deque": deque([1, 2]),
        "ip": IPv4Address("10.0.0.1"),
        "net": IPv6Network("2001:db8::/32"),
        "path": Path("/a/b"),
        "pattern": re.compile("a+b", re.I),
        "bytes": b"\x00\x01",
    }


def test_the_types_langgraph_and_the_adapter_write_round_trip() -> None:
    value = _standard_values()
    serde = AllowListSerializer()
    typed = serde.dumps_typed(value)
    assert typed == JsonPlusSerializer().dumps_typed(value)  # LangGraph's own encoding
    back = serde.loads_typed(typed)
    assert repr(back) == repr(JsonPlusSerializer().loads_typed(typed))  # what LangGraph's decoder gives
    command = back.pop("command")  # LangGraph gives goto=[] for () back: not equal, in LangGraph too
    assert back == {k: v for k, v in value.items() if k != "command"}
    assert isinstance(command, Command) and command.resume == value["command"].resume
    for plain in (None, b"raw", bytearray(b"raw"), 7, "text", [1, {"a": None}]):
        assert serde.loads_typed(serde.dumps_typed(plain)) == plain


def declared_graph(rt: GraphRuntime) -> StateGraph:
    """A user graph whose state schema declares a pydantic model, a dataclass and an enum."""

    def node(state: DeclaredState) -> dict[str, Any]:
        at = datetime(2026, 12, 5, tzinfo=UTC)
        return {
            "messages": [AIMessage(content="done", id="a1")],
            "point": Point(x=len(state["messages"]), color=Color.RED),
            "notes": [Note(text="n", at=at)],
        }

    g = StateGraph(DeclaredState)
    g.add_node("node", node)
    g.add_edge(START, "node")
    return g


def undeclared_graph(rt: GraphRuntime) -> StateGraph:
    """A user graph keeping a type no schema names under ``Any``."""
    g = StateGraph(DeclaredState)
    g.add_node("node", lambda state: {"extra": Undeclared(n=1)})
    g.add_edge(START, "node")
    return g


def allowing_graph(rt: GraphRuntime) -> StateGraph:
    """The same graph, its factory allowing the type it keeps under ``Any``."""
    rt.allow_state_types(Undeclared)
    return undeclared_graph(rt)


def _rt() -> GraphRuntime:
    """A GraphRuntime for a graph that calls neither the model nor tools."""
    return GraphRuntime(SimpleNamespace(tools=SimpleNamespace(schemas=[])))  # type: ignore[arg-type]


def _export_and_reload(ref: str, thread: str, saver: SnapshotSaver) -> tuple[SnapshotSaver, Any]:
    """What a resumed process does: a fresh saver, the graph built, the exported state imported."""
    state = saver.export_state(thread)
    rows = {r.key: (r.type, r.value) for r in saver.take_rows()}
    again = SnapshotSaver()
    graph = build_graph(ref, _rt(), again)
    again.import_state(thread, state, lambda keys, ranges: rows)
    return again, graph


def test_a_graphs_declared_state_types_round_trip_through_a_new_process() -> None:
    ref = f"{__name__}:declared_graph"
    saver = SnapshotSaver()
    graph = build_graph(ref, _rt(), saver)
    allowed = saver.types.allowed()
    for t in (Point, Note, Color):
        assert (t.__module__, t.__name__) in allowed
    assert (Undeclared.__module__, Undeclared.__name__) not in allowed
    thread = str(uuid.uuid4())
    config = {"configurable": {"thread_id": thread}}
    start = {"messages": [HumanMessage(content="q", id="in0")], "point": Point(x=0, color=Color.RED), "notes": []}
    graph.invoke(start, config, durability="sync")
    want = graph.get_state(config).values
    _, again = _export_and_reload(ref, thread, saver)
    got = again.get_state(config).values
    assert got == want and isinstance(got["point"], Point) and isinstance(got["notes"][0], Note)


def test_an_undeclared_type_is_refused_when_written_and_allowed_by_the_factory(tmp_path: Path) -> None:
    thread = str(uuid.uuid4())
    config = {"configurable": {"thread_id": thread}}
    start = {"messages": [], "point": Point(x=0, color=Color.RED), "notes": []}
    graph = build_graph(f"{__name__}:undeclared_graph", _rt(), SnapshotSaver())
    with pytest.raises(StateRefused) as refused:
        graph.invoke(start, config, durability="sync")
    name = f"{__name__}.Undeclared"
    assert refused.value.type_name == name
    assert "channel 'extra'" in str(refused.value) and "rt.allow_state_types()" in str(refused.value)

    ref = f"{__name__}:allowing_graph"
    saver = SnapshotSaver()
    graph = build_graph(ref, _rt(), saver)
    graph.invoke(start, config, durability="sync")
    _, again = _export_and_reload(ref, thread, saver)
    assert again.get_state(config).values["extra"] == Undeclared(n=1)


def test_a_state_the_saver_cannot_parse_is_refused_not_a_traceback() -> None:
    state = {"format": "agentfast.langgraph-saver/2", "next_item": 0, "namespaces": {"": {"checkpoint": ["msgpack", "!!"]}}}
    with pytest.raises(StateRefused, match="malformed"):
        SnapshotSaver().import_state("t", state, lambda keys, ranges: {})


# -- on real parts: a paused run's stored state rewritten, resumed by a real runner ----------------


def _as_owner(dsn: str, run_id: str, sql: str, *params: Any) -> int:
    """Run ``sql`` as the tables' owner (the test database's admin), passing the fence as any
    writer with the run's current epoch would: a stand-in for any write path. Returns rowcount."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "SELECT set_config('agentfast.epoch', epoch::text, true), set_config('agentfast.run_uid', run_uid, true)"
            " FROM agentfast_runs WHERE run_id = %s",
            (run_id,),
        )
        return conn.execute(sql, params).rowcount


def _rewrite_state(dsn: str, run_id: str, change: Any) -> None:
    """Rewrite the run's latest checkpoint's sdk_state with ``change(state)``."""
    with psycopg.connect(dsn) as conn:
        cid, state = conn.execute(
            "SELECT checkpoint_id, sdk_state FROM agentfast_checkpoints WHERE run_id = %s ORDER BY checkpoint_id DESC LIMIT 1",
            (run_id,),
        ).fetchone()
    change(state["namespaces"][""])
    n = _as_owner(
        dsn,
        run_id,
        "UPDATE agentfast_checkpoints SET sdk_state = %s WHERE run_id = %s AND checkpoint_id = %s",
        json.dumps(state),
        run_id,
        cid,
    )
    assert n == 1


def _b64(typed: tuple[str, bytes]) -> list[str]:
    return [typed[0], base64.b64encode(typed[1]).decode()]


def _tamper(site: str, dsn: str, run_id: str, typed: tuple[str, bytes]) -> None:
    """Write ``typed`` where ``site`` says in the paused run's stored LangGraph state."""
    if site in ("list-row", "write-row"):
        pattern = "i%" if site == "list-row" else '["w"%'
        n = _as_owner(
            dsn,
            run_id,
            "UPDATE agentfast_sdk_blobs SET type = %s, value = %s WHERE run_id = %s"
            " AND key = (SELECT min(key) FROM agentfast_sdk_blobs WHERE run_id = %s AND key LIKE %s)",
            typed[0],
            typed[1],
            run_id,
            run_id,
            pattern,
        )
        assert n == 1, f"no {site} to rewrite"
    elif site == "inline-value":  # a channel's value kept in sdk_state itself
        _rewrite_state(dsn, run_id, lambda entry: entry["channels"].__setitem__("messages", {"value": _b64(typed)}))
    elif site == "value-row":  # a channel's value in a row of its own, named by key
        key = json.dumps(["v", "", "messages", "999"])
        n = _as_owner(
            dsn,
            run_id,
            "INSERT INTO agentfast_sdk_blobs (run_id, key, type, value, epoch) VALUES (%s, %s, %s, %s, 0)",
            run_id,
            key,
            *typed,
        )
        assert n == 1
        _rewrite_state(dsn, run_id, lambda entry: entry["channels"].__setitem__("messages", {"key": key}))
    else:  # "checkpoint" or "metadata"
        _rewrite_state(dsn, run_id, lambda entry: entry.__setitem__(site, _b64(typed)))


#: (where the hostile value is written, which payload): each site, each kind of call
SITES = [
    ("list-row", "function-args"),
    ("write-row", "popen-kwargs"),
    ("inline-value", "eval"),
    ("value-row", "class-v1"),
    ("checkpoint", "method"),
    ("metadata", "class-v2"),
    ("list-row", "nested"),
    ("write-row", "pickle"),
]


@pytest.mark.process  # real runner processes
@pytest.mark.parametrize(("site", "kind"), SITES, ids=[f"{s}-{k}" for s, k in SITES])
def test_a_hostile_blob_in_a_paused_runs_state_is_refused_on_resume_and_runs_nothing(
    tmp_path: Path, dsn: str, store: Store, site: str, kind: str
) -> None:
    adapter = LANGGRAPH
    path = agentrun_file(tmp_path, adapter.example)
    paused = run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert paused.returncode == 0, paused.stdout
    call = wait_for_approval_request(store, adapter.run_id)

    marker = tmp_path / "ran"
    typed, name = hostile(kind, marker)
    _tamper(site, dsn, adapter.run_id, typed)
    store.decide(adapter.run_id, call, "approve", decided_by="test")

    resumed = run_cli("resume", adapter.run_name, dsn=dsn)
    assert resumed.returncode == 1, resumed.stdout  # Failed for good: not 75 (retried), not a crash
    assert "Traceback" not in resumed.stdout
    assert not _appears(marker, 0.5)
    status = store.load_snapshot(adapter.run_id).context.status
    assert (status.phase, status.reason) == ("Failed", "StateRefused")
    assert name in status.message and "LangGraph state refused" in status.message
    assert refunds(dsn) == 0 and invocations(dsn, "issue_refund") == 0  # approved, but never run

    again = run_cli("resume", adapter.run_name, dsn=dsn)  # ended: the bytes are never read again
    assert again.returncode == 1 and not _appears(marker, 0.2)
