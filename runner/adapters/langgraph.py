"""The LangGraph adapter: a graph-native agent under the runtime's guarantees G1 to G9.

How it fits together (docs/architecture.md, "LangGraph adapter", says why):

- **State (G8).** LangGraph keeps its channel state through its own checkpointer contract. The
  adapter hands the graph a :class:`SnapshotSaver`, which keeps the latest checkpoint and turns
  what changed into rows written once (an appended message is one row, written once). After
  every superstep (``durability="sync"``) the runtime commits the new rows and a small
  ``sdk_state`` naming them in one transaction, and seeds a new process's saver from them on
  resume. The runtime never reads either, and nothing outside the saver calls LangGraph's
  persistence primitives: LangGraph does. No stored value grows with the transcript.
- **Model turns.** :class:`RuntimeChatModel` is a LangChain chat model over the runtime's
  provider: each call is an iteration, budget-checked first (G7), and its reply is persisted
  before any tool runs, so a re-executed agent node gets the same reply and the same tool calls.
- **Tools (G3 to G5).** :func:`GraphRuntime.route_tools` fans a model batch out as one ``Send``
  per call, in the model's order; :meth:`GraphRuntime.tool_node` runs each call through the
  journal with its idempotency key, so a finished call never runs again, whichever of
  LangGraph's re-executions reaches it. A gated call (or an unsafe in-flight one) calls
  ``interrupt()``; the run pauses as ``WaitingForApproval`` with every interrupted call of the
  superstep in ``pending.awaiting`` and the finished siblings in
  ``pending.executed_sibling_results``; once each is decided (in the store), one
  ``Command(resume={interrupt id: decision, ...})`` resumes them all. One Send per call means each task holds at most one interrupt, so
  a resume value can never reach the wrong call (langgraph#6533).

A user's graph is a factory ``module:attr`` taking a :class:`GraphRuntime` and returning a
``StateGraph`` (uncompiled, or compiled: it is recompiled with the adapter's checkpointer). It
must use ``rt.model`` for model calls and ``rt.route_tools`` / ``rt.tool_node`` for tools.
"""

from __future__ import annotations

import base64
import builtins
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from langgraph.channels.binop import BinaryOperatorAggregate
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END
from langgraph.graph.message import add_messages

try:
    from langgraph.channels import DeltaChannel
except ImportError:  # a LangGraph release before it
    DeltaChannel = None  # type: ignore[assignment,misc]
from langgraph.types import Command, Send, interrupt
from pydantic import ConfigDict

from ..arguments import loads_arguments
from ..errors import AgentfastError
from ..loop import Outcome, RunnerBase
from ..names import Phase
from ..snapshot import Message, ToolCall, ToolResult
from ..spec import SpecError, resolve_ref
from ..storable import storable
from ..store import SdkRow
from .langgraph_serde import AllowListSerializer, StateRefused, graph_state_types
from .langgraph_state import SDK_STATE_FORMAT, state_row_refs
from .langgraph_state import item_key as _item_key

log = logging.getLogger(__name__)

_FORMAT_V1 = "agentfast.langgraph-saver/1"  # the whole channel state inline; still loaded (runs checkpointed before /2)


class StopRequested(AgentfastError):
    """Raised inside a graph node at a safe point where the run must start nothing more (SIGTERM,
    a cancel request, the deadline: ``RunnerBase.halted``): no new model or tool call starts."""


# -- the opaque state -----------------------------------------------------------------------


def _enc(typed: tuple[str, bytes]) -> list[str]:
    return [typed[0], base64.b64encode(typed[1]).decode()]


def _dec(pair: list[str]) -> tuple[str, bytes]:
    return pair[0], base64.b64decode(pair[1])


_INLINE_BYTES = 512  # a non-list channel value up to this size is kept in sdk_state, not in a row of its own


def _cut(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The first ``n`` elements of the list that ``ranges`` (``[lo, hi)`` item seqs) spell."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if n <= 0:
            break
        take = min(hi - lo, n)
        out.append((lo, lo + take))
        n -= take
    return out


def _common_prefix(old: list[Any], new: list[Any]) -> int:
    i, n = 0, min(len(old), len(new))
    while i < n and (old[i] is new[i] or old[i] == new[i]):
        i += 1
    return i


@dataclass
class _Kept:
    """One channel's value at ``version``, as kept between LangGraph's ``put`` and the store.

    A list (``items``: a copy of the list, ``ranges``: the element numbers that spell it, as
    ``[lo, hi)``) or any other value (``typed``: its serialized form, ``key``: its row, "" when
    it is small enough to ride inline in ``sdk_state``). ``base``: the previous value's ``items``
    when ``items`` only appends to it (see :meth:`SnapshotSaver.extends`). ``items`` lists are the
    saver's own and never changed once made."""

    version: Any
    items: list[Any] | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)
    base: list[Any] | None = None
    typed: tuple[str, bytes] | None = None
    key: str = ""


