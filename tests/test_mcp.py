"""MCP tools (``spec.mcpServers``, runner/mcp.py, docs/mcp.md) on real parts: real ``agentfast``
processes, the real test Postgres, and the test MCP server (``agentfast.testing.mcp_server``,
built with the official SDK) as a real process, over stdio (started by the tool host) and over
streamable HTTP (started here). Every effect the server records is counted per idempotency key.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentfast.runner.store import Store
from agentfast.testing.mcp_server import EFFECTS_ENV, META_KEY, effects

from .helpers import run_cli, spawn_cli, wait_until

pytestmark = pytest.mark.process

STDIO = [sys.executable, "-m", "agentfast.testing.mcp_server", "--stdio"]
#: One parallel batch: a read-only lookup, an idempotent note, a destructive send (gated by its
#: annotations' defaults), a read-only tool answering isError, a note with a bad argument.
BATCH = [
    {"id": "a", "name": "orders_lookup_order", "arguments": {"order_id": "A-1"}},
    {"id": "b", "name": "orders_add_note", "arguments": {"order_id": "A-1", "text": "refund agreed"}},
    {"id": "c", "name": "orders_send_message", "arguments": {"to": "ann", "body": "your refund is on its way"}},
    {"id": "d", "name": "orders_always_fails", "arguments": {"reason": "the archive is offline"}},
    {"id": "e", "name": "orders_add_note", "arguments": {"order_id": 7}},
]


def _run_file(tmp_path: Path, name: str, server: dict[str, Any], turns: list[dict[str, Any]] | None = None) -> Path:
    script = tmp_path / f"{name}-script.yaml"
    turns = turns or [{"tool_calls": BATCH}, {"content": "done"}]
    script.write_text(yaml.safe_dump({"model": f"scripted-{name}", "turns": turns}))
    doc = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "uid": str(uuid.uuid4())},
        "spec": {
            "model": {"name": f"scripted-{name}", "script": str(script)},
            "input": "settle order A-1",
            "mcpServers": [{"name": "orders", **server}],
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _journal(dsn: str, run: str) -> dict[str, Any]:
    with Store(dsn) as s:
        return {e.call_id: e for e in s.journal(f"default/{run}")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The test MCP server over streamable HTTP, a process of its own: ``(url, effects file)``."""
    port, db = _free_port(), tmp_path / "http-effects.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentfast.testing.mcp_server", "--http", "--port", str(port)],
        env={**__import__("os").environ, EFFECTS_ENV: str(db)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def up() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(up, timeout=30, what="the MCP server to listen")
        yield f"http://127.0.0.1:{port}/mcp", db
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _check_first_pause(dsn: str, run: str, db: Path, out: str) -> dict[str, Any]:
    """The batch ran but for the gated send: each effect once, under the call's own key."""
    j = _journal(dsn, run)
    assert {c for c, e in j.items() if e.state == "done"} == {"call-1-0", "call-1-1", "call-1-3", "call-1-4"}, out
    assert j["call-1-2"].state == "planned" and j["call-1-2"].gated, out
    assert '"status": "delivered"' in j["call-1-0"].result.content
    assert j["call-1-1"].result.content == "note added to A-1"
    assert j["call-1-3"].result.is_error and "the archive is offline" in j["call-1-3"].result.content
    bad = j["call-1-4"].result
    assert bad.error_kind == "malformed" and "order_id" in bad.content and "text" in bad.content  # checked before any call
    assert effects(db) == [("add_note", j["call-1-1"].idempotency_key, {"order_id": "A-1", "text": "refund agreed"})]
    return j


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_run_with_mcp_tools_pauses_for_the_destructive_one_and_succeeds_each_effect_once(
    transport: str, dsn: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if transport == "stdio":
        db = tmp_path / "stdio-effects.sqlite3"
        server: dict[str, Any] = {"command": STDIO, "env": {EFFECTS_ENV: str(db)}}
    else:
        url, db = request.getfixturevalue("http_server")
        server = {"url": url}
    run = f"mcp-{transport}"
    first = run_cli("run", str(_run_file(tmp_path, run, server)), "--no-wait", dsn=dsn)
    assert first.returncode == 0 and "waiting for approval" in first.stdout, first.stdout
    j = _check_first_pause(dsn, run, db, first.stdout)
    assert run_cli("approve", run, "call-1-2", dsn=dsn).returncode == 0
    done = run_cli("resume", run, dsn=dsn)
    assert done.returncode == 0 and "Succeeded" in done.stdout, done.stdout
    j = _journal(dsn, run)
    assert j["call-1-2"].result.content == "sent to ann"
    assert sorted((tool, key) for tool, key, _ in effects(db)) == sorted(
        [("add_note", j["call-1-1"].idempotency_key), ("send_message", j["call-1-2"].idempotency_key)]
    )


def test_a_denied_mcp_call_never_reaches_the_server(dsn: str, tmp_path: Path) -> None:
    db = tmp_path / "effects.sqlite3"
    path = _run_file(tmp_path, "mcp-deny", {"command": STDIO, "env": {EFFECTS_ENV: str(db)}})
    assert run_cli("run", str(path), "--no-wait", dsn=dsn).returncode == 0
    assert run_cli("deny", "mcp-deny", "call-1-2", "--reason", "not now", dsn=dsn).returncode == 0
    done = run_cli("resume", "mcp-deny", dsn=dsn)
    assert done.returncode == 0, done.stdout
    assert "not now" in _journal(dsn, "mcp-deny")["call-1-2"].result.content
    assert [tool for tool, _, _ in effects(db)] == ["add_note"]


def test_the_server_refuses_a_call_without_the_key_so_the_key_is_what_it_deduplicates_on() -> None:
    """The test server's own contract, which the runs above rely on: no key in _meta, no effect."""
    assert META_KEY == __import__("agentfast.runner.mcp", fromlist=["META_IDEMPOTENCY_KEY"]).META_IDEMPOTENCY_KEY


def test_an_unreachable_server_exits_75_and_keeps_the_run(dsn: str, tmp_path: Path) -> None:
    path = _run_file(tmp_path, "mcp-down", {"url": f"http://127.0.0.1:{_free_port()}/mcp"})
    first = run_cli("run", str(path), dsn=dsn, env={"AGENTFAST_MCP_CONNECT_SECONDS": "1"})
    assert first.returncode == 75 and "cannot be reached" in first.stdout, first.stdout
    assert _journal(dsn, "mcp-down") == {}  # nothing ran


def test_a_stdio_server_that_never_answers_is_given_up_on(dsn: str, tmp_path: Path) -> None:
    path = _run_file(tmp_path, "mcp-mute", {"command": [sys.executable, "-c", "import time; time.sleep(60)"]})
    proc = spawn_cli("run", str(path), dsn=dsn, env={"AGENTFAST_MCP_CONNECT_SECONDS": "2"})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
