"""Exactly-once tool execution through the journal (G3, G4).

For every call: the intent is already in the journal (planned with the model's turn); it is marked
``started``; the tool runs with its idempotency key; the result is persisted as ``done``. A done
call is never run again: its stored result is returned. A call found ``started`` after a crash
ran or may have run: an idempotent tool runs again with the same key; a non-idempotent one is not
re-run here: the caller must send it to a human (:meth:`CallExecutor.needs_human`). Before
either, a tool's recovery check may settle it (:meth:`CallExecutor.recover`). A human's decision
ends an awaited call one of three ways: approve (it runs), deny (:meth:`CallExecutor.deny`: the
model reads the reason) or complete (:meth:`CallExecutor.complete`: the effect already happened;
the model reads the given result, and the tool body never runs again).

Both adapters execute tools through this class, so the guarantees hold for each.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Final, Literal

from . import faults, logs
from .errors import AgentfastError
from .payloads import PayloadTooLarge
from .snapshot import ToolResult
from .store import EndRequests, JournalEntry, Lease, LeaseLost, Store, StoreUnavailable
from .toolhost import ToolHostLost
from .tools import Tool, ToolArgumentsError, ToolContext, ToolRegistry, render_result
from .tracing import RunTracer

log = logging.getLogger(__name__)


class NotWritten(enum.Enum):
    """NOT_WRITTEN's type: an enum member, so that ``intent is NOT_WRITTEN`` narrows ``intent``."""

    NOT_WRITTEN = "not written"


# execute()'s ``intent`` when no write recorded the call's intent yet (the executor writes it).
NOT_WRITTEN: Final = NotWritten.NOT_WRITTEN


class RunEnding(AgentfastError):
    """The store would not start a call: the run was cancelled or is past its deadline
    (``ends`` says which). The call did not run and stays as it was."""

    def __init__(self, ends: EndRequests):
        super().__init__("the run was asked to end before this call")
        self.ends = ends


