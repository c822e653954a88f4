"""Tools for tests/test_tool_isolation.py only (not shipped in the product's examples).

Importing this module appends the importing process's pid to the file named by
``TOOL_FIXTURES_IMPORT_LOG``, so a test can tell which process imported the tools.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentfast.runner.tools import ToolContext, tool

_LOG = os.environ.get("TOOL_FIXTURES_IMPORT_LOG")
if _LOG:
    with open(_LOG, "a") as f:
        f.write(f"{os.getpid()}\n")


@tool
def die_once(ctx: ToolContext, text: str) -> dict:
    """The first execution kills its own process (SIGKILL-like, no cleanup); later ones answer.

    The file ``DIE_ONCE_FLAG`` remembers the first execution; each execution appends its key to
    ``DIE_ONCE_FLAG.calls``."""
    flag = Path(os.environ["DIE_ONCE_FLAG"])
    with open(f"{flag}.calls", "a") as f:
        f.write(f"{ctx.idempotency_key}\n")
    if not flag.exists():
        flag.write_text("died")
        os._exit(137)
    return {"text": text, "idempotency_key": ctx.idempotency_key}