class SnapshotSaver(InMemorySaver):
    """LangGraph's checkpointer for one run, whose state the runtime stores as small deltas.

    LangGraph calls ``put``/``put_writes``/``get_tuple`` as its checkpointer contract says. The
    saver keeps only the latest checkpoint of each namespace (a run resumes from its latest, and
    the runtime never asks for another), and turns what LangGraph hands it into rows written once
    (:class:`~agentfast.runner.store.SdkRow`, LangGraph's own serde inside):

    - a list-valued channel (``messages`` under ``add_messages``, any append-style reducer) is
      stored as it grows: the elements a ``put`` appends get per-run sequence numbers and one row
      together (key ``i`` + the first number), and the list is the ranges of numbers that spell
      it. An appended message is written once; the list's reference stays one range however
      long the transcript grows. A list that changed in the middle (a removed or replaced
      message) keeps the common prefix's numbers and writes its new tail;
    - any other channel value is one row per (namespace, channel, version), as LangGraph's
      PostgresSaver stores its blobs, or, up to 512 bytes serialized, inline in ``sdk_state``;
      a pending write is one row per (checkpoint, task, index).

    :meth:`export_state` gives the small, JSON-safe ``sdk_state`` that names those rows (its size
    depends on the graph's channels and nodes, not on the transcript) and :meth:`take_rows` the
    rows it names that are not stored yet; the runtime commits both in one transaction.
    :meth:`import_state` seeds a new process's saver from them. Values are kept as the live
    objects LangGraph handed over (lists copied): a node that mutates a message in place after
    returning it changes what this process sees, not what was stored.

    Values are encoded by LangGraph's serializer and decoded only if every type they name is on
    the allow-list of ``types`` (:class:`~.langgraph_serde.AllowListSerializer`: LangGraph's safe
    types plus what ``types.allow`` adds; :func:`build_graph` adds the graph's declared types):
    any read of stored state or write of a new value raises StateRefused otherwise, naming the
    type and where it is.

    Thread-safe: LangGraph may call ``put_writes`` from its executor threads.
    """

    def __init__(self) -> None:
        self.types = AllowListSerializer()
        super().__init__(serde=self.types)
        self._lock = threading.RLock()
        self._thread: str | None = None
        self._latest: dict[str, dict[str, Any]] = {}  # ns -> its latest checkpoint (see put)
        self._values: dict[tuple[str, str], _Kept] = {}  # (ns, channel) -> its value at the latest version
        self._next_item = 0
        self._pending: dict[str, SdkRow] = {}  # rows made since the last export
        self._exported: dict[str, SdkRow] = {}  # rows the last exported state names, not known to be stored
        self._reducers: dict[str, IncrementalAddMessages] = {}  # channel -> its reducer (speed_up_reducers)

    # LangGraph's checkpointer contract ------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The namespace's latest checkpoint with its channel values and pending writes; None
        for another thread, or for a ``checkpoint_id`` that is not the latest (none is kept)."""
        conf = config["configurable"]
        ns = conf.get("checkpoint_ns", "")
        with self._lock:
            latest = self._latest.get(ns)
            if conf.get("thread_id") != self._thread or latest is None:
                return None
            cid = get_checkpoint_id(config)
            if cid and cid != latest["id"]:
                return None
            checkpoint: Checkpoint = self._load(latest["checkpoint"], f"the checkpoint of namespace {ns!r}")
            values: dict[str, Any] = {}
            for ch, ver in checkpoint["channel_versions"].items():
                kept = self._values.get((ns, ch))
                if kept is not None and kept.version == ver:
                    values[ch] = list(kept.items) if kept.items is not None else self._load_kept(ns, ch, kept)
            stored = latest["writes"]
            order = sorted(stored, key=lambda k: writes_sort_key(stored[k][3], *k))
            writes = [
                (stored[k][0], stored[k][1], self._load(stored[k][2], f"a pending write of task {k[0]} in namespace {ns!r}"))
                for k in order
            ]
            parent = latest["parent"]
            return CheckpointTuple(
                config={"configurable": {"thread_id": self._thread, "checkpoint_ns": ns, "checkpoint_id": latest["id"]}},
                checkpoint={**checkpoint, "channel_values": values},
                metadata=self._load(latest["metadata"], f"the checkpoint metadata of namespace {ns!r}"),
                pending_writes=writes,
                parent_config={"configurable": {"thread_id": self._thread, "checkpoint_ns": ns, "checkpoint_id": parent}}
                if parent
                else None,
            )

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """The latest checkpoint of the config's namespace, if any: older ones are not kept."""
        if config is None or before is not None:
            return
        got = self.get_tuple({"configurable": {**config["configurable"], "checkpoint_id": None}})
        if got is not None and all(got.metadata.get(k) == v for k, v in (filter or {}).items()):
            yield got

    def put(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, new_versions: ChannelVersions
    ) -> RunnableConfig:
        """Keep ``checkpoint`` as its namespace's latest; a changed channel value becomes rows."""
        conf = config["configurable"]
        ns = conf["checkpoint_ns"]
        c = checkpoint.copy()
        values: dict[str, Any] = c.pop("channel_values")  # type: ignore[misc]
        with self._lock:
            self._thread = conf["thread_id"]
            for ch, ver in new_versions.items():
                if ch in values:
                    self._values[(ns, ch)] = self._keep(ns, ch, ver, values[ch])
                else:
                    self._values.pop((ns, ch), None)
            self._latest[ns] = {
                "id": checkpoint["id"],
                "parent": conf.get("checkpoint_id"),
                "checkpoint": self._dump(c, "the checkpoint"),
                "metadata": self._dump(get_checkpoint_metadata(config, metadata), "the checkpoint metadata"),
                "versions": dict(checkpoint["channel_versions"]),
                "writes": {},
                "written": set(),  # keys of the writes already made rows
            }
        return {"configurable": {"thread_id": conf["thread_id"], "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = "") -> None:
        """Keep a task's writes on its namespace's latest checkpoint. Writes for an older
        checkpoint (LangGraph's executor may deliver them after the next ``put``) are dropped:
        the checkpoint they belong to is superseded, and the next one holds their effect."""
        conf = config["configurable"]
        ns = conf.get("checkpoint_ns", "")
        with self._lock:
            latest = self._latest.get(ns)
            if latest is None or latest["id"] != conf["checkpoint_id"]:
                return
            for idx, (channel, value) in enumerate(writes):
                inner = (task_id, WRITES_IDX_MAP.get(channel, idx))
                if inner[1] >= 0 and inner in latest["writes"]:
                    continue
                typed = self._dump(value, f"a write of task {task_id} to channel {channel!r}")
                latest["writes"][inner] = (task_id, channel, typed, task_path)

    def settled(self, channel: str) -> Any:
        """The root graph's ``channel`` value at its latest checkpoint if that superstep is
        settled (no task of it has written yet: none finished, interrupted or failed), else
        None (also for no such channel). What ``graph.get_state`` shows, without building it. A
        list is the saver's own (not a copy): the caller must not change it."""
        with self._lock:
            latest = self._latest.get("")
            if latest is None or latest["writes"]:
                return None
            kept = self._values.get(("", channel))
            if kept is None or kept.version != latest["versions"].get(channel):
                return None
            return kept.items if kept.items is not None else self._load_kept("", channel, kept)

    def extends(self, items: Any, base: Any) -> bool:
        """Whether ``items``, a list :meth:`settled` returned, is known to be ``base``, one it
        returned before, with elements appended (the last ``put`` appended to it): O(1), from
        the saver's own bookkeeping. False means not known (compare them)."""
        with self._lock:
            return any(k.items is items and k.base is base for k in self._values.values())

    def delete_thread(self, thread_id: str) -> None:
        """Forget everything kept for ``thread_id`` (stored rows are the store's)."""
        with self._lock:
            if thread_id == self._thread:
                self._latest.clear()
                self._values.clear()

    def get_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]) -> Any:
        raise NotImplementedError("agentfast stores LangGraph's state itself: DeltaChannel is not supported")

    def _keep(self, ns: str, channel: str, version: Any, value: Any) -> _Kept:
        if type(value) is list:
            prev = self._values.get((ns, channel))
            p, ranges, items, base = 0, [], None, None
            # The reducer's own copy of the list it returned, and of the list that one appends
            # to: kept as they are (never changed), no copy of ours, no prefix to compare.
            reducer = self._reducers.get(channel)
            made = reducer.made(value) if reducer is not None else None
            if prev is not None and prev.items is not None:
                old = prev.items
                # Identity first (list equality is C code that checks `is` before __eq__): an
                # appended-to list costs a pointer comparison per element, no serialization.
                # The compared prefix becomes the kept copy (the tail is added below): one copy.
                if made is not None and made[1] is old:
                    p, base = len(old), old
                elif len(value) >= len(old) and (items := value[: len(old)]) == old:
                    p, base = len(old), old
                else:
                    items, p = None, _common_prefix(old, value)
                ranges = _cut(prev.ranges, p)
            tail = value[p:]
            if tail:  # one row for the elements appended together, keyed by the first one's number
                seq = self._next_item
                self._next_item += len(tail)
                key = _item_key(seq)
                self._pending[key] = SdkRow(key, *self._dump(tail, f"channel {channel!r}"))
                if ranges and ranges[-1][1] == seq:
                    ranges[-1] = (ranges[-1][0], seq + len(tail))
                else:
                    ranges.append((seq, seq + len(tail)))
            if made is not None:
                items = made[0]
            elif items is None:
                items = list(value)
            else:
                items += tail
            return _Kept(version, items=items, ranges=ranges, base=base)
        typed = self._dump(value, f"channel {channel!r}")
        if len(typed[1]) <= _INLINE_BYTES:  # a small value rides in sdk_state: no row, no fence trigger
            return _Kept(version, typed=typed)
        key = json.dumps(["v", ns, channel, str(version)])
        self._pending[key] = SdkRow(key, *typed)
        return _Kept(version, typed=typed, key=key)

    def _load(self, typed: tuple[str, bytes], where: str) -> Any:
        """``typed`` decoded; raises StateRefused naming ``where`` (the part of the state it is)."""
        try:
            return self.serde.loads_typed(typed)
        except StateRefused as err:
            raise err.at(where) from None

    def _load_kept(self, ns: str, channel: str, kept: _Kept) -> Any:
        where = f"row {kept.key!r} of agentfast_sdk_blobs" if kept.key else f"channel {channel!r} in the checkpoint's sdk_state"
        return self._load(kept.typed, f"{where} (namespace {ns!r})")  # type: ignore[arg-type]

    def _dump(self, value: Any, where: str) -> tuple[str, bytes]:
        """``value`` encoded; raises StateRefused (naming ``where``) for a type the saver would
        not read back."""
        try:
            return self.serde.dumps_typed(value)
        except StateRefused as err:
            raise err.at(where) from None

    # the runtime's side -----------------------------------------------------------------

    def export_state(self, thread_id: str) -> dict[str, Any]:
        """The latest checkpoint of each namespace of ``thread_id`` as a small JSON-safe dict
        naming its rows (channel values, pending writes); empty when the graph has not started.
        The rows it names that are not stored yet are what :meth:`take_rows` returns next."""
        with self._lock:
            if thread_id != self._thread:
                return {}
            namespaces: dict[str, Any] = {}
            for ns, latest in self._latest.items():
                channels: dict[str, Any] = {}
                for ch, ver in latest["versions"].items():
                    kept = self._values.get((ns, ch))
                    if kept is not None and kept.version == ver:
                        if kept.items is not None:
                            channels[ch] = {"items": [list(r) for r in kept.ranges]}
                        else:
                            channels[ch] = {"key": kept.key} if kept.key else {"value": _enc(kept.typed)}  # type: ignore[arg-type]
                writes = []
                for (task_id, idx), (_, channel, typed, task_path) in latest["writes"].items():
                    key = json.dumps(["w", ns, latest["id"], task_id, idx])
                    if key not in latest["written"]:
                        latest["written"].add(key)
                        self._pending[key] = SdkRow(key, *typed)
                    writes.append([task_id, idx, channel, key, task_path])
                namespaces[ns] = {
                    "checkpoint_id": latest["id"],
                    "parent_id": latest["parent"],
                    "checkpoint": _enc(latest["checkpoint"]),
                    "metadata": _enc(latest["metadata"]),
                    "channels": channels,
                    "writes": writes,
                }
            self._exported.update(self._pending)
            self._pending = {}
            if not namespaces:
                return {}
            return {"format": SDK_STATE_FORMAT, "next_item": self._next_item, "namespaces": namespaces}

    def take_rows(self) -> builtins.list[SdkRow]:  # builtins: this class's list() is the checkpointer's
        """The rows the last :meth:`export_state` named that are not known to be stored (rows
        made after it wait for the next export: a committed state never names a row it lacks,
        and never a row whose sequence number a resumed process could reuse)."""
        with self._lock:
            return list(self._exported.values())

    def rows_stored(self, rows: Sequence[SdkRow]) -> None:
        """``rows`` were committed: :meth:`take_rows` no longer returns them."""
        with self._lock:
            for r in rows:
                self._exported.pop(r.key, None)

    def import_state(
        self,
        thread_id: str,
        state: dict[str, Any],
        load: Callable[[builtins.list[str], builtins.list[tuple[str, str]]], dict[str, tuple[str, bytes]]] | None = None,
    ) -> None:
        """Seed this saver with what :meth:`export_state` returned; ``load(keys, ranges)`` reads
        the rows it names (``Store.sdk_rows`` of the run). A state of format /1 (the whole
        channel state inline) is loaded too, and its values become rows at the next export.
        Raises StateRefused (a ValueError) for a foreign format, a named row that is not stored,
        a state or row that does not decode, or a type the allow-list does not name."""
        if not state:
            return
        fmt = state.get("format")
        with self._lock:
            self._thread = thread_id
            try:
                if fmt == _FORMAT_V1:
                    self._import_v1(state)
                elif fmt == SDK_STATE_FORMAT:
                    self._import_v2(state, load)
                else:
                    raise StateRefused(f"sdk_state format {fmt!r} is neither {SDK_STATE_FORMAT} nor {_FORMAT_V1}", "format")
            except AgentfastError:  # a refusal, the store's own errors: as they are
                raise
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:  # binascii.Error is a ValueError
                # State is data whoever wrote it: a malformed one ends the run with a reason, not a traceback.
                raise StateRefused(f"the stored sdk_state is malformed ({type(err).__name__})", "malformed sdk_state") from None

    def _latest_from(self, ns: str, entry: dict[str, Any], checkpoint: tuple[str, bytes]) -> dict[str, Any]:
        return {
            "id": entry["checkpoint_id"],
            "parent": entry["parent_id"],
            "checkpoint": checkpoint,
            "metadata": _dec(entry["metadata"]),
            "versions": dict(self._load(checkpoint, f"the checkpoint of namespace {ns!r}")["channel_versions"]),
            "writes": {},
            "written": set(),
        }

    def _import_v1(self, state: dict[str, Any]) -> None:
        for ns, entry in state["namespaces"].items():
            latest = self._latest[ns] = self._latest_from(ns, entry, _dec(entry["checkpoint"]))
            for ch, ver, t, b in entry["blobs"]:
                if t != "empty" and latest["versions"].get(ch) == ver:
                    self._values[(ns, ch)] = self._keep(
                        ns, ch, ver, self._load(_dec([t, b]), f"channel {ch!r} (namespace {ns!r})")
                    )
            for task_id, idx, channel, t, b, task_path in entry["writes"]:
                latest["writes"][(task_id, idx)] = (task_id, channel, _dec([t, b]), task_path)

    def _import_v2(self, state: dict[str, Any], load: Any) -> None:
        keys, ranges = state_row_refs(state)
        rows = load(keys, ranges) if load is not None and (keys or ranges) else {}
        missing = [k for k in keys if k not in rows]
        if missing:
            raise StateRefused(f"sdk_state names {len(missing)} row(s) that are not stored, e.g. {missing[0]!r}", "missing row")
        row = rows.__getitem__

        elements: dict[int, Any] = {}  # one object per element, shared by every list naming it
        for key, typed in rows.items():
            if key.startswith("i"):
                first = int(key[1:])
                for j, element in enumerate(self._load(typed, f"row {key!r} of agentfast_sdk_blobs")):
                    elements[first + j] = element
        lacking = [
            seq
            for entry in state["namespaces"].values()
            for ref in entry["channels"].values()
            for lo, hi in ref.get("items", ())
            for seq in range(lo, hi)
            if seq not in elements
        ]
        if lacking:
            raise StateRefused(
                f"sdk_state names {len(lacking)} list element(s) that are not stored, e.g. {lacking[0]}", "missing row"
            )
        self._next_item = state["next_item"]
        for ns, entry in state["namespaces"].items():
            latest = self._latest[ns] = self._latest_from(ns, entry, _dec(entry["checkpoint"]))
            for ch, ref in entry["channels"].items():
                ver = latest["versions"][ch]
                if "key" in ref:
                    self._values[(ns, ch)] = _Kept(ver, typed=row(ref["key"]), key=ref["key"])
                    continue
                if "value" in ref:
                    self._values[(ns, ch)] = _Kept(ver, typed=_dec(ref["value"]))
                    continue
                items = []
                for lo, hi in ref["items"]:
                    items += [elements[seq] for seq in range(lo, hi)]
                self._values[(ns, ch)] = _Kept(ver, items=items, ranges=[(lo, hi) for lo, hi in ref["items"]])
            for task_id, idx, channel, key, task_path in entry["writes"]:
                latest["writes"][(task_id, idx)] = (task_id, channel, row(key), task_path)
                latest["written"].add(key)