class CallExecutor:
    """Runs journaled calls of one run under one lease.

    Counters are the caller's to derive from the returned results (``ToolResult.error_kind``),
    so they come out the same whether or not a process died along the way. ``deadline_s``:
    the run's ``spec.activeDeadlineSeconds`` (None: none); past it, no call starts. ``trace``:
    the attempt's tracer (None: no tracing).
    """

    def __init__(
        self,
        store: Store,
        lease: Lease,
        run_uid: str,
        tools: ToolRegistry,
        *,
        deadline_s: float | None = None,
        trace: RunTracer | None = None,
    ):
        self.store = store
        self.trace = trace or RunTracer()  # an execute_tool span around each tool body (runner/tracing.py)
        self.lease = lease
        self.run_uid = run_uid
        self.tools = tools
        self.deadline_s = deadline_s

    @staticmethod
    def in_flight_unsafe(entry: JournalEntry) -> bool:
        """A non-idempotent call that may have run already: never re-run without a human (G4)."""
        return entry.state == "started" and not entry.idempotent

    def needs_human(self, entry: JournalEntry) -> bool:
        """True for a gated call, and for a non-idempotent call that may have run already."""
        return entry.gated or self.in_flight_unsafe(entry)

    @classmethod
    def decision_id(cls, entry: JournalEntry) -> str:
        """The id a human decides under: the call id, or for an unsafe re-run a fresh one.

        A decision is write-once, so re-running a non-idempotent call that was in flight needs
        its own decision (``call-3-1-rerun1``), never the approval its first attempt received.
        """
        return f"{entry.call_id}-rerun{entry.attempts}" if cls.in_flight_unsafe(entry) else entry.call_id

    def _context(self, entry: JournalEntry) -> ToolContext:
        return ToolContext(
            run_id=self.lease.run_id,
            run_uid=self.run_uid,
            call_id=entry.call_id,
            iteration=entry.iteration,
            position=entry.position,
            idempotency_key=entry.idempotency_key,
            epoch=self.lease.epoch,
        )

    def _result(
        self, entry: JournalEntry, content: str, error_kind: str | None = None, recorded_by: str | None = None
    ) -> ToolResult:
        return ToolResult(
            call_id=entry.call_id,
            position=entry.position,
            tool_call_id=entry.tool_call.id,
            tool_name=entry.tool_call.name,
            content=content,  # made storable by the store (runner/storable.py), which hands back what it stored
            is_error=error_kind is not None,
            error_kind=error_kind,
            idempotency_key=entry.idempotency_key,
            recorded_by=recorded_by,
        )

    def _callable(self, entry: JournalEntry) -> tuple[Tool, Any] | str:
        """``(tool, parsed arguments)`` of ``entry``, or why it cannot be called (an unknown tool,
        arguments that do not parse): the text of the malformed result the model reads."""
        name = entry.tool_call.name
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; available tools: {', '.join(self.tools.names)}"
        try:
            return tool, tool.parse_arguments(entry.tool_call.arguments)
        except ToolArgumentsError as err:
            return f"error: {err}. Call {name} again with valid JSON arguments."

    def startable(self, entry: JournalEntry) -> bool:
        """Whether :meth:`execute` would record ``entry``'s intent and run it, rather than record
        it malformed with no intent (an unknown tool, arguments that do not parse)."""
        return not isinstance(self._callable(entry), str)

    def execute(
        self, entry: JournalEntry, *, intent: EndRequests | None | Literal[NotWritten.NOT_WRITTEN] = NOT_WRITTEN
    ) -> ToolResult:
        """:meth:`_execute`, with the call's id (and tool) on every log line it makes (runner/logs.py)."""
        with logs.bound(call_id=entry.call_id, tool=entry.tool_call.name):
            return self._execute(entry, intent=intent)

    def _execute(
        self, entry: JournalEntry, *, intent: EndRequests | None | Literal[NotWritten.NOT_WRITTEN] = NOT_WRITTEN
    ) -> ToolResult:
        """Run one call exactly once in effect; returns its (possibly stored) result.

        ``intent``: what the write that already recorded the call's intent returned
        (``Store.save_turn_and_mark_started``: None, marked; or the EndRequests that refused it),
        for a call that is :meth:`startable`; by default this method records it
        (``Store.mark_started``). Raises LeaseLost / StoreUnavailable from the journal writes:
        then nothing further runs; RunEnding when the run was cancelled or passed its deadline
        (checked by the same write that records the intent, so none starts after either). A
        tool's own exception becomes an error result that the model reads.
        """
        if entry.state == "done" and entry.result is not None:
            return entry.result  # G3: replay the state, never the effect
        callable_ = self._callable(entry)
        if isinstance(callable_, str):
            return self._persist(entry, self._result(entry, callable_, "malformed"))
        tool, args = callable_
        name = entry.tool_call.name

        # The write-ahead intent, durable before the call: the journal counts every attempt, even
        # across a Postgres crash (tests/chaos checks runs <= attempts), for idempotent tools too.
        ends = (
            self.store.mark_started(self.lease, entry.iteration, entry.position, deadline_s=self.deadline_s)
            if intent is NOT_WRITTEN
            else intent
        )
        if ends is not None:
            raise RunEnding(ends)
        faults.point("tool.before_call", name)
        log.info("tool call started")
        ctx = self._context(entry)
        with self.trace.tool(entry) as span:
            try:
                result = self._result(entry, tool.invoke(ctx, args))
            except ToolHostLost:
                raise  # the call may have taken effect: it stays started, for the resume to settle (G4)
            except (
                Exception,
                SystemExit,
            ) as err:  # a tool that raises (or calls sys.exit) is a result the model can reason about
                log.warning("tool %s raised: %r", name, err)
                kind = getattr(err, "type_name", type(err).__name__)
                result = self._result(entry, f"error: {name} failed: {kind}: {err}", "tool_raised")
            span.result(result)
        faults.point("tool.after_call", name)
        result = self._persist(entry, result)
        log.info("tool call done" if not result.is_error else "tool call failed")
        faults.point("tool.after_persist", name)
        return result

    def _persist(self, entry: JournalEntry, result: ToolResult) -> ToolResult:
        """Record ``result`` as the call's; returns it as stored.

        A call whose tool has run must end ``done``, or a resume would run it again. So when the
        result itself cannot be written (anything but a lost lease or an unavailable Postgres,
        which leave the call ``started`` for G4 to handle on resume: say a value over Postgres's
        size limits), an error result saying so is recorded in its place, for the model to read.
        A result too large to store (:class:`PayloadTooLarge`: over the payload ceiling, or refused
        by Postgres) is recorded the same way, so the call is done and never re-run (G3), and then
        raised: the run ends Failed with its reason.
        """
        try:
            return self.store.record_result(self.lease, entry.iteration, entry.position, result)
        except (LeaseLost, StoreUnavailable):
            raise
        except PayloadTooLarge as err:
            log.error("the result of %s (%s) is too large to store: %s", entry.call_id, entry.tool_call.name, err)
            self.store.record_result(
                self.lease,
                entry.iteration,
                entry.position,
                self._result(
                    entry,
                    f"error: {entry.tool_call.name} ran (its effect, if any, happened), but its result could not be stored: {err}"[
                        :1000
                    ],
                    "tool_raised",
                ),
            )
            raise
        except Exception as err:
            log.error("the result of %s (%s) could not be stored: %r", entry.call_id, entry.tool_call.name, err)
            why = f"{type(err).__name__}: {err}"[:500]
            substitute = self._result(
                entry,
                f"error: {entry.tool_call.name} ran (its effect, if any, happened), but its result could not be stored: {why}",
                "tool_raised",
            )
            return self.store.record_result(self.lease, entry.iteration, entry.position, substitute)

    def recover(self, entry: JournalEntry) -> ToolResult | bool | None:
        """Ask the tool's recovery check about a call found in flight (``started``, not done).

        Returns the recorded ToolResult when the check says the effect happened (the call is
        done with that result; the body does not run again); True when it says the effect did
        not happen (the call may run again with its key); None when there is no check, the
        check cannot tell, or it raised (then: idempotent tools re-run, others go to a human).
        """
        tool = self.tools.get(entry.tool_call.name)
        if entry.state != "started" or tool is None or tool.recovery is None:
            return None
        try:
            found = tool.recovery(self._context(entry))
            if found.status == "happened":
                content = render_result(found.result)
            elif found.status == "not_happened":
                return True
            else:
                return None
        except ToolHostLost:
            raise
        except Exception as err:  # a check that fails knows nothing: the safe answer is "ask"
            log.warning("recovery check of %s (%s) raised: %r", entry.call_id, entry.tool_call.name, err)
            return None
        return self._persist(entry, self._result(entry, content, recorded_by="recovery_check"))

    def deny(self, entry: JournalEntry, reason: str | None) -> ToolResult:
        """Persist a human's denial as the call's result; the tool does not run (again).

        The model reads the reason. For a call that was interrupted in flight the text does not
        claim it was not run: its first attempt may have taken effect.
        """
        name = entry.tool_call.name
        why = f": {reason}" if reason else ""
        if entry.attempts > 0:  # started before: it ran, or may have
            text = (
                f"denied: a human reviewer declined to run this {name} call again{why}. "
                "An earlier attempt was interrupted and may have taken effect."
            )
        else:
            text = f"denied: a human reviewer declined this {name} call{why}. It was not run."
        return self._persist(entry, self._result(entry, text, "denied"))

    def reply(self, entry: JournalEntry, text: str, replied_by: str) -> ToolResult:
        """Persist the user's reply to the model's question (an ``ask_user`` call) as the call's
        result: the model reads ``text`` verbatim; ``recorded_by`` is ``user:<replied_by>``."""
        return self._persist(entry, self._result(entry, text, recorded_by=f"user:{replied_by}" if replied_by else "user"))

    def end_question(self, entry: JournalEntry, text: str, recorded_by: str) -> ToolResult:
        """Persist the end of the conversation at the model's question (an ``ask_user`` call) as
        the call's result: ``text`` (what the model would read; it is not asked again) and
        ``recorded_by`` (``ended:user:<who>`` or ``ended:idle-timeout``: what
        :func:`~.conversation.how_it_ended` reads)."""
        return self._persist(entry, self._result(entry, text, recorded_by=recorded_by))

    def complete(self, entry: JournalEntry, result_text: str, decided_by: str) -> ToolResult:
        """Persist a human's record that the call's effect already happened, with ``result_text``
        (what the model reads, verbatim); the tool body never runs again."""
        return self._persist(
            entry, self._result(entry, result_text, recorded_by=f"human:{decided_by}" if decided_by else "human")
        )
