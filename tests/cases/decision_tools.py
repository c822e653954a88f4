"""Tools of tests/test_decisions.py. Each execution appends "ran <tool> <call id> <key>" to $CASE_EFFECTS.

``send_mail`` is not idempotent and has a recovery check that answers what $RECOVERY_ANSWER
says: happened, not_happened, unknown, or raise.
"""

import os

from agentfast.runner.tools import Recovery, ToolContext, tool


def _record(tool_name: str, ctx: ToolContext) -> None:
    with open(os.environ["CASE_EFFECTS"], "a", encoding="utf-8") as f:
        f.write(f"ran {tool_name} {ctx.call_id} {ctx.idempotency_key}\n")
        f.flush()
        os.fsync(f.fileno())


@tool(requires_approval=True)
def freeze_card(ctx: ToolContext, card: str) -> dict:
    """Freeze a card. Needs a human's approval."""
    _record("freeze_card", ctx)
    return {"frozen": card}


@tool(requires_approval=True)
def refund_charge(ctx: ToolContext, charge: str) -> dict:
    """Refund a charge. Needs a human's approval."""
    _record("refund_charge", ctx)
    return {"refunded": charge}


@tool
def add_note(ctx: ToolContext, note: str) -> dict:
    """Note something on the case."""
    _record("add_note", ctx)
    return {"noted": note}


@tool(idempotent=False)
def send_mail(ctx: ToolContext, to: str) -> dict:
    """Send an e-mail. Every execution sends one more."""
    _record("send_mail", ctx)
    return {"mail": "M-1", "to": to}


@send_mail.recovery_check
def mail_sent(ctx: ToolContext) -> Recovery:
    """What $RECOVERY_ANSWER says about the interrupted mail."""
    answer = os.environ.get("RECOVERY_ANSWER", "unknown")
    if answer == "raise":
        raise ConnectionError("the mail provider's API is down")
    if answer == "happened":
        return Recovery.happened({"mail": "M-1", "found_by": ctx.idempotency_key})
    return Recovery.not_happened() if answer == "not_happened" else Recovery.unknown()
