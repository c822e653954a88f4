"""AgentRun status: computed from the store (and the runner Job), written by the operator alone.

The runner never talks to Kubernetes; it commits checkpoints to Postgres and NOTIFYs. The
operator turns the latest checkpoint into ``status``: phase, iteration, tokens, restarts,
pending approvals and conditions (KEP-1623: type, status, observedGeneration,
lastTransitionTime, reason, message; ``lastTransitionTime`` changes only when ``status`` does).
Only ids, counters and short summaries go into the resource (G9): transcripts stay in Postgres.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Collection

from agentfast.runner.snapshot import PendingToolCall, RunContext

CONDITION_TYPES = ("Ready", "Progressing", "AwaitingApproval", "Failed")
SUMMARY_CHARS = 1024
ARGUMENTS_CHARS = 512
MAX_PENDING = 128  # awaited calls listed in status (G9: the resource stays small); a batch is rarely larger


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _conditions(phase: str, reason: str, message: str, generation: int, old: list[dict[str, Any]]) -> list[dict[str, Any]]:
    truth = {
        "Ready": phase == "Succeeded",
        "Progressing": phase in ("Pending", "Running"),
        "AwaitingApproval": phase == "WaitingForApproval",
        "Failed": phase == "Failed",
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
                "lastTransitionTime": prev["lastTransitionTime"] if prev.get("status") == status and prev.get("lastTransitionTime") else _now(),
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
    decided: Collection[str] = (),
) -> dict[str, Any]:
    """The ``status`` of an AgentRun whose latest checkpoint holds ``ctx`` and ``pending``.

    ``override`` = (phase, reason, message) for what only the operator knows (an invalid spec,
    the restart limit reached). A run without a checkpoint yet is ``Pending``.
    ``decided``: ids of awaited calls that already have a decision. ``pendingApprovals`` lists
    every other awaited call of the paused batch (all at once, model order); ``awaiting`` is
    their ids, comma-separated (the printer column).
    """
    old = old or {}
    if override:
        phase, reason, message = override
    elif ctx is None:
        phase, reason, message = "Pending", "RunnerStarting", "waiting for the runner pod to start"
    else:
        phase, reason, message = ctx.status.phase, ctx.status.reason or ctx.status.phase, ctx.status.message
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase,
        "message": message[:SUMMARY_CHARS],
        "conditions": _conditions(phase, reason, message, generation, old.get("conditions", [])),
    }
    if ctx is not None:
        status["iteration"] = ctx.counters.iterations
        status["tokensUsed"] = ctx.usage.total_tokens
        status["restarts"] = ctx.counters.resumes
    if phase in ("Succeeded", "Failed"):
        status["result"] = message[:SUMMARY_CHARS]
    if pending is not None and phase == "WaitingForApproval":
        calls = [a for a in pending.awaiting if a.call_id not in decided][:MAX_PENDING]
        status["pendingApprovals"] = [
            {"callId": a.call_id, "tool": a.tool_call.name, "arguments": a.tool_call.arguments[:ARGUMENTS_CHARS], "reason": a.reason}
            for a in calls
        ]
        status["awaiting"] = ",".join(a.call_id for a in calls)
    else:
        status["pendingApprovals"] = []
        status["awaiting"] = ""
    return status