# -- LangGraph's add_messages, without rebuilding its id index at every update -------------------


class IncrementalAddMessages:
    """LangGraph's ``add_messages`` reducer, giving the same results, whose common case costs
    O(new messages) instead of O(transcript) in Python (a list copy and compare in C remain).

    ``add_messages(left, right)`` rebuilds a dict of every message id in ``left`` on each call
    (twice per superstep when a conditional edge reads the state), so LangGraph's own step grows
    with the transcript. This keeps the ids of the last few lists it returned: when ``left`` is
    one of them, unchanged (the same elements, compared by identity in C), and ``right`` only
    appends new plain messages with new ids (no ``RemoveMessage``, no chunk, no id seen before,
    no ``format``), the result is ``left + right``. Every other call goes to LangGraph's own
    ``add_messages``. The ids are a shared base set plus a small set of the ids added since; the
    base is rebuilt when the small one passes 1/16 of it, so an append costs O(1) amortized.
    :func:`speed_up_reducers` puts it on a compiled graph's channels that use ``add_messages``.
    """

    _KEEP = 4  # lists whose ids are kept: the channel's value and the copies a fresh read made

    def __init__(self) -> None:
        # id(list) -> (list, its copy, base ids (never changed once made), ids added since,
        # the copy of the list it appends to (fast path) or None)
        self._known: dict[int, tuple[list[Any], list[Any], frozenset[str], frozenset[str], list[Any] | None]] = {}
        self._lock = threading.Lock()

    def __call__(self, left: Any = None, right: Any = None, **kwargs: Any) -> Any:
        if kwargs or type(left) is not list or type(right) is not list:
            return add_messages(left, right, **kwargs)
        with self._lock:
            known = self._known.get(id(left))
        if known is not None and known[0] is left and len(left) == len(known[1]) and left == known[1]:
            _, grew_from, base, added, _ = known
            new_ids: set[str] = set()
            for m in right:
                mid = getattr(m, "id", None)
                if type(m) not in _PLAIN or mid is None or mid in added or mid in base or mid in new_ids:
                    break
                new_ids.add(mid)
            else:
                merged = left + right
                added = added | new_ids
                if len(added) > 64 + len(base) // 16:
                    base, added = base | added, frozenset()
                self._remember(merged, base, added, grew_from)
                return merged
        merged = add_messages(left, right)  # type: ignore[assignment]  # typed as Messages; it returns a list of BaseMessage
        if type(merged) is list:
            self._remember(merged, frozenset(m.id for m in merged), frozenset(), None)
        return merged

    def made(self, value: Any) -> tuple[list[Any], list[Any] | None] | None:
        """``(copy, appended_to)`` if ``value`` is a list this reducer returned and it is unchanged
        since (same elements, compared by identity in C): ``copy`` is this reducer's copy of it,
        and ``value`` is ``appended_to`` (another such copy; None if not known) plus new
        elements. Both copies are never changed. Else None."""
        with self._lock:
            known = self._known.get(id(value))
        if known is not None and known[0] is value and len(value) == len(known[1]) and value == known[1]:
            return known[1], known[4]
        return None

    def _remember(self, merged: list[Any], base: frozenset[str], added: frozenset[str], grew_from: list[Any] | None) -> None:
        with self._lock:
            # A superstep merges the same left and right twice (a conditional edge's fresh read,
            # then the channel's update): the copies are never changed, so equal ones are shared.
            last = self._known[next(reversed(self._known))][1] if self._known else None
            same = last is not None and len(last) == len(merged) and (not merged or last[-1] is merged[-1]) and last == merged
            copy = last if last is not None and same else list(merged)
            self._known[id(merged)] = (merged, copy, base, frozenset(added), grew_from)
            while len(self._known) > self._KEEP:
                del self._known[next(iter(self._known))]


