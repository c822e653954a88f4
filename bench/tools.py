"""The benchmark's tools: pure functions, so a scripted run's time is the runtime's (model HTTP
round trip, journal, checkpoint), not a tool's side effects. ``lookup`` returns ~300 B; ``blob``
a large output of a given size.

Referenced from generated AgentRuns as ``bench.tools:lookup`` / ``bench.tools:blob`` (the runner
process gets the repository root on PYTHONPATH).
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
        "note": (
            "Two charges of 4999 cents on the same card within a minute; the second looks like a retry "
            "of the first. The shipment left the warehouse the next morning and was delivered on time."
        ),
    }


@tool
def blob(ctx: ToolContext, size: int, seed: int) -> dict:
    """A large output (issue 15 item 3): ``size`` bytes of base64 text from a generator seeded by
    ``seed``, so it barely compresses (TOAST cannot hide what a large output costs to store)."""
    import base64
    import random

    return {"seed": seed, "data": base64.b64encode(random.Random(seed).randbytes(size * 3 // 4)).decode()[:size]}
