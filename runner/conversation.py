"""A human in the conversation: the built-in ``ask_user`` tool and questions in ``spec.conversation``.

With ``spec.conversation: true`` (docs/conversation.md) a run can take the user's messages after
it started, as a support conversation does (user, agent, tool, user again):

- the model is offered a built-in tool ``ask_user(question)``. Its call never runs anywhere: it
  is a gated call whose decision is a **reply**, the user's text, which the model reads as the
  call's result;
- every assistant message that calls no tool ends the agent's turn, as in a conversation between
  people, whether or not it ends in ``?`` ("I have cancelled the order." waits too): before the
  reply is stored, the runtime adds an ``ask_user`` call to it whose ``question`` is that text,
  so the transcript stays what the wire format expects (an assistant message with a tool call,
  then the tool's result) and the run goes on after the reply;
- the conversation ends when the person ends it (decision ``end`` on the question that awaits
  them), when the model calls the built-in ``end_conversation`` tool, or when the person has
  not answered within ``spec.conversationIdleTimeout`` seconds. :func:`how_it_ended` reads which
  from the journal, so a runner that resumes finds the ending again without asking the model.

Why a gated call and not a new kind of step: the reply then rides on everything a decision
already has (G10, G5, G4): it is write-once and attributed (``agentfast_approvals``, decision
``reply``), made through the same paths (the CLI, ``kubectl agentfast``, ``spec.replies`` under
the approval admission policy), waited for and suspended on like an approval, and a runner killed
while it waits resumes at that exact question, asking the model nothing again.
"""

from __future__ import annotations

import json
from typing import Any

from . import boundedjson
from .arguments import DuplicateKey, loads_arguments
from .snapshot import Message, ToolCall, ToolResult
from .tools import ToolArgumentsError, ToolContext

#: The built-in tool's name; a spec tool may not take it while ``spec.conversation`` is on.
ASK_USER = "ask_user"
#: The built-in tool the model calls to end the conversation (the run ends ``Succeeded``).
END_CONVERSATION = "end_conversation"
#: ``ToolResult.recorded_by`` of a question the conversation ended on, before ``<who>``:
#: ``ended:user:<who>`` (the person's ``end`` decision) or ``ended:idle-timeout``.
ENDED_PREFIX = "ended:"
#: ``ToolResult.recorded_by`` of a question the idle timeout ended.
ENDED_IDLE = "ended:idle-timeout"
#: What the model would read as an ended question's result (it is never asked again).
ENDED_TEXT = "[the conversation has ended]"
#: The status reasons of the three endings (docs/conversation.md); each ends the run Succeeded.
ENDED_BY_USER = "EndedByUser"
ENDED_BY_AGENT = "EndedByAgent"
IDLE_TIMEOUT = "IdleTimeout"
#: The longest question ``ask_user`` takes, in characters (what status and a terminal show).
QUESTION_MAX_CHARS = 4096

_DESCRIPTION = (
    "Ask the user a question and wait for their reply, which you receive as this tool's result. "
    "Use it when you need information or a choice only the user can give."
)


class AskUserTool:
    """The built-in ``ask_user`` tool as the journal sees it (the surface of
    :class:`agentfast.runner.tools.Tool`): gated (``requires_approval``), so every call waits for
    a human; its decision is ``reply``. :meth:`invoke` is never reached: an approval-kind decision
    on it is refused by the store (``decisions.check_decision_fits``)."""

    name = ASK_USER
    description = _DESCRIPTION
    idempotent = True
    requires_approval = True
    recovery = None
    schema: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": ASK_USER,
            "description": _DESCRIPTION,
            "parameters": {
                "type": "object",
                "properties": {"question": {"type": "string", "description": "what to ask the user"}},
                "required": ["question"],
                "additionalProperties": False,
            },
        },
    }

    def parse_arguments(self, raw: str) -> str:
        """Check ``raw`` is ``{"question": "<text>"}``; returns ``raw``. Raises ToolArgumentsError."""
        question_of(raw, strict=True)
        return raw

    def invoke(self, ctx: ToolContext, arguments: str) -> str:
        """Never called: a question is answered by a reply, not run. Raises RuntimeError."""
        raise RuntimeError("ask_user is answered by the user's reply (agentfast reply), never run")


_END_DESCRIPTION = (
    "End the conversation with the user, for good: call it once the user's request is fully handled and "
    "they need nothing more (after your last message to them). The run then ends; the user can no longer reply."
)


