"""The rules of one human decision on an awaited tool call: approve, deny, complete or reply.

Kept out of :mod:`.spec` (which re-exports them, for ``spec.approvals``) so that the store, which
enforces them on every decision, and the CLI's ``approve``/``deny``/``complete`` need not import
the spec models (issue 15: a command imports only what it uses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import boundedjson
from .errors import InvalidDecision as InvalidDecision  # its home is errors.py; raised and imported from here
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
    ``complete``: the call's effect already happened; ``result`` (required, JSON text, kept
    verbatim) is what the model reads as the call's result. ``reply``: the user's answer to the
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
            raise InvalidDecision('complete needs the call\'s result as JSON text, e.g. --result \'{"voucher": "V-100"}\'')
        if len(result) > RESULT_MAX_CHARS:
            raise InvalidDecision(f"the result is {len(result)} characters; at most {RESULT_MAX_CHARS}")
        try:
            boundedjson.loads(result, what="the result")
        except boundedjson.JsonLimitExceeded as err:
            raise InvalidDecision(f"{err}") from None
        except ValueError as err:
            raise InvalidDecision(
                f"the result must be JSON text (an object, array, string in quotes, number...): {err}"
            ) from None
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