_PLAIN = frozenset({AIMessage, HumanMessage, ToolMessage, SystemMessage})  # exact types: no chunk, no RemoveMessage


def speed_up_reducers(compiled: Any) -> Any:
    """Put an :class:`IncrementalAddMessages` on every channel of ``compiled`` (a compiled graph)
    whose reducer is LangGraph's ``add_messages`` itself; returns ``compiled``. A
    :class:`SnapshotSaver` checkpointer keeps those channels' lists as the reducer's copies."""
    saver = getattr(compiled, "checkpointer", None)
    for name, ch in compiled.channels.items():
        if isinstance(ch, BinaryOperatorAggregate) and ch.operator is add_messages:
            ch.operator = IncrementalAddMessages()
            if isinstance(saver, SnapshotSaver):
                saver._reducers[name] = ch.operator
    return compiled


# -- messages between LangChain and the runtime ------------------------------------------------

_ORIGINAL = "agentfast_message"  # AIMessage.additional_kwargs key holding the provider's message as received


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content or [])


def to_runtime_message(m: BaseMessage) -> Message:
    """A LangChain message as the runtime's ``Message`` (Chat Completions shape)."""
    if isinstance(m, AIMessage):
        if _ORIGINAL in m.additional_kwargs:
            return Message.model_validate(m.additional_kwargs[_ORIGINAL])
        calls = [
            ToolCall(id=tc["id"] or f"call_{i}", name=tc["name"], arguments=json.dumps(tc["args"]))
            for i, tc in enumerate(m.tool_calls)
        ]
        calls += [
            ToolCall(id=tc.get("id") or "", name=tc.get("name") or "", arguments=tc.get("args") or "")
            for tc in m.invalid_tool_calls
        ]
        return Message(role="assistant", content=_text(m.content) or None, tool_calls=calls)
    if isinstance(m, ToolMessage):
        return Message(role="tool", content=_text(m.content), tool_call_id=m.tool_call_id, name=m.name)
    if isinstance(m, SystemMessage):
        return Message(role="system", content=_text(m.content))
    return Message(role="user", content=_text(m.content))


