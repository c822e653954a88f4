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
from ..loop import Outcome, RunnerBase
from ..names import Phase
from ..snapshot import RunStatus, ToolResult
from ..store import JournalEntry, Turn


class VanillaRunner(RunnerBase):
    """The loop-owning adapter: the transcript in ``StateSnapshot.messages`` is authoritative."""

    adapter = "vanilla"

    def start_with_turn(self, plan: list[JournalEntry]) -> int | None:
        """The batch's first call that runs without a human (G5: those run first, in the model's
        order), when the executor would start it (a known tool, arguments that parse) and no stop
        is asked yet: its intent is written with the turn, one write instead of two. Else None."""
        if self.halt_known():
            return None
        first = next((e for e in plan if not self.executor.needs_human(e)), None)
        return first.position if first is not None and self.executor.startable(first) else None

    def drive(self) -> Outcome:
        while True:
            if self.halted(self.take_ends()):
                return self.halt_outcome("stop requested (SIGTERM): state committed; resume to continue")
            outcome = self._iteration()
            if outcome is not None:
                return outcome

    def _iteration(self) -> Outcome | None:
        it = self.snap.context.counters.iterations + 1
        turn = self.model_turn(it, self.snap.messages)
        if not turn.message.tool_calls:
            self.snap.messages.append(turn.message)
            self.snap.context.counters.iterations = it
            return self.finish(Phase.SUCCEEDED, "Completed", turn.message.answer_text())
        return self._run_batch(it, turn)

    def _run_batch(self, it: int, turn: Turn) -> Outcome | None:
        entries = self.planned_entries(it) or self.store.journal(self.run_id, it)
        results: dict[int, ToolResult] = {}
        waiting: list[JournalEntry] = []
        # G5: the calls that need no human run first, in the model's order.
        for e in entries:
            t = self.triage(e)
            if isinstance(t, ToolResult):
                results[e.position] = t
            elif t == "human":
                waiting.append(e)
            else:
                # SIGTERM is checked here; a cancel or the deadline by the write that starts the call (RunEnding).
                # A call whose intent the turn's write recorded has started: a SIGTERM since then
                # is one that came just after its intent, and the call runs.
                intent = self.take_intent(it, e.position)
                if intent is NOT_WRITTEN and self.halt_known():
                    return self.halt_outcome("stop requested (SIGTERM) before a tool call; resume to continue")
                results[e.position] = self.executor.execute(e, intent=intent)
                self.emit("tool_result", f"{e.call_id} {e.tool_call.name}")
        if waiting:
            decided = self.decisions(waiting, [results[p] for p in sorted(results)])
            if isinstance(decided, Outcome):
                return decided
            for e in waiting:
                r = self.apply_decision(e, decided[e.position])
                if r is None:
                    return self.halt_outcome("stop requested (SIGTERM) before an approved tool call; resume to continue")
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
        if ctx.status.phase != Phase.RUNNING.value:
            ctx.status = RunStatus(phase=Phase.RUNNING)
        self.commit(then_halted=True)  # drive's next step is halted()
        return None
