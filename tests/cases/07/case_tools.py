"""Tools of case 07. Each execution appends "start" and "ran" lines to $CASE_EFFECTS so the check can count them."""

import os
import time

from agentfast.runner.tools import ToolContext, tool


def _record(kind: str, tool_name: str, ctx: ToolContext) -> None:
    """Append one line "<kind> <tool> <call id> <idempotency key>" to $CASE_EFFECTS (fsynced)."""
    path = os.environ.get("CASE_EFFECTS") or os.path.join(os.environ.get("AGENTFAST_HOME", "."), "effects.log")
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{kind} {tool_name} {ctx.call_id} {ctx.idempotency_key}\n")
        f.flush()
        os.fsync(f.fileno())


@tool(idempotent=True)
def export_statement(ctx: ToolContext, account_id: str, month: str) -> dict:
    """Build a monthly statement PDF for an account (slow: about 8 seconds)."""
    _record("start", "export_statement", ctx)
    time.sleep(float(os.environ.get("CASE07_TOOL_S", "8")))  # the suite lengthens it on a slow machine
    _record("ran", "export_statement", ctx)
    return {"account_id": account_id, "month": month, "file": f"statement-{account_id}-{month}.pdf"}
