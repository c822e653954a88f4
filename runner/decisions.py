"""The rules of one human decision on an awaited tool call: approve, deny, complete or reply.

Kept out of :mod:`.spec` (which re-exports them, for ``spec.approvals``) so that the store, which
enforces them on every decision, and the CLI's ``approve``/``deny``/``complete`` need not import
the spec models (issue 15: a command imports only what it uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from . import boundedjson
from .errors import InvalidDecision as InvalidDecision  # its home is errors.py; raised and imported from here
from .names import TERMINAL_PHASES
from .storable import storable_text

if TYPE_CHECKING:
    from .snapshot import AwaitedCall

REASON_MAX_CHARS = 1024
RESULT_MAX_CHARS = 4096
REPLY_MAX_CHARS = 4096
DECISIONS = ("approve", "deny", "complete", "reply", "end")
#: The decision a question to the user (an ``ask_user`` call, docs/conversation.md) takes; the
#: others are for gated calls.
REPLY = "reply"
#: The other decision a question takes: the person ends the conversation instead of replying
#: (``agentfast end RUN``, an ``end: true`` entry of ``spec.replies``); the run ends ``Succeeded``.
END = "end"
#: The decisions a question to the user takes.
QUESTION_DECISIONS = (REPLY, END)


def check_decision(decision: str, reason: str | None, result: str | None) -> tuple[str | None, str | None]:
    """Validate one human decision; returns ``(reason, result)`` as they are to be stored.

    ``approve``: the call runs (``reason`` an optional note). ``deny``: the call does not run and
    the model reads ``reason``, which is required (a denial without one tells the model nothing).
    ``complete``: the call's effect already happened; ``result`` (required: JSON text or plain
    text, kept verbatim either way, never re-encoded) is what the model reads as the call's
    result: ``{"voucher": "V-100"}`` as that JSON, ``voucher V-100 sent`` as that text. JSON over
    the depth limits of :mod:`.boundedjson` is refused. ``reply``: the user's answer to the
    model's question (an ``ask_user`` call); ``result`` (required, plain text, at most 4096
    characters) is what the model reads. ``end``: the person ends the conversation instead of
    replying to the question (``reason`` an optional note, never read by the model).
    ``result`` is refused for the others.
    Limits: reason 1024 characters, result 4096. NUL and lone surrogates become U+FFFD.
    Raises InvalidDecision. The one home of these rules: the store, the CLI, ``spec.approvals``.
    """
    if decision not in DECISIONS:
        raise InvalidDecision(f"decision must be one of {', '.join(DECISIONS)}, got {decision!r}")
    if reason is not None:
        reason = storable_text(reason)
        if not reason.strip():
            reason = None
        elif len(reason) > REASON_MAX_CHARS:
            raise InvalidDecision(f"the reason is {len(reason)} characters; at most {REASON_MAX_CHARS}")
    if decision == "deny" and reason is None:
        raise InvalidDecision(
            "a denial needs a reason: the model reads it as the call's result (e.g. --reason 'customer withdrew')"
        )
    if decision == REPLY:
        if reason is not None:
            raise InvalidDecision("a reply has no reason: its text is what the model reads")
        if result is None or not result.strip():
            raise InvalidDecision("a reply needs its text, e.g. agentfast reply RUN 'yes, the order from May'")
        result = storable_text(result)
        if len(result) > REPLY_MAX_CHARS:
            raise InvalidDecision(f"the reply is {len(result)} characters; at most {REPLY_MAX_CHARS}")
        return None, result
    if decision == "complete":
        if result is None or not result.strip():
            raise InvalidDecision(
                'complete needs the call\'s result, JSON or plain text, e.g. --result \'{"voucher": "V-100"}\''
                " or --result 'voucher V-100 went out by hand'"
            )
        if len(result) > RESULT_MAX_CHARS:
            raise InvalidDecision(f"the result is {len(result)} characters; at most {RESULT_MAX_CHARS}")
        try:
            boundedjson.loads(result, what="the result")
        except boundedjson.JsonLimitExceeded as err:
            raise InvalidDecision(f"{err}") from None
        except ValueError:
            pass  # plain text: the model reads it as it is, never as a quoted JSON string
        result = storable_text(result)
    elif result is not None:
        raise InvalidDecision(f"a result is given only with complete, not with {decision}")
    return reason, result


def check_decision_fits(decision: str, awaited: AwaitedCall) -> None:
    """Refuse a decision of the wrong kind for ``awaited``: a question to the user (reason
    ``awaiting_input``) is answered with ``reply`` or ``end``; a gated or interrupted call is approved,
    denied or completed, never replied to. Raises InvalidDecision."""
    question = awaited.reason == "awaiting_input"
    if question and decision not in QUESTION_DECISIONS:
        raise InvalidDecision(
            f"{awaited.call_id} is the model's question to the user, not a tool call to approve: answer it with"
            " agentfast reply RUN 'text', or end the conversation with agentfast end RUN (spec.replies in a cluster)"
        )
    if not question and decision == END:
        raise InvalidDecision(
            f"{awaited.call_id} is a {awaited.tool_call.name} call awaiting approval: a conversation is ended only"
            " while the agent waits for the person (WaitingForInput); approve, deny or complete it, or cancel the run"
        )
    if not question and decision == REPLY:
        raise InvalidDecision(
            f"{awaited.call_id} is a {awaited.tool_call.name} call awaiting approval, not a question: approve, deny or complete it"
        )


# -- whether the run can still use a decision --------------------------------------------------


@dataclass(frozen=True)
class DecisionsClosed:
    """Why a run can use no decision any more, whatever call it is on (:func:`decisions_closed`).

    ``reason``: ``RunEnded`` (its phase is terminal), ``Cancelled`` (a cancel was asked for and
    not yet carried out) or ``DeadlineExceeded`` (past ``spec.activeDeadlineSeconds``, not yet
    ended); ``message``: one sentence for a person, naming the cause (the phase and its reason;
    who asked to cancel and when; the deadline and the run's age) and what becomes of the run."""

    reason: str
    message: str


def deadline_message(deadline_s: float, age_s: float) -> str:
    """The sentence of a run past ``spec.activeDeadlineSeconds`` (``deadline_s``, seconds) at age
    ``age_s`` (seconds since it was registered): its ending message, and why a decision is refused."""
    return (
        f"spec.activeDeadlineSeconds: the run is {age_s:.0f} s old, over its deadline of {deadline_s:g} s"
        " (wall clock since it was registered, waiting for humans included)"
    )


def decisions_closed(
    *,
    phase: str,
    phase_reason: str = "",
    cancel_by: str | None = None,
    cancel_at: datetime | None = None,
    age_s: float | None = None,
    deadline_s: float | None = None,
) -> DecisionsClosed | None:
    """Whether a run can no longer use any decision (approve, deny, complete, reply), and why; None
    when it still can. The one rule for every path a decision takes (Store.decide, and through it
    the CLI, the local inbox and ``spec.approvals``/``spec.replies``; the cluster inbox and
    ``--kube`` apply it to what the AgentRun shows). In this order:

    - ``phase`` terminal: the run has ended (``phase_reason`` says how);
    - ``cancel_by`` set: a cancel was asked for (by ``cancel_by`` at ``cancel_at``, timezone-aware)
      and the run starts no call any more;
    - ``deadline_s`` set and ``age_s >= deadline_s`` (seconds; the runner's own test): past
      ``spec.activeDeadlineSeconds``; the run ends ``Failed``/``DeadlineExceeded`` as soon as a
      runner holds it, and runs no call.
    """
    if phase in TERMINAL_PHASES:
        how = f"{phase}, {phase_reason}" if phase_reason and phase_reason != phase else phase
        return DecisionsClosed("RunEnded", f"the run has ended ({how}); it can use no decision any more")
    if cancel_by is not None:
        when = f" at {cancel_at.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}" if cancel_at is not None else ""
        return DecisionsClosed(
            "Cancelled",
            f"a cancel was asked for by {cancel_by}{when}: the run starts no call any more, so it can use no decision;"
            " it ends Cancelled",
        )
    if deadline_s is not None and age_s is not None and age_s >= deadline_s:
        return DecisionsClosed(
            "DeadlineExceeded",
            f"the run is past its deadline: {deadline_message(deadline_s, age_s)}; it can use no decision any more:"
            " it ends Failed (DeadlineExceeded) as soon as a runner holds it (agentfast resume, or the operator),"
            " without running any call",
        )
    return None
