"""Exactly-once tool execution through the journal (G3, G4).

For every call: the intent is already in the journal (planned with the model's turn); it is marked
``started``; the tool runs with its idempotency key; the result is persisted as ``done``. A done
call is never run again: its stored result is returned. A call found ``started`` after a crash
ran or may have run: an idempotent tool runs again with the same key; a non-idempotent one is not
re-run here: the caller must send it to a human (:meth:`CallExecutor.needs_human`).

Both adapters execute tools through this class, so the guarantees hold for each.
"""

from __future__ import annotations

import logging

from . import faults
from .snapshot import ToolResult
from .store import JournalEntry, Lease, LeaseLost, Store, StoreUnavailable
from .tools import ToolArgumentsError, ToolContext, ToolRegistry

log = logging.getLogger(__name__)


class CallExecutor:
    """Runs journaled calls of one run under one lease.

    Counters are the caller's to derive from the returned results (``ToolResult.error_kind``),
    so they come out the same whether or not a process died along the way.
    """

    def __init__(self, store: Store, lease: Lease, run_uid: str, tools: ToolRegistry):
        self.store = store
        self.lease = lease
        self.run_uid = run_uid
        self.tools = tools

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

    def _result(self, entry: JournalEntry, content: str, error_kind: str | None = None) -> ToolResult:
        return ToolResult(
            call_id=entry.call_id,
            position=entry.position,
            tool_call_id=entry.tool_call.id,
            tool_name=entry.tool_call.name,
            content=content,  # made storable by the store (runner/storable.py), which hands back what it stored
            is_error=error_kind is not None,
            error_kind=error_kind,
            idempotency_key=entry.idempotency_key,
        )

    def execute(self, entry: JournalEntry) -> ToolResult:
        """Run one call exactly once in effect; returns its (possibly stored) result.

        Raises LeaseLost / StoreUnavailable from the journal writes: then nothing further runs.
        A tool's own exception becomes an error result that the model reads.
        """
        if entry.state == "done" and entry.result is not None:
            return entry.result  # G3: replay the state, never the effect
        name = entry.tool_call.name
        tool = self.tools.get(name)
        if tool is None:
            result = self._result(entry, f"error: unknown tool {name!r}; available tools: {', '.join(self.tools.names)}", "malformed")
            return self._persist(entry, result)
        try:
            args = tool.parse_arguments(entry.tool_call.arguments)
        except ToolArgumentsError as err:
            result = self._result(entry, f"error: {err}. Call {name} again with valid JSON arguments.", "malformed")
            return self._persist(entry, result)

        self.store.mark_started(self.lease, entry.iteration, entry.position)  # write-ahead intent
        faults.point("tool.before_call", name)
        ctx = ToolContext(
            run_id=self.lease.run_id,
            run_uid=self.run_uid,
            call_id=entry.call_id,
            iteration=entry.iteration,
            position=entry.position,
            idempotency_key=entry.idempotency_key,
            epoch=self.lease.epoch,
            dsn=self.store.dsn,
        )
        try:
            result = self._result(entry, tool.invoke(ctx, args))
        except Exception as err:  # a tool that raises is a result the model can reason about
            log.warning("tool %s raised: %r", name, err)
            result = self._result(entry, f"error: {name} failed: {type(err).__name__}: {err}", "tool_raised")
        faults.point("tool.after_call", name)
        result = self._persist(entry, result)
        faults.point("tool.after_persist", name)
        return result

    def _persist(self, entry: JournalEntry, result: ToolResult) -> ToolResult:
        """Record ``result`` as the call's; returns it as stored.

        A call whose tool has run must end ``done``, or a resume would run it again. So when the
        result itself cannot be written (anything but a lost lease or an unavailable Postgres,
        which leave the call ``started`` for G4 to handle on resume: say a value over Postgres's
        size limits), an error result saying so is recorded in its place, for the model to read.
        """
        try:
            return self.store.record_result(self.lease, entry.iteration, entry.position, result)
        except (LeaseLost, StoreUnavailable):
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

    def deny(self, entry: JournalEntry, reason: str | None) -> ToolResult:
        """Persist a human's denial as the call's result; the tool does not run."""
        why = f": {reason}" if reason else ""
        result = self._result(entry, f"denied: a human reviewer declined this {entry.tool_call.name} call{why}. It was not run.", "denied")
        return self._persist(entry, result)
