"""The vanilla adapter: a loop-owning tool-calling agent, checkpointed after every iteration.

One vanilla iteration (G1): check the budget (G7); ask the model (or, on resume, reuse the reply already
persisted for this iteration); persist the reply and the intent of every tool call it asked for;
run the non-gated calls in order through the journal (G3, G4); if calls need a human, commit a
checkpoint whose ``pending`` lists every one of them at once and the siblings' results (G5), and
wait until each is decided (approve, deny or complete, in any order); then append the
assistant message and the tool results in the model's original order and commit the checkpoint.
"""

from __future__ import annotations

from ..journal import NOT_WRITTEN
from ..loop import _UNREAD, Outcome, RunnerBase
from ..snapshot import RunStatus, ToolResult
from ..store import EndRequests, JournalEntry, Turn


class VanillaRunner(RunnerBase):
    """The loop-owning adapter: the transcript in ``StateSnapshot.messages`` is authoritative."""

    adapter = "vanilla"

    def _start_with_turn(self, plan: list[JournalEntry]) -> int | None:
        """The batch's first call that runs without a human (G5: those run first, in the model's
        order), when the executor would start it (a known tool, arguments that parse) and no stop
        is asked yet: its intent is written with the turn, one write instead of two. Else None."""
        if self._ending is not None or self.stop.is_set():
            return None
        first = next((e for e in plan if not self.executor.needs_human(e)), None)
        return first.position if first is not None and self.executor.startable(first) else None

    def _take_ends(self) -> EndRequests | None | object:
        """The end requests the last commit read for the :meth:`_halted` that follows it (once)."""
        ends, self._ends_read = self._ends_read, _UNREAD
        return ends

    def _drive(self) -> Outcome:
        while True:
            if self._halted(self._take_ends()):
                return self._halt_outcome("stop requested (SIGTERM): state committed; resume to continue")
            outcome = self._iteration()
            if outcome is not None:
                return outcome

    def _iteration(self) -> Outcome | None:
        it = self.snap.context.counters.iterations + 1
        turn = self._model_turn(it, self.snap.messages)
        if not turn.message.tool_calls:
            self.snap.messages.append(turn.message)
            self.snap.context.counters.iterations = it
            return self._finish("Succeeded", "Completed", turn.message.answer_text())
        return self._run_batch(it, turn)

    def _run_batch(self, it: int, turn: Turn) -> Outcome | None:
        entries = self._planned_entries(it) or self.store.journal(self.run_id, it)
        results: dict[int, ToolResult] = {}
        waiting: list[JournalEntry] = []
        # G5: the calls that need no human run first, in the model's order.
        for e in entries:
            t = self._triage(e)
            if isinstance(t, ToolResult):
                results[e.position] = t
            elif t == "human":
                waiting.append(e)
            else:
                # SIGTERM is checked here; a cancel or the deadline by the write that starts the call (RunEnding).
                # A call whose intent the turn's write recorded has started: a SIGTERM since then
                # is one that came just after its intent, and the call runs.
                intent = self._take_intent(it, e.position)
                if intent is NOT_WRITTEN and (self._ending is not None or self.stop.is_set()):
                    return self._halt_outcome("stop requested (SIGTERM) before a tool call; resume to continue")
                results[e.position] = self.executor.execute(e, intent=intent)
                self._emit("tool_result", f"{e.call_id} {e.tool_call.name}")
        if waiting:
            decided = self._decisions(waiting, [results[p] for p in sorted(results)])
            if isinstance(decided, Outcome):
                return decided
            for e in waiting:
                r = self._apply(e, decided[e.position])
                if r is None:
                    return self._halt_outcome("stop requested (SIGTERM) before an approved tool call; resume to continue")
                results[e.position] = r
        # Every call is resolved: the transcript keeps the model's original order.
        ctx = self.snap.context
        ordered = [results[p] for p in sorted(results)]
        self.snap.messages.append(turn.message)
        self.snap.messages.extend(r.to_message() for r in ordered)
        ctx.counters.iterations = it
        ctx.counters.tool_calls += sum(1 for r in ordered if r.error_kind not in ("malformed", "denied"))
        ctx.counters.tool_errors += sum(1 for r in ordered if r.error_kind == "tool_raised")
        ctx.counters.malformed_tool_calls += sum(1 for r in ordered if r.error_kind == "malformed")
        self.snap.pending = None
        if ctx.status.phase != "Running":
            ctx.status = RunStatus(phase="Running")
        self._commit(then_halted=True)  # _drive's next step is _halted()
        return None
