"""The LangGraph adapter: a graph-native agent under the runtime's guarantees G1 to G9.

How it fits together (docs/architecture.md, "LangGraph adapter", says why):

- **State (G8).** LangGraph keeps its channel state through its own checkpointer contract. The
  adapter hands the graph a :class:`SnapshotSaver`, an ``InMemorySaver`` that can export its
  latest checkpoint (with pending writes) as an opaque, JSON-safe blob and import it again. After
  every superstep (``durability="sync"``) the runtime commits that blob as ``sdk_state`` of its
  own checkpoint, and seeds a new process's saver with it on resume. The runtime never reads the
  blob, and nothing outside the saver calls LangGraph's persistence primitives: LangGraph does.
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
import json
from typing import Any, Iterator

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END
from langgraph.types import Command, Send, interrupt
from pydantic import ConfigDict

from ..loop import Outcome, RunnerBase
from ..snapshot import Message, RunStatus, ToolCall, ToolResult
from ..spec import SpecError, resolve_ref
from ..storable import storable

SDK_STATE_FORMAT = "agentfast.langgraph-saver/1"


class StopRequested(Exception):
    """Raised inside a graph node at a safe point where the run must start nothing more (SIGTERM,
    a cancel request, the deadline: ``RunnerBase._halted``): no new model or tool call starts."""


# -- the opaque state -----------------------------------------------------------------------


def _enc(typed: tuple[str, bytes]) -> list[str]:
    return [typed[0], base64.b64encode(typed[1]).decode()]


def _dec(pair: list[str]) -> tuple[str, bytes]:
    return pair[0], base64.b64decode(pair[1])


class SnapshotSaver(InMemorySaver):
    """LangGraph's in-memory checkpointer, plus export/import of its latest state as a blob.

    LangGraph calls ``put``/``put_writes``/``get_tuple`` as its checkpointer contract says; the
    runtime only ever sees :meth:`export_state` output (a dict of strings, serialized with
    LangGraph's own serde) and hands it back to :meth:`import_state`.
    """

    def export_state(self, thread_id: str) -> dict[str, Any]:
        """The latest checkpoint of each namespace of ``thread_id``, its channel blobs and
        pending writes, as a JSON-safe dict. Empty dict when the graph has not started."""
        namespaces: dict[str, Any] = {}
        for ns, checkpoints in self.storage.get(thread_id, {}).items():
            if not checkpoints:
                continue
            cid = max(checkpoints)
            cp_typed, md_typed, parent_id = checkpoints[cid]
            versions = self.serde.loads_typed(cp_typed)["channel_versions"]
            blobs = [
                [ch, ver, *_enc(self.blobs[(thread_id, ns, ch, ver)])]
                for ch, ver in versions.items()
                if (thread_id, ns, ch, ver) in self.blobs
            ]
            writes = [
                [task_id, idx, channel, *_enc(value), task_path]
                for (task_id, idx), (_, channel, value, task_path) in self.writes.get((thread_id, ns, cid), {}).items()
            ]
            namespaces[ns] = {
                "checkpoint_id": cid,
                "parent_id": parent_id,
                "checkpoint": _enc(cp_typed),
                "metadata": _enc(md_typed),
                "blobs": blobs,
                "writes": writes,
            }
        return {"format": SDK_STATE_FORMAT, "namespaces": namespaces} if namespaces else {}

    def import_state(self, thread_id: str, state: dict[str, Any]) -> None:
        """Seed this saver with what :meth:`export_state` returned. Raises ValueError if foreign."""
        if not state:
            return
        if state.get("format") != SDK_STATE_FORMAT:
            raise ValueError(f"sdk_state format {state.get('format')!r} is not {SDK_STATE_FORMAT}")
        for ns, entry in state["namespaces"].items():
            cid = entry["checkpoint_id"]
            self.storage[thread_id][ns][cid] = (_dec(entry["checkpoint"]), _dec(entry["metadata"]), entry["parent_id"])
            for ch, ver, t, b in entry["blobs"]:
                self.blobs[(thread_id, ns, ch, ver)] = _dec([t, b])
            for task_id, idx, channel, t, b, task_path in entry["writes"]:
                self.writes[(thread_id, ns, cid)][(task_id, idx)] = (task_id, channel, _dec([t, b]), task_path)


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
        calls = [ToolCall(id=tc["id"] or f"call_{i}", name=tc["name"], arguments=json.dumps(tc["args"])) for i, tc in enumerate(m.tool_calls)]
        calls += [ToolCall(id=tc.get("id") or "", name=tc.get("name") or "", arguments=tc.get("args") or "") for tc in m.invalid_tool_calls]
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
            args = storable(json.loads(c.arguments or "{}"))
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

    def bind_tools(self, tools: Any = None, **kwargs: Any) -> "RuntimeChatModel":
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
        if runner._halted():  # the top of an iteration: stopped, cancelled or past the deadline
            raise StopRequested()
        it = 1 + sum(isinstance(m, AIMessage) for m in messages)
        turn = runner._model_turn(it, [to_runtime_message(m) for m in messages])
        ctx = runner.snap.context
        ctx.counters.iterations = max(ctx.counters.iterations, it)
        ai = to_langchain_message(turn.message, msg_id=f"agentfast-turn-{it}")
        ai.usage_metadata = {
            "input_tokens": turn.prompt_tokens,
            "output_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
        }
        return ChatResult(generations=[ChatGeneration(message=ai)])


class GraphRuntime:
    """Handed to a graph factory: the model, the tool router and the tool node to build with."""

    def __init__(self, runner: "LangGraphRunner"):
        self._runner = runner
        self.model = RuntimeChatModel(runner=runner)
        self.tool_schemas = runner.tools.schemas

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
        triage = r._triage(entry)
        if isinstance(triage, ToolResult):
            result = triage
        elif triage == "human":
            decision_id = r.executor.decision_id(entry)
            decision = r.store.get_decision(r.run_id, decision_id)
            if decision is None:
                resumed = interrupt(
                    {"call_id": decision_id, "iteration": it, "position": pos, "tool": entry.tool_call.name,
                     "arguments": entry.tool_call.arguments}
                )
                # The store is the record of the decision; the resume value only carries it here.
                decision = r.store.get_decision(r.run_id, decision_id)
                if decision is None or decision.decision != resumed.get("decision"):
                    raise RuntimeError(f"resumed {decision_id} with {resumed!r} but the store holds {decision!r}")
            applied = r._apply(entry, decision)
            if applied is None:
                raise StopRequested()
            result = applied
        else:
            if r._halted():
                raise StopRequested()
            result = r.executor.execute(entry)
            r._emit("tool_result", f"{entry.call_id} {entry.tool_call.name}")
        return {"messages": [to_langchain_message(result.to_message(), msg_id=f"agentfast-tool-{it}-{pos}")]}


# -- the runner ----------------------------------------------------------------------------------


def build_graph(ref: str, rt: GraphRuntime, checkpointer: SnapshotSaver) -> Any:
    """Import the factory ``ref``, call it with ``rt`` and compile with ``checkpointer``.

    Raises SpecError when the ref does not give a StateGraph (or a compiled one).
    """
    try:
        factory = resolve_ref(ref)
    except (ImportError, AttributeError) as err:
        raise SpecError(f"spec.graph.ref: {err}") from None
    try:
        graph = factory(rt) if callable(factory) and not hasattr(factory, "compile") and not hasattr(factory, "builder") else factory
    except BaseException as err:  # noqa: BLE001 - user code: it ends this run (InvalidSpec), never the process
        raise SpecError(f"spec.graph.ref: calling {ref} raised {type(err).__name__}") from None
    builder = getattr(graph, "builder", graph)  # a compiled graph is recompiled with our checkpointer
    if not hasattr(builder, "compile"):
        raise SpecError(f"spec.graph.ref: {ref} returned {type(graph).__name__}, not a LangGraph StateGraph")
    return builder.compile(checkpointer=checkpointer)


class LangGraphRunner(RunnerBase):
    """Drives a LangGraph graph superstep by superstep, committing after each (G1)."""

    adapter = "langgraph"

    def _drive(self) -> Outcome:
        thread_id = self.snap.context.session.run_uid
        self.saver = SnapshotSaver()
        self.saver.import_state(thread_id, self.snap.sdk_state)
        self.graph = build_graph(self.spec.graph.ref, GraphRuntime(self), self.saver)  # type: ignore[union-attr]
        config = {"configurable": {"thread_id": thread_id}, "recursion_limit": 10_000}
        graph_input: Any = None
        if not self.snap.sdk_state:  # a fresh run: the transcript so far is the graph's input
            graph_input = {"messages": [to_langchain_message(m, msg_id=f"agentfast-input-{i}") for i, m in enumerate(self.snap.messages)]}
        # A run paused in interrupt() is resumed by its decision, not by re-streaming.
        stream = self.snap.pending is None
        while True:
            if stream:
                if self._halted():
                    return self._halt_outcome("stop requested (SIGTERM): state committed; resume to continue")
                steps = 0
                try:
                    for _ in self.graph.stream(graph_input, config, stream_mode="updates", durability="sync"):
                        steps += 1
                        self._step_done(thread_id, config)
                except StopRequested:
                    self._step_done(thread_id, config)
                    return self._halt_outcome("stop requested (SIGTERM) before a tool call; resume to continue")
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
                return self._finish("Succeeded", "Completed", last.answer_text() if last else "")

    def _step_done(self, thread_id: str, config: dict[str, Any]) -> None:
        """After a superstep: mirror the transcript, store LangGraph's state opaquely, commit.

        The transcript is append-only and in the model's order, so it is mirrored only at a
        clean superstep boundary: while a superstep is interrupted (or stopped) LangGraph shows
        the finished siblings' writes applied in completion order, ahead of an earlier call's
        result that does not exist yet.
        """
        state = self.graph.get_state(config)
        clean = all(t.result is None and not t.interrupts and t.error is None for t in state.tasks)
        if clean and "messages" in state.values:
            self.snap.messages = [to_runtime_message(m) for m in state.values["messages"]]
        self.snap.sdk_state = self.saver.export_state(thread_id)
        self._count_tools()
        self._commit()

    def _count_tools(self) -> None:
        done = [e.result for e in self.store.journal(self.run_id) if e.result is not None]
        c = self.snap.context.counters
        c.tool_calls = sum(1 for r in done if r.error_kind not in ("malformed", "denied"))
        c.tool_errors = sum(1 for r in done if r.error_kind == "tool_raised")
        c.malformed_tool_calls = sum(1 for r in done if r.error_kind == "malformed")

    def _interrupted(self, thread_id: str, interrupts: Any) -> Command | Outcome:
        """The graph paused in interrupt(), one per call awaiting a human: make them all pending
        at once, and return the ``Command(resume=...)`` carrying every decision, or an Outcome."""
        ordered = sorted(interrupts, key=lambda i: (i.value["iteration"], i.value["position"]))
        it = ordered[0].value["iteration"]
        entries = {e.position: e for e in self.store.journal(self.run_id, it)}
        waiting = [entries[i.value["position"]] for i in ordered]
        siblings: list[ToolResult] = [e.result for e in entries.values() if e.result is not None]
        self.snap.sdk_state = self.saver.export_state(thread_id)
        self._count_tools()
        decided = self._decisions(waiting, siblings)
        if isinstance(decided, Outcome):
            return decided
        self.snap.pending = None
        return Command(resume={
            i.id: {"decision": decided[i.value["position"]].decision, "reason": decided[i.value["position"]].reason} for i in ordered
        })
