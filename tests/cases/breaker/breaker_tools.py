"""Tools of tests/test_kinds_again.py (issue 11, new inputs of every kind). Each execution appends
"ran <tool> <call id> <key>" to $CASE_EFFECTS."""
import os
import time

from agentfast.runner.tools import ToolContext, tool


def _rec(name, ctx):
    with open(os.environ.get("CASE_EFFECTS", "/tmp/bx/effects.log"), "a") as f:
        f.write(f"ran {name} {ctx.call_id} {ctx.idempotency_key}\n"); f.flush(); os.fsync(f.fileno())

@tool
def echo(ctx: ToolContext, text: str) -> dict:
    """Echo."""
    _rec("echo", ctx); return {"text": text}

@tool
def boom(ctx: ToolContext, what: str = "") -> str:
    """Raises with the message given."""
    _rec("boom", ctx); raise RuntimeError(what)

@tool(requires_approval=True)
def gated(ctx: ToolContext, what: str = "") -> dict:
    """Gated."""
    _rec("gated", ctx); return {"done": what}

@tool(idempotent=False)
def send(ctx: ToolContext, to: str = "") -> dict:
    """Non idempotent."""
    _rec("send", ctx); return {"sent": to}

@tool
def slow(ctx: ToolContext, secs: float = 5) -> dict:
    """Sleeps."""
    _rec("slow", ctx); time.sleep(secs); return {"slept": secs}

@tool
def badexc(ctx: ToolContext, what: str = "") -> str:
    """Raises with unstorable text."""
    _rec("badexc", ctx); raise ValueError("bad \x00 byte \udcff here " + what)

@tool(requires_approval=True)
def gated_bad(ctx: ToolContext, what: str = "") -> str:
    """Gated, returns unstorable text."""
    _rec("gated_bad", ctx); return "res\x00ult \ud800 " + what