def to_langchain_message(m: Message, msg_id: str | None = None, *, keep_original: bool = True) -> BaseMessage:
    """The runtime's ``Message`` as a LangChain message (tool arguments parsed where valid).

    ``keep_original`` stores the provider's message as received in the AIMessage's
    ``additional_kwargs``, so :func:`to_runtime_message` gives back the exact raw arguments;
    without it the result is a plain message, as a user's own graph would hold it.
    """
    if m.role == "system":
        return SystemMessage(content=m.content or "", id=msg_id)
    if m.role == "user":
        return HumanMessage(content=m.content or "", id=msg_id)
    if m.role == "tool":
        return ToolMessage(content=m.content or "", tool_call_id=m.tool_call_id or "", name=m.name, id=msg_id)
    valid, invalid = [], []
    for c in m.tool_calls:
        try:
            # JSON escapes in the model's text (\\u0000, a lone \\ud800) decode to characters no
            # checkpointer can serialize; the graph gets them made storable (the runtime runs the
            # call from the journal's raw text, so this changes nothing the tool receives).
            args = storable(loads_arguments(c.arguments))
            if not isinstance(args, dict):
                raise ValueError("not an object")
            valid.append({"id": c.id, "name": c.name, "args": args, "type": "tool_call"})
        except ValueError as err:
            invalid.append({"id": c.id, "name": c.name, "args": c.arguments, "error": str(err), "type": "invalid_tool_call"})
    return AIMessage(
        content=m.content or "",
        tool_calls=valid,
        invalid_tool_calls=invalid,
        additional_kwargs={_ORIGINAL: m.model_dump(mode="json")} if keep_original else {},
        id=msg_id,
    )


