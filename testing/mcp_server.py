"""A test MCP server, built with the official SDK's server side (``mcp.server.mcpserver.MCPServer``).

``python -m agentfast.testing.mcp_server --stdio`` serves it on stdin/stdout (a command in the
runner image); ``python -m agentfast.testing.mcp_server --http --port N [--host H]`` serves it as
streamable HTTP at ``http://H:N/mcp`` (a Deployment and Service in the cluster tier). Its tools
stand for a team's remote systems, one per default the annotations give (docs/mcp.md):

- ``lookup_order`` (``readOnlyHint``): reads, changes nothing;
- ``add_note`` (``idempotentHint``, ``destructiveHint: false``): records its effect once per
  idempotency key;
- ``send_message`` (no hints: by MCP's defaults destructive and not idempotent): records every
  call it receives, as a real sender would send every one;
- ``always_fails`` (``readOnlyHint``): answers ``isError`` with a text saying why;
- ``slow_lookup`` (``readOnlyHint``): answers after ``seconds``.

With ``MCP_TEST_CRASH_AFTER_EFFECT`` naming a file that does not exist, the first ``add_note``
call creates it, records its effect and exits the server before answering.

Every call must carry the idempotency key in the request's ``_meta``
(:data:`agentfast.runner.mcp.META_IDEMPOTENCY_KEY`): a call without it is refused with an error
result and records nothing, so a test that sees an effect proves the key was sent.

Effects go to the SQLite file named by ``MCP_TEST_EFFECTS`` (default: ``mcp-effects.sqlite3`` in
the temporary directory): table ``effects(tool, key, arguments)`` (:func:`effects` reads it).
Several server processes may share one file (a runner's stdio server and its replacement's).
"""

# No `from __future__ import annotations`: the SDK reads the tools' annotations (``ctx: Context``,
# imported inside build_server) at registration.
import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EFFECTS_ENV = "MCP_TEST_EFFECTS"
#: A file name: the first ``add_note`` call, finding no such file, makes it, records its effect and
#: kills the server before it answers (a server that dies mid-call); later calls answer.
CRASH_ENV = "MCP_TEST_CRASH_AFTER_EFFECT"
#: The _meta key the runtime sends the idempotency key under (agentfast.runner.mcp.META_IDEMPOTENCY_KEY).
META_KEY = "dev.agentfast/idempotency-key"


def effects_path() -> Path:
    """Where this process records effects (``$MCP_TEST_EFFECTS`` or a file in the temp dir)."""
    return Path(os.environ.get(EFFECTS_ENV) or Path(tempfile.gettempdir()) / "mcp-effects.sqlite3")


def _db(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS effects (tool TEXT NOT NULL, key TEXT NOT NULL, arguments TEXT NOT NULL)")
    conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS effects_once ON effects (tool, key) WHERE tool != 'send_message'")
    return conn


def effects(path: str | Path) -> list[tuple[str, str, dict[str, Any]]]:
    """Every recorded effect of the file at ``path``: ``(tool, idempotency key, arguments)``, in
    the order they happened; [] when nothing was recorded yet."""
    if not Path(path).exists():
        return []
    with sqlite3.connect(path, timeout=30) as conn:
        rows = conn.execute("SELECT tool, key, arguments FROM effects ORDER BY rowid").fetchall()
    return [(tool, key, json.loads(args)) for tool, key, args in rows]


def build_server() -> Any:
    """The MCPServer with the four tools above (imports the SDK: call it only to serve)."""
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import ToolAnnotations

    server = MCPServer("agentfast-test-mcp", log_level="WARNING")

    def key_of(ctx: Context) -> str:
        key = (ctx.request_context.meta or {}).get(META_KEY)
        if not isinstance(key, str) or not key:
            raise ToolError(f"refused: no idempotency key in the request's _meta ({META_KEY})")
        return key

    def record(tool: str, key: str, arguments: dict[str, Any]) -> bool:
        """Record the effect; False when this key's effect was recorded already (idempotent tools)."""
        conn = _db(effects_path())
        try:
            conn.execute("INSERT INTO effects (tool, key, arguments) VALUES (?, ?, ?)", (tool, key, json.dumps(arguments)))
            return True
        except sqlite3.IntegrityError:
            return False
        finally:
            conn.close()

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def lookup_order(order_id: str, ctx: Context) -> str:
        """Look up an order's status."""
        key_of(ctx)
        return json.dumps({"order_id": order_id, "status": "delivered", "total_cents": 4200})

    @server.tool(annotations=ToolAnnotations(idempotent_hint=True, destructive_hint=False))
    def add_note(order_id: str, text: str, ctx: Context) -> str:
        """Add a note to an order (once per idempotency key)."""
        key = key_of(ctx)
        new = record("add_note", key, {"order_id": order_id, "text": text})
        crash = os.environ.get(CRASH_ENV)
        if crash and not Path(crash).exists():  # the effect happened; the answer never leaves
            Path(crash).write_text(key)
            os._exit(1)
        return f"note added to {order_id}" if new else f"note already added to {order_id}"

    @server.tool()
    def send_message(to: str, body: str, ctx: Context) -> str:
        """Send a message to a customer."""
        key = key_of(ctx)
        record("send_message", key, {"to": to, "body": body})
        return f"sent to {to}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def slow_lookup(order_id: str, seconds: float, ctx: Context) -> str:
        """Look up an order, taking this many seconds."""
        key_of(ctx)
        time.sleep(seconds)
        return f"{order_id}: delivered"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def always_fails(reason: str, ctx: Context) -> str:
        """Fail, saying why."""
        key_of(ctx)
        raise ToolError(f"it failed: {reason}")

    return server


def main(argv: list[str] | None = None) -> int:
    """``--stdio`` or ``--http [--host H] --port N``: serve until stdin closes or the process is stopped."""
    parser = argparse.ArgumentParser(prog="python -m agentfast.testing.mcp_server")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stdio", action="store_true")
    mode.add_argument("--http", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    server = build_server()
    if args.stdio:
        server.run("stdio")
    else:
        server.run("streamable-http", host=args.host, port=args.port, stateless_http=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
