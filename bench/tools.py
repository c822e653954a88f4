"""The benchmark's tool: a pure function returning ~300 B, so a scripted run's time is the
runtime's (model HTTP round trip, journal, checkpoint), not a tool's side effects.

Referenced from generated AgentRuns as ``bench.tools:lookup`` (the runner process gets the
repository root on PYTHONPATH).
"""

from __future__ import annotations

from agentfast.runner.tools import ToolContext, tool


@tool
def lookup(ctx: ToolContext, order_id: str) -> dict:
    """Look an order up (synthetic, deterministic)."""
    return {
        "order_id": order_id,
        "customer": "Dana Ruiz",
        "status": "delivered",
        "charges": [4999, 4999],
        "call": ctx.call_id,
        "note": ("Two charges of 4999 cents on the same card within a minute; the second looks like a retry "
                 "of the first. The shipment left the warehouse the next morning and was delivered on time."),
    }