class EndConversationTool:
    """The built-in ``end_conversation`` tool (the surface of :class:`agentfast.runner.tools.Tool`),
    offered in every ``spec.conversation`` run: not gated, and its call runs in the runner itself
    (never in the tool host). Its journaled result is what marks the conversation ended
    (:func:`how_it_ended`); the runner then ends the run ``Succeeded``, reason ``EndedByAgent``,
    before it would ask the model again. The model's text in the same message is its last word."""

    name = END_CONVERSATION
    description = _END_DESCRIPTION
    idempotent = True
    requires_approval = False
    recovery = None
    schema: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": END_CONVERSATION,
            "description": _END_DESCRIPTION,
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }

    def parse_arguments(self, raw: str) -> str:
        """Any JSON object (or nothing) is accepted: the call ends the conversation whatever it
        says. Returns ``raw``; raises ToolArgumentsError for arguments that are not a JSON object."""
        if not raw.strip():
            return raw
        try:
            data = loads_arguments(raw)
        except (json.JSONDecodeError, DuplicateKey) as err:
            raise ToolArgumentsError(f"end_conversation takes no arguments ({str(err)[:200]})") from None
        if not isinstance(data, dict):
            raise ToolArgumentsError("end_conversation takes no arguments ({})")
        return raw

    def invoke(self, ctx: ToolContext, arguments: str) -> str:
        """The call's result: the conversation has ended (nothing else happens here)."""
        return json.dumps({"ended": True})


def how_it_ended(message: Message | None, results: list[ToolResult]) -> tuple[str, str] | None:
    """Whether the conversation ended with the batch of assistant ``message`` (None: unknown; its
    tool calls' journaled ``results``, in any order): ``(reason, status message)`` for ``EndedByAgent`` (it called
    ``end_conversation`` and the call finished), ``EndedByUser`` or ``IdleTimeout`` (a question
    of it was ended, ``ToolResult.recorded_by``); else None. The status message is the agent's
    last words (the message's text), or says who ended it when there are none."""
    text = ((message.content or message.refusal or "") if message is not None else "").strip()
    for r in results:
        if r.tool_name == END_CONVERSATION and r.error_kind is None:
            return ENDED_BY_AGENT, text or "the agent ended the conversation"
    for r in results:
        by = r.recorded_by or ""
        if r.tool_name == ASK_USER and by.startswith(ENDED_PREFIX):
            if by == ENDED_IDLE:
                return IDLE_TIMEOUT, text or "the person did not answer within spec.conversationIdleTimeout"
            return ENDED_BY_USER, text or f"{by[len(ENDED_PREFIX) :]} ended the conversation"
    return None


def question_of(arguments: str, *, strict: bool = False) -> str:
    """The question text of an ``ask_user`` call's raw JSON ``arguments``; with ``strict``,
    raises ToolArgumentsError for arguments that are not ``{"question": str}`` (at most
    :data:`QUESTION_MAX_CHARS`), else returns the raw text for those."""
    try:
        data = loads_arguments(arguments)
    except json.JSONDecodeError as err:  # JsonLimitExceeded too: too deep or too large
        if strict and isinstance(err, boundedjson.JsonLimitExceeded):
            raise ToolArgumentsError(f"arguments refused: {err}") from None
        if strict:
            raise ToolArgumentsError(f"arguments are not valid JSON ({err.msg} at char {err.pos})") from None
        return arguments
    except DuplicateKey as err:
        if strict:
            raise ToolArgumentsError(f"arguments refused: {err}") from None
        return arguments
    question = data.get("question") if isinstance(data, dict) else None
    if not isinstance(question, str) or (strict and set(data) != {"question"}):
        if strict:
            raise ToolArgumentsError('ask_user takes exactly {"question": "<text>"}')
        return arguments
    if strict and len(question) > QUESTION_MAX_CHARS:
        raise ToolArgumentsError(f"the question is {len(question)} characters; at most {QUESTION_MAX_CHARS}")
    return question


def as_question(message: Message, iteration: int) -> Message:
    """``message`` (a model reply in a ``spec.conversation`` run) with an ``ask_user`` call added
    when it calls no tool: in a conversation such a message ends the agent's turn and waits for
    the person, whether it ends in ``?`` or not, and a refusal too (its text is then the
    question); a message that calls tools is returned unchanged.
    The call's id is ``ask-<iteration>``, its question the message's text (its last
    :data:`QUESTION_MAX_CHARS` characters; empty when it said nothing); the text stays the
    message's content."""
    text = (message.content or message.refusal or "").strip()
    if message.tool_calls:
        return message
    call = ToolCall(id=f"ask-{iteration}", name=ASK_USER, arguments=json.dumps({"question": text[-QUESTION_MAX_CHARS:]}))
    return message.model_copy(update={"tool_calls": [call]})
