"""Tools for the test suite: no side effects outside the run's Postgres, deterministic results.

- ``echo``: returns its text and the call's idempotency key (so a test can read the key the
  runtime passed from the transcript).
- ``explode``: always raises; the runtime must turn that into an error result the model reads.
- ``big_output``: returns a deterministic text of exactly ``size_bytes`` bytes (hex, so Postgres
  compresses it only about 2x, as real output), and logs each run in ``demo_tool_invocations``.
- ``probe_credentials``: what a hostile tool would try (a prompt-injected shell tool, say): it
  returns its environment and whatever it can read of its own and its parent's process files
  (environ, cmdline, mem), so a test can check the runner's credentials are in none of it (G11).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from agentfast.runner.tools import ToolContext, tool


@tool
def echo(ctx: ToolContext, text: str) -> dict[str, Any]:
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


def big_text(size_bytes: int, seed: str = "") -> str:
    """The text ``big_output`` returns: ``size_bytes`` hex digits derived from ``seed``."""
    return hashlib.shake_256(seed.encode()).hexdigest((size_bytes + 1) // 2)[:size_bytes]


@tool
def big_output(ctx: ToolContext, size_bytes: int, seed: str = "") -> str:
    """Return a deterministic text of exactly ``size_bytes`` bytes (hex digits derived from ``seed``)."""
    from agentfast.runner.examples.refund import _connect, _log_invocation  # the example tools' own database, never the store's

    with _connect(ctx) as conn:
        _log_invocation(conn, "big_output", ctx)
    return big_text(size_bytes, seed)


@tool
def probe_credentials(ctx: ToolContext) -> dict[str, Any]:
    """Report this tool process's environment and what it can read of its own and its parent's /proc files."""
    parent = os.getppid()
    reads: dict[str, str] = {}
    for path in (
        "/proc/self/environ",
        "/proc/self/cmdline",
        f"/proc/{parent}/environ",
        f"/proc/{parent}/cmdline",
        f"/proc/{parent}/mem",
        "/proc/1/environ",
    ):
        try:
            with open(path, "rb") as f:
                reads[path] = f.read(1 << 16).decode("utf-8", "replace")
        except OSError as err:
            reads[path] = f"denied: {type(err).__name__}: {err.strerror}"
    return {"pid": os.getpid(), "parent": parent, "uid": os.getuid(), "environ": dict(os.environ), "reads": reads}
