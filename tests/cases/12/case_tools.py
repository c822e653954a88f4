"""Tools of case 12 (issue 31; turn 3's case 03). Each execution appends one line to $CASE_EFFECTS so the check can count them."""

import os

from agentfast.runner.tools import ToolContext, tool


def _record(kind: str, tool_name: str, ctx: ToolContext) -> None:
    """Append one line "<kind> <tool> <call id> <idempotency key>" to $CASE_EFFECTS (fsynced)."""
    path = os.environ.get("CASE_EFFECTS") or os.path.join(os.environ.get("AGENTFAST_HOME", "."), "effects.log")
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{kind} {tool_name} {ctx.call_id} {ctx.idempotency_key}\n")
        f.flush()
        os.fsync(f.fileno())


@tool(requires_approval=True, idempotent=False)
def send_payment(ctx: ToolContext, to: str, amount: int) -> dict:
    """Send a payment (gated: a human approves each one)."""
    _record("ran", "send_payment", ctx)
    return {"sent": amount, "to": to}
