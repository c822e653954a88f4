"""AgentRun status: computed from the store (and the runner pods), written by the operator alone.

The runner never talks to Kubernetes; it commits checkpoints to Postgres and NOTIFYs. The
operator turns the latest checkpoint into ``status``: phase, iteration, tokens (``usage``), cost
(``cost``, when the run's model has prices), restarts, pending approvals and conditions (KEP-1623: type, status, observedGeneration,
lastTransitionTime, reason, message; ``lastTransitionTime`` changes only when ``status`` does).
Only ids, counters and short summaries go into the resource (G9): transcripts stay in Postgres.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from agentfast.runner.arguments import arguments_digest
from agentfast.runner.liveness import RunnerInfo, batch_waits, runner_story
from agentfast.runner.names import TERMINAL_PHASES, WAITING_PHASES, Phase
from agentfast.runner.snapshot import AwaitedCall, PendingToolCall, RunContext

CONDITION_TYPES = ("Ready", "Progressing", "AwaitingApproval", "AwaitingInput", "Failed", "Cancelled")
# Reason of the RunnerAlive condition for each state of liveness.runner_story.
_RUNNER_REASONS = {
    "alive": "RunnerAlive",
    "ended": "RunEnded",
    "waiting_for_decision": "WaitingForDecision",
    "decided_resume_needed": "DecidedResumeNeeded",
    "interrupted": "RunnerInterrupted",
}
SUMMARY_CHARS = 1024
ARGUMENTS_CHARS = 512
MAX_DECISIONS = 16  # the run's latest decisions listed in status, with who made them (G10); all are in Postgres
MAX_PENDING = 128  # awaited calls listed in status (G9: the resource stays small); a batch is rarely larger
# Reasons whose runner message is a sentence of our own (counts, limits, ids, field paths): copied.
# Any other message may quote foreign text (a model's answer, an endpoint's error body) and stays
# in Postgres unless the admin opts in (the chart's operator.statusSummary).
# RestartLimit and RunnerFailed are the operator's, committed by it as the run's ending (pod names,
# counts, exit codes).
OWN_SENTENCE_REASONS = frozenset(
    {
        "Started",
        "Decided",
        "BudgetExceeded",
        "InvalidSpec",
        "RunnerStarting",
        "Cancelled",
        "DeadlineExceeded",
        "RestartLimit",
        "RunnerFailed",
    }
)


def public_message(
    phase: str, reason: str, message: str, ctx: RunContext | None, pending: PendingToolCall | None, run_id: str, summary: bool
) -> str:
    """What ``status.message`` (and ``result``, conditions, Events) may say about a run (G12).

    Our own sentences as they are; for a message that may carry foreign text (the final answer,
    a model endpoint's error) one of ours with ids and counts instead, unless ``summary`` (the
    admin's opt-in) allows the runner's text (still cut to 1024 characters). ``run_id``: NS/NAME.
    """
    if summary or reason in OWN_SENTENCE_REASONS:
        return message
    if reason == "AwaitingApproval" and pending is not None:
        calls = ", ".join(f"{a.call_id} {a.tool_call.name}" for a in pending.awaiting[:MAX_PENDING])
        return f"{len(pending.awaiting)} call(s) await a decision: {calls}"
    counts = f"after {ctx.counters.iterations} iterations and {ctx.usage.total_tokens} tokens" if ctx is not None else ""
    if phase == Phase.SUCCEEDED:
        return f"finished {counts}; the answer is kept in Postgres (agentfast history {run_id})"
    if reason == "ModelError":
        return f"the model endpoint refused the request {counts}; its answer is kept in Postgres (agentfast status {run_id})"
    return f"{phase} ({reason}) {counts}; details are kept in Postgres (agentfast status {run_id})"


def usage_status(ctx: RunContext) -> dict[str, int]:
    """``status.usage``: the run's tokens so far as the provider reported them (counts of tokens)."""
    u = ctx.usage
    return {"promptTokens": u.prompt_tokens, "completionTokens": u.completion_tokens, "totalTokens": u.total_tokens}


def cost_status(ctx: RunContext) -> dict[str, Any] | None:
    """``status.cost``: what the run has cost so far (``RunContext.cost``: ``usage`` at the prices its
    checkpoint keeps), ``amount`` rounded to 6 decimals in ``currency``, ``maxCost`` when the budget
    has one; None when the run's model has no prices (status then has no ``cost``)."""
    cost = ctx.cost()
    if cost is None or ctx.prices is None:
        return None
    out: dict[str, Any] = {"amount": round(cost, 6), "currency": ctx.prices.currency}
    if ctx.budget.max_cost is not None:
        out["maxCost"] = ctx.budget.max_cost
    return out


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _conditions(phase: str, reason: str, message: str, generation: int, old: list[dict[str, Any]]) -> list[dict[str, Any]]:
    truth = {
        "Ready": phase == Phase.SUCCEEDED,
        "Progressing": phase in (Phase.PENDING, Phase.RUNNING),
        "AwaitingApproval": phase == Phase.WAITING_FOR_APPROVAL,
        "AwaitingInput": phase == Phase.WAITING_FOR_INPUT,
        "Failed": phase == Phase.FAILED,
        # spec.cancel carried out (reason Cancelled), or the AgentRun deleted first (reason Deleted)
        "Cancelled": phase == Phase.CANCELLED,
    }
    previous = {c.get("type"): c for c in old or []}
    out = []
    for ctype in CONDITION_TYPES:
        status = "True" if truth[ctype] else "False"
        prev = previous.get(ctype, {})
        out.append(
            {
                "type": ctype,
                "status": status,
                "observedGeneration": generation,
                "lastTransitionTime": prev["lastTransitionTime"]
                if prev.get("status") == status and prev.get("lastTransitionTime")
                else _now(),
                "reason": (reason if truth[ctype] else f"Not{ctype}") or phase,
                "message": message[:SUMMARY_CHARS] if truth[ctype] else "",
            }
        )
    return out


def status_from_store(
    ctx: RunContext | None,
    pending: PendingToolCall | None,
    *,
    generation: int,
    old: dict[str, Any] | None,
    override: tuple[str, str, str] | None = None,
    runner: RunnerInfo | None = None,
    decided: Mapping[str, str] | None = None,
    decisions: list[dict[str, Any]] | None = None,
    run_id: str = "",
    summary: bool = False,
    suspended: bool = False,
    blocked: tuple[str, str] | None = None,
    closed: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The ``status`` of an AgentRun whose latest checkpoint holds ``ctx`` and ``pending``.

    ``override`` = (phase, reason, message) for what only the operator knows (an invalid spec,
    the restart limit reached). A run without a checkpoint yet is ``Pending``.
    ``decided``: call id -> decision already recorded, for calls of the paused batch.
    ``decisions``: the run's latest decisions, rows of ``Store.decision_log`` (oldest first);
    ``status.decisions`` lists the last :data:`MAX_DECISIONS` as ``{callId, decision,
    decidedBy}``, so who decided is visible with kubectl (G10).
    ``pendingApprovals`` lists every other awaited call of the batch (all at once, model order);
    ``awaiting`` is their ids, comma-separated (the printer column). ``runner`` (from
    ``liveness.runner_state``) adds the condition ``RunnerAlive``: True while a runner holds the
    run, else False with why (ended, waiting for a decision, decided but not resumed,
    interrupted), the same story ``agentfast status`` tells. Its message names the holder but not
    the heartbeat age, so the condition changes only when liveness does. Messages go through
    :func:`public_message` (``run_id``, ``summary``): no foreign text unless opted in.
    ``suspended``: the run released its pod while it waits for a human (condition ``Suspended``).
    ``blocked``: (reason, message) when its runner pod cannot start or the next one waits
    (condition ``RunnerPodReady`` False; a run without a checkpoint shows it as its phase's reason).
    ``reason`` is the phase's reason (the REASON printer column).
    ``closed``: (reason, message) of ``Store.decisions_closed`` when a run that still reads
    ``Waiting...`` can use no decision any more (past ``spec.activeDeadlineSeconds``, a cancel
    asked for): ``message`` says so, and ``pendingApprovals`` lists nothing, so the approval
    admission policy admits no entry for it; condition ``DecisionsClosed`` True with that reason.
    """
    old = old or {}
    decided = decided or {}
    if override:
        phase, reason, message = override
    elif ctx is None:
        phase, reason, message = (
            (Phase.PENDING, *blocked) if blocked else (Phase.PENDING, "RunnerStarting", "waiting for the runner pod to start")
        )
    else:
        phase, reason, message = ctx.status.phase, ctx.status.reason or ctx.status.phase, ctx.status.message
        message = public_message(phase, reason, message, ctx, pending, run_id, summary)
    if closed is not None and phase not in WAITING_PHASES:
        closed = None
    if closed is not None:  # our own sentence (the deadline and the age, who asked to cancel)
        message = f"no decision can be used any more ({closed[0]}): {closed[1]}"
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase,
        "reason": reason,
        "message": message[:SUMMARY_CHARS],
        "conditions": _conditions(phase, reason, message, generation, old.get("conditions", [])),
    }
    if runner is not None and ctx is not None and not override:
        status["conditions"].append(_runner_condition(runner, phase, pending, decided, generation, old.get("conditions", [])))
    if phase not in TERMINAL_PHASES:
        waiting = phase in WAITING_PHASES and suspended
        status["conditions"].append(
            _condition(
                "Suspended",
                waiting,
                "WaitingForHuman" if waiting else "NotSuspended",
                "the run released its pod and Postgres connections while it waits for a decision; a decision starts a new runner"
                if waiting
                else "",
                generation,
                old.get("conditions", []),
            )
        )
        status["conditions"].append(
            _condition(
                "RunnerPodReady",
                blocked is None,
                blocked[0] if blocked else "RunnerPodOK",
                blocked[1] if blocked else "",
                generation,
                old.get("conditions", []),
            )
        )
    if ctx is not None:
        # A run paused on calls is in their iteration (call-N-P: N, one more than it committed),
        # as `agentfast status`, `list` and the inbox show it.
        paused_in = pending.iteration if pending is not None and phase in WAITING_PHASES else 0
        status["iteration"] = max(ctx.counters.iterations, paused_in)
        status["tokensUsed"] = ctx.usage.total_tokens
        status["restarts"] = ctx.counters.resumes
        status["usage"] = usage_status(ctx)
        cost = cost_status(ctx)
        if cost is not None:
            status["cost"] = cost
    if phase in TERMINAL_PHASES:
        status["result"] = message[:SUMMARY_CHARS]
    if decisions:
        status["decisions"] = [
            {"callId": d["call_id"], "decision": d["decision"], "decidedBy": d["decided_by"] or "unknown"}
            for d in decisions[-MAX_DECISIONS:]
        ]
    if closed is not None:
        status["conditions"].append(
            _condition("DecisionsClosed", True, closed[0], closed[1], generation, old.get("conditions", []))
        )
    if pending is not None and phase in WAITING_PHASES and closed is None:
        calls = [a for a in pending.awaiting if a.call_id not in decided][:MAX_PENDING]
        status["pendingApprovals"] = [pending_entry(a) for a in calls]
        status["awaiting"] = ",".join(a.call_id for a in calls)
    else:
        status["pendingApprovals"] = []
        status["awaiting"] = ""
    return status


def pending_entry(a: AwaitedCall) -> dict[str, Any]:
    """One entry of ``status.pendingApprovals``: ``callId``, ``tool``, ``arguments`` (whole, or
    their first :data:`ARGUMENTS_CHARS` characters with ``argumentsTruncated: true``,
    ``argumentsChars`` the whole text's length and ``argumentsNote`` saying where it is),
    ``argumentsDigest`` (of the whole text: what a decision on this call binds to, G13) and
    ``reason``."""
    text = a.tool_call.arguments
    entry: dict[str, Any] = {"callId": a.call_id, "tool": a.tool_call.name, "arguments": text[:ARGUMENTS_CHARS]}
    if len(text) > ARGUMENTS_CHARS:
        entry["argumentsTruncated"] = True
        entry["argumentsChars"] = len(text)
        entry["argumentsNote"] = (
            f"cut: the first {ARGUMENTS_CHARS} of {len(text)} characters. The whole text is in the store: the"
            " inbox's run page (agentfast ui; chart ui.transcripts) or agentfast status RUN on the store's DSN."
            " A decision binds to the whole text's argumentsDigest, not to the cut"
        )
    entry["argumentsDigest"] = arguments_digest(text)
    entry["reason"] = a.reason
    return entry


def _condition(ctype: str, true: bool, reason: str, message: str, generation: int, old: list[dict[str, Any]]) -> dict[str, Any]:
    """One KEP-1623 condition; ``lastTransitionTime`` kept while its status is unchanged."""
    status = "True" if true else "False"
    prev = next((c for c in old or [] if c.get("type") == ctype), {})
    return {
        "type": ctype,
        "status": status,
        "observedGeneration": generation,
        "lastTransitionTime": prev["lastTransitionTime"]
        if prev.get("status") == status and prev.get("lastTransitionTime")
        else _now(),
        "reason": reason,
        "message": message[:SUMMARY_CHARS],
    }


def _runner_condition(
    runner: RunnerInfo,
    phase: str,
    pending: PendingToolCall | None,
    decided: Mapping[str, str],
    generation: int,
    old: list[dict[str, Any]],
) -> dict[str, Any]:
    state, story = runner_story(runner, phase, *batch_waits(pending.call_ids if pending else [], decided))
    if state == "interrupted":  # (a stale holder's sentence has its heartbeat age)
        story = "no runner: interrupted (its process stopped or was killed); the operator starts the next runner pod"
    if state == "alive":  # without the heartbeat age: the condition changes only with liveness
        story = f"alive: runner {runner.runner_id or '(starting)'}" + (
            f" (pid {runner.pid} on host {runner.host})" if runner.pid is not None else ""
        )
    return _condition("RunnerAlive", runner.alive, _RUNNER_REASONS[state], story, generation, old)
