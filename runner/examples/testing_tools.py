"""Tools for the test suite: no side effects outside the run's Postgres, deterministic results.

- ``echo``: returns its text and the call's idempotency key (so a test can read the key the
  runtime passed from the transcript).
- ``explode``: always raises; the runtime must turn that into an error result the model reads.
"""

from __future__ import annotations

from ..tools import ToolContext, tool


@tool
def echo(ctx: ToolContext, text: str) -> dict:
    """Echo the text back, with the idempotency key of this call."""
    return {"text": text, "idempotency_key": ctx.idempotency_key, "call_id": ctx.call_id}


@tool
def explode(ctx: ToolContext, what: str = "") -> str:
    """A tool that always fails."""
    raise RuntimeError(f"explode was asked to fail ({what or 'no reason'})")


@tool
def nul_output(ctx: ToolContext, text: str) -> str:
    """Returns text with NUL characters in it, which Postgres cannot store as text."""
    return f"before\x00{text}\x00after"