# -- what a graph factory receives ------------------------------------------------------------


class RuntimeChatModel(BaseChatModel):
    """A LangChain chat model whose calls are the runtime's iterations.

    Each call: iteration = 1 + the AI messages in the input; the persisted reply of that
    iteration is returned if there is one, else the budget is checked (raises BudgetExceeded),
    the provider is asked and the reply persisted with the intent of each tool call. Token usage
    is taken from the provider's response and returned as ``usage_metadata``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    runner: Any = None  # the LangGraphRunner; excluded from LangChain's serialization

    @property
    def _llm_type(self) -> str:
        return "agentfast-runtime"

    def bind_tools(self, tools: Any = None, **kwargs: Any) -> RuntimeChatModel:
        """Tools are the AgentRun's (``spec.tools``); what the graph passes is ignored."""
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        runner: LangGraphRunner = self.runner
        if runner.halted():  # the top of an iteration: stopped, cancelled or past the deadline
            raise StopRequested()
        it = 1 + sum(isinstance(m, AIMessage) for m in messages)
        turn = runner.model_turn(it, [to_runtime_message(m) for m in messages])
        ctx = runner.snap.context
        ctx.counters.iterations = max(ctx.counters.iterations, it)
        ai = to_langchain_message(turn.message, msg_id=f"agentfast-turn-{it}")
        assert isinstance(ai, AIMessage)  # the model's turn is an assistant message
        ai.usage_metadata = {
            "input_tokens": turn.prompt_tokens,
            "output_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
        }
        return ChatResult(generations=[ChatGeneration(message=ai)])


