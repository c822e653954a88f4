"""A human in the conversation: the built-in ``ask_user`` tool and questions in ``spec.conversation``.

With ``spec.conversation: true`` (docs/conversation.md) a run can take the user's messages after
it started, as a support conversation does (user, agent, tool, user again):

- the model is offered a built-in tool ``ask_user(question)``. Its call never runs anywhere: it
  is a gated call whose decision is a **reply**, the user's text, which the model reads as the
  call's result;
- a final answer that ends in a question (its text, stripped, ends with ``?``) is taken as the
  same thing: before the reply is stored, the runtime adds an ``ask_user`` call to it whose
  ``question`` is that text, so the transcript stays what the wire format expects (an assistant
  message with a tool call, then the tool's result) and the run goes on after the reply.

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
from .snapshot import Message, ToolCall
from .tools import ToolArgumentsError, ToolContext

#: The built-in tool's name; a spec tool may not take it while ``spec.conversation`` is on.
ASK_USER = "ask_user"
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
    """``message`` (a model reply) with an ``ask_user`` call added when it is a final answer that
    ends in a question (no tool calls, no refusal; its content, stripped, ends with ``?``);
    otherwise unchanged.
    The call's id is ``ask-<iteration>``, its question the answer's text (cut to
    :data:`QUESTION_MAX_CHARS`); the text stays the message's content."""
    text = (message.content or "").strip()
    if message.tool_calls or message.refusal or not text.endswith("?"):
        return message
    call = ToolCall(id=f"ask-{iteration}", name=ASK_USER, arguments=json.dumps({"question": text[-QUESTION_MAX_CHARS:]}))
    return message.model_copy(update={"tool_calls": [call]})