class GraphRuntime:
    """Handed to a graph factory: the model, the tool router and the tool node to build with."""

    def __init__(self, runner: LangGraphRunner):
        self._runner = runner
        self.model = RuntimeChatModel(runner=runner)
        self.tool_schemas = runner.tools.schemas
        self.state_types: list[type] = []

    def allow_state_types(self, *types: type) -> None:
        """Let the run's stored state hold values of ``types`` (classes: pydantic models,
        dataclasses, enums, ...) besides LangGraph's safe types and those the graph's state
        schemas declare (allowed already: :func:`build_graph`). For a type the schemas do not
        reach, e.g. one held under ``Any`` or in an ``interrupt()`` value. Only these exact
        classes are rebuilt from stored state (docs/architecture.md, "LangGraph adapter").
        Raises TypeError for anything but a class."""
        for t in types:
            if not isinstance(t, type):
                raise TypeError(f"allow_state_types takes classes, not {type(t).__name__}")
        self.state_types += types

    def route_tools(self, state: dict[str, Any]) -> list[Send] | str:
        """Conditional edge after the model: one ``Send("tools", ...)`` per call, else END."""
        last = state["messages"][-1]
        if not isinstance(last, AIMessage) or not (last.tool_calls or last.invalid_tool_calls):
            return END
        it = sum(isinstance(m, AIMessage) for m in state["messages"])
        entries = self._runner.store.journal(self._runner.run_id, it)
        return [Send("tools", {"iteration": it, "position": e.position}) for e in entries]

    def tool_node(self, task: dict[str, Any]) -> dict[str, Any]:
        """One tool call, exactly once in effect, through the journal; calls awaiting a human interrupt()."""
        r = self._runner
        it, pos = task["iteration"], task["position"]
        entry = next(e for e in r.store.journal(r.run_id, it) if e.position == pos)
        triage = r.triage(entry)
        if isinstance(triage, ToolResult):
            result = triage
        elif triage == "human":
            decision_id = r.executor.decision_id(entry)
            decision = r.decision_on(decision_id)
            if decision is None:
                resumed = interrupt(
                    {
                        "call_id": decision_id,
                        "iteration": it,
                        "position": pos,
                        "tool": entry.tool_call.name,
                        "arguments": entry.tool_call.arguments,
                    }
                )
                # The store is the record of the decision (or the runner, for the end an idle
                # conversation gets: decision_on); the resume value only carries it here.
                decision = r.decision_on(decision_id)
                if decision is None or decision.decision != resumed.get("decision"):
                    raise RuntimeError(f"resumed {decision_id} with {resumed!r} but the store holds {decision!r}")
            applied = r.apply_decision(entry, decision)
            if applied is None:
                raise StopRequested()
            result = applied
        else:
            if r.halted():
                raise StopRequested()
            result = r.executor.execute(entry)
            r.emit("tool_result", f"{entry.call_id} {entry.tool_call.name}")
        r._counted(it, pos, result)
        return {"messages": [to_langchain_message(result.to_message(), msg_id=f"agentfast-tool-{it}-{pos}")]}


# -- the runner ----------------------------------------------------------------------------------


def build_graph(ref: str, rt: GraphRuntime, checkpointer: SnapshotSaver) -> Any:
    """Import the factory ``ref``, call it with ``rt`` and compile with ``checkpointer``.

    The checkpointer's allow-list gets the types the graph's schemas declare
    (:func:`~.langgraph_serde.graph_state_types`) and those the factory passed to
    ``rt.allow_state_types``: the only types besides LangGraph's safe ones its state may hold.
    Raises SpecError when the ref does not give a StateGraph (or a compiled one).
    """
    try:
        factory = resolve_ref(ref)
    except (ImportError, AttributeError) as err:
        raise SpecError(f"spec.graph.ref: {err}") from None
    try:
        graph = (
            factory(rt) if callable(factory) and not hasattr(factory, "compile") and not hasattr(factory, "builder") else factory
        )
    except BaseException as err:  # noqa: BLE001 - user code: it ends this run (InvalidSpec), never the process
        raise SpecError(f"spec.graph.ref: calling {ref} raised {type(err).__name__}") from None
    builder = getattr(graph, "builder", graph)  # a compiled graph is recompiled with our checkpointer
    if not hasattr(builder, "compile"):
        raise SpecError(f"spec.graph.ref: {ref} returned {type(graph).__name__}, not a LangGraph StateGraph")
    compiled = speed_up_reducers(builder.compile(checkpointer=checkpointer))
    checkpointer.types.allow(graph_state_types(compiled))
    checkpointer.types.allow(getattr(rt, "state_types", ()))
    if DeltaChannel is not None:
        delta = sorted(name for name, ch in compiled.channels.items() if isinstance(ch, DeltaChannel))
        if delta:
            # Its history lives in the parent chain of checkpoints, which the adapter does not keep.
            raise SpecError(
                f"spec.graph.ref: {ref} uses LangGraph's DeltaChannel (channels {', '.join(delta)}), which agentfast "
                "does not support: agentfast already stores list channels as deltas; use a plain reducer "
                "(e.g. Annotated[list, add_messages])"
            )
    return compiled


class LangGraphRunner(RunnerBase):
    """Drives a LangGraph graph superstep by superstep, committing after each (G1)."""

    adapter = "langgraph"

    saver: SnapshotSaver | None = None
    _mirrored: list[BaseMessage] | None = None  # the graph's messages that snap.messages mirrors
    _tool_kinds: dict[tuple[int, int], str | None] | None = None  # (iteration, position) -> error_kind of each finished call
    _count_lock = threading.Lock()  # tool nodes run on LangGraph's executor threads (one runner per process)

    def drive(self) -> Outcome:
        try:
            return self._drive()
        except StateRefused as err:
            # The stored state (or a value the graph would store) names a type off the
            # allow-list, or does not decode: nothing of it ran, and a retry reads the same bytes.
            log.error("LangGraph state refused: %s", err)
            return self.finish(Phase.FAILED, "StateRefused", f"LangGraph state refused: {err}")

    def _drive(self) -> Outcome:
        thread_id = self.snap.context.session.run_uid
        self.saver = SnapshotSaver()
        # The graph first: its declared state types are the allow-list the stored state is read with.
        self.graph = build_graph(self.spec.graph.ref, GraphRuntime(self), self.saver)  # type: ignore[union-attr]
        self.saver.import_state(
            thread_id, self.snap.sdk_state, lambda keys, ranges: self.store.sdk_rows(self.run_id, keys, ranges)
        )
        config = {"configurable": {"thread_id": thread_id}, "recursion_limit": 10_000}
        graph_input: Any = None
        if not self.snap.sdk_state:  # a fresh run: the transcript so far is the graph's input
            graph_input = {
                "messages": [to_langchain_message(m, msg_id=f"agentfast-input-{i}") for i, m in enumerate(self.snap.messages)]
            }
        # A run paused in interrupt() is resumed by its decision, not by re-streaming.
        stream = self.snap.pending is None
        while True:
            if stream:
                if self.halted():
                    return self.halt_outcome("stop requested (SIGTERM): state committed; resume to continue")
                steps = 0
                try:
                    for _ in self.graph.stream(graph_input, config, stream_mode="updates", durability="sync"):
                        steps += 1
                        self._step_done(thread_id, config)
                except StopRequested:
                    self._step_done(thread_id, config)
                    return self.halt_outcome("stop requested (SIGTERM) before a tool call; resume to continue")
                # No step and nothing left to run: the graph had finished and its last superstep
                # was committed, but the process died before the run's final commit; finish now.
                if steps == 0 and self.graph.get_state(config).next:
                    raise RuntimeError("the graph made no progress from its last checkpoint")
            stream, graph_input = True, None
            state = self.graph.get_state(config)
            if state.interrupts:
                decided = self._interrupted(thread_id, state.interrupts)
                if isinstance(decided, Outcome):
                    return decided
                graph_input = decided
                continue
            if not state.next:
                last = self.snap.messages[-1] if self.snap.messages else None
                return self.finish(Phase.SUCCEEDED, "Completed", last.answer_text() if last else "")

    def _step_done(self, thread_id: str, config: dict[str, Any]) -> None:
        """After a superstep: mirror the transcript, store LangGraph's state opaquely, commit.

        The transcript is append-only and in the model's order, so it is mirrored only at a
        clean superstep boundary: while a superstep is interrupted (or stopped) LangGraph shows
        the finished siblings' writes applied in completion order, ahead of an earlier call's
        result that does not exist yet.
        """
        messages = self.saver.settled("messages")  # type: ignore[union-attr]
        if messages is not None:
            self._mirror(messages)
        self.snap.sdk_state = self.saver.export_state(thread_id)  # type: ignore[union-attr]
        self._count_tools()
        self.commit()

    def _mirror(self, messages: list[BaseMessage]) -> None:
        """``snap.messages`` := ``messages`` in the runtime's shape, converting only the ones
        appended since the last mirror (the graph's list keeps its message objects from step to
        step; list equality checks identity first), all of them otherwise. ``messages`` is what
        ``saver.settled`` returned, never changed, so it is kept as it is (no copy), and the
        saver usually knows it extends the last one (no comparison either)."""
        done = self._mirrored
        k = len(done) if done is not None else -1
        if (
            done is not None
            and len(messages) >= k
            and len(self.snap.messages) == k
            and (messages is done or self.saver.extends(messages, done) or messages[:k] == done)  # type: ignore[union-attr]
        ):
            self.snap.messages.extend(to_runtime_message(m) for m in messages[k:])
        else:
            self.snap.messages = [to_runtime_message(m) for m in messages]
        self._mirrored = messages

    def _count_tools(self) -> None:
        """The counters of finished calls: counted from the whole journal once per process; from
        then on :meth:`_counted` adds each call the tool node finishes (no read per superstep)."""
        with self._count_lock:
            if self._tool_kinds is not None:
                return
            self._tool_kinds = {}
            c = self.snap.context.counters
            c.tool_calls = c.tool_errors = c.malformed_tool_calls = 0
            for e in self.store.journal(self.run_id):
                if e.result is not None:
                    self._add_kind(e.iteration, e.position, e.result.error_kind)

    def _counted(self, iteration: int, position: int, result: ToolResult) -> None:
        """The tool node finished call (iteration, position) with ``result`` (its result is in the
        journal already: before the first count, that count finds it). Thread-safe."""
        with self._count_lock:
            if self._tool_kinds is not None and (iteration, position) not in self._tool_kinds:
                self._add_kind(iteration, position, result.error_kind)

    def _add_kind(self, iteration: int, position: int, kind: str | None) -> None:
        self._tool_kinds[(iteration, position)] = kind  # type: ignore[index]
        c = self.snap.context.counters
        c.tool_calls += kind not in ("malformed", "denied")
        c.tool_errors += kind == "tool_raised"
        c.malformed_tool_calls += kind == "malformed"

    def sdk_rows(self) -> list[SdkRow]:
        return self.saver.take_rows() if self.saver is not None else []

    def sdk_rows_stored(self, rows: list[SdkRow]) -> None:
        if self.saver is not None:
            self.saver.rows_stored(rows)

    def _interrupted(self, thread_id: str, interrupts: Any) -> Command[str] | Outcome:
        """The graph paused in interrupt(), one per call awaiting a human: make them all pending
        at once, and return the ``Command(resume=...)`` carrying every decision, or an Outcome."""
        ordered = sorted(interrupts, key=lambda i: (i.value["iteration"], i.value["position"]))
        it = ordered[0].value["iteration"]
        entries = {e.position: e for e in self.store.journal(self.run_id, it)}
        waiting = [entries[i.value["position"]] for i in ordered]
        siblings: list[ToolResult] = [e.result for e in entries.values() if e.result is not None]
        assert self.saver is not None  # made before the graph ran
        self.snap.sdk_state = self.saver.export_state(thread_id)
        self._count_tools()
        decided = self.decisions(waiting, siblings)
        if isinstance(decided, Outcome):
            return decided
        self.snap.pending = None
        return Command(
            resume={
                i.id: {"decision": decided[i.value["position"]].decision, "reason": decided[i.value["position"]].reason}
                for i in ordered
            }
        )
