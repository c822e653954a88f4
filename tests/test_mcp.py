"""MCP tools (``spec.mcpServers``, runner/mcp.py, docs/mcp.md) on real parts: real ``agentfast``
processes, the real test Postgres, and the test MCP server (``agentfast.testing.mcp_server``,
built with the official SDK) as a real process, over stdio (started by the tool host) and over
streamable HTTP (started here). Every effect the server records is counted per idempotency key.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentfast.runner.store import Store
from agentfast.testing.mcp_server import CRASH_ENV, EFFECTS_ENV, META_KEY, effects

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


def _run_file(tmp_path: Path, name: str, server: dict[str, Any], turns: list[dict[str, Any]] | None = None, **spec: Any) -> Path:
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
            **spec,
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


@pytest.mark.parametrize("transport", ["stdio", "http", "stdio-langgraph"])
def test_a_run_with_mcp_tools_pauses_for_the_destructive_one_and_succeeds_each_effect_once(
    transport: str, dsn: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    spec: dict[str, Any] = {}
    if transport == "stdio-langgraph":  # the same tools, journal and gates on the other adapter
        spec = {"adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"}}
    if transport.startswith("stdio"):
        db = tmp_path / "stdio-effects.sqlite3"
        server: dict[str, Any] = {"command": STDIO, "env": {EFFECTS_ENV: str(db)}}
    env: dict[str, str] = {}
    if transport == "http":  # named as a cluster names it: serverRef, resolved from AGENTFAST_MCP_SERVERS
        url, db = request.getfixturevalue("http_server")
        server, env = {"serverRef": "crm"}, {"AGENTFAST_MCP_SERVERS": json.dumps({"crm": url})}
    run = f"mcp-{transport}"
    first = run_cli("run", str(_run_file(tmp_path, run, server, **spec)), "--no-wait", dsn=dsn, env=env)
    assert first.returncode == 0 and "waiting for approval" in first.stdout, first.stdout
    j = _check_first_pause(dsn, run, db, first.stdout)
    assert run_cli("approve", run, "call-1-2", dsn=dsn).returncode == 0
    done = run_cli("resume", run, dsn=dsn, env=env)
    assert done.returncode == 0 and "Succeeded" in done.stdout, done.stdout
    j = _journal(dsn, run)
    assert j["call-1-2"].result.content == "sent to ann"
    assert sorted((tool, key) for tool, key, _ in effects(db)) == sorted(
        [("add_note", j["call-1-1"].idempotency_key), ("send_message", j["call-1-2"].idempotency_key)]
    )


def test_the_test_server_refuses_a_call_without_the_key_so_an_effect_proves_the_key_was_sent(tmp_path: Path) -> None:
    from agentfast.runner.mcp import McpConnections, _Target, render

    db = tmp_path / "effects.sqlite3"
    conn = McpConnections()
    try:
        conn.connect(_Target("orders", argv=tuple(STDIO), env=((EFFECTS_ENV, str(db)),)), deadline=time.monotonic() + 30)
        refused = conn.call("orders", "add_note", {"order_id": "A-1", "text": "t"}, {})
        assert refused.is_error and "no idempotency key" in render(refused)
        assert effects(db) == []
        done = conn.call("orders", "add_note", {"order_id": "A-1", "text": "t"}, {META_KEY: "k-1"})
        assert not done.is_error and render(done) == "note added to A-1"
        assert [key for _, key, _ in effects(db)] == ["k-1"]
    finally:
        conn.close()


def test_an_unreachable_server_exits_75_and_keeps_the_run(dsn: str, tmp_path: Path) -> None:
    path = _run_file(tmp_path, "mcp-down", {"url": f"http://127.0.0.1:{_free_port()}/mcp"})
    first = run_cli("run", str(path), dsn=dsn, env={"AGENTFAST_MCP_CONNECT_SECONDS": "3"})
    assert first.returncode == 75 and "cannot be reached" in first.stdout, first.stdout
    assert _journal(dsn, "mcp-down") == {}  # nothing ran
    with Store(dsn) as s:  # registered all the same: `agentfast resume mcp-down` goes on once the server is up
        assert s.get_run("default/mcp-down") is not None


def test_a_stdio_server_that_fails_to_start_is_refused_before_the_run_is_registered(dsn: str, tmp_path: Path) -> None:
    """A program of the runner image that exits at start would at every resume: a spec problem."""
    path = _run_file(tmp_path, "mcp-broken", {"command": [sys.executable, "-c", "raise SystemExit(3)"]})
    refused = run_cli("run", str(path), dsn=dsn)
    assert refused.returncode == 2 and "spec.mcpServers[0].command" in refused.stdout and "did not start" in refused.stdout
    with Store(dsn) as s:
        assert s.get_run("default/mcp-broken") is None


def test_a_stdio_server_that_never_answers_is_given_up_on(dsn: str, tmp_path: Path) -> None:
    path = _run_file(tmp_path, "mcp-mute", {"command": [sys.executable, "-c", "import time; time.sleep(60)"]})
    proc = spawn_cli("run", str(path), dsn=dsn, env={"AGENTFAST_MCP_CONNECT_SECONDS": "1"})
    out, _ = proc.communicate(timeout=60)  # returns only once the server process is gone too (it held the pipe)
    assert proc.returncode == 75 and "cannot be reached" in out, out


#: The kill tests' batch: an idempotent note and a destructive (gated, not idempotent) send.
KILL_TURNS = [
    {
        "tool_calls": [
            {"id": "b", "name": "orders_add_note", "arguments": {"order_id": "A-1", "text": "refund agreed"}},
            {"id": "c", "name": "orders_send_message", "arguments": {"to": "ann", "body": "refunded"}},
        ]
    },
    {"content": "done"},
]


def _kill_run(tmp_path: Path, name: str) -> tuple[Path, Path]:
    db = tmp_path / "effects.sqlite3"
    return _run_file(tmp_path, name, {"command": STDIO, "env": {EFFECTS_ENV: str(db)}}, KILL_TURNS), db


def _keys(db: Path, tool: str) -> list[str]:
    return [key for t, key, _ in effects(db) if t == tool]


@pytest.mark.parametrize(
    "fault",
    [
        "tool.before_call:orders_add_note",
        "tool.after_call:orders_add_note",
        "tool.after_persist:orders_add_note",
        "checkpoint.before_commit@2",
    ],
)
def test_sigkill_around_an_idempotent_mcp_call_then_resume_keeps_each_effect_once(fault: str, dsn: str, tmp_path: Path) -> None:
    db = tmp_path / "effects.sqlite3"
    turns = [KILL_TURNS[0] | {"tool_calls": KILL_TURNS[0]["tool_calls"][:1]}, {"content": "done"}]
    path = _run_file(tmp_path, "mcp-kill", {"command": STDIO, "env": {EFFECTS_ENV: str(db)}}, turns)
    killed = run_cli("run", str(path), dsn=dsn, fault=fault)
    assert killed.returncode == -9, killed.stdout
    done = run_cli("resume", "mcp-kill", dsn=dsn)
    assert done.returncode == 0 and "Succeeded" in done.stdout, done.stdout
    (entry,) = _journal(dsn, "mcp-kill").values()
    assert _keys(db, "add_note") == [entry.idempotency_key]  # once, under the call's own key (G4)
    # re-run after tool.after_call: the server saw the key again and changed nothing
    said = "note already added to A-1" if fault == "tool.after_call:orders_add_note" else "note added to A-1"
    assert entry.result.content == said


def test_an_mcp_server_that_dies_mid_call_leaves_the_call_in_flight_and_the_resume_reruns_it_with_its_key(
    dsn: str, tmp_path: Path
) -> None:
    db, crash = tmp_path / "effects.sqlite3", tmp_path / "crashed"
    turns = [KILL_TURNS[0] | {"tool_calls": KILL_TURNS[0]["tool_calls"][:1]}, {"content": "done"}]
    env = {EFFECTS_ENV: str(db), CRASH_ENV: str(crash)}
    path = _run_file(tmp_path, "mcp-dies", {"command": STDIO, "env": env}, turns)
    first = run_cli("run", str(path), dsn=dsn)
    assert first.returncode == 75 and "no answer" in first.stdout, first.stdout  # retry me: the effect may have happened
    (entry,) = _journal(dsn, "mcp-dies").values()
    assert entry.state == "started" and entry.result is None  # no result was made up for it
    assert _keys(db, "add_note") == [entry.idempotency_key] == [crash.read_text()]
    done = run_cli("resume", "mcp-dies", dsn=dsn)
    assert done.returncode == 0 and "Succeeded" in done.stdout, done.stdout
    (entry,) = _journal(dsn, "mcp-dies").values()
    assert entry.attempts == 2 and entry.result.content == "note already added to A-1"  # same key: the server changed nothing
    assert _keys(db, "add_note") == [entry.idempotency_key]


def test_a_call_past_its_time_limit_is_left_in_flight_not_recorded(dsn: str, tmp_path: Path) -> None:
    turns = [{"tool_calls": [{"id": "s", "name": "orders_slow_lookup", "arguments": {"order_id": "A-1", "seconds": 2.5}}]}]
    path = _run_file(tmp_path, "mcp-slow", {"command": STDIO}, [*turns, {"content": "done"}])
    first = run_cli("run", str(path), dsn=dsn, env={"AGENTFAST_MCP_CALL_SECONDS": "1"})
    assert first.returncode == 75 and "no answer" in first.stdout, first.stdout
    (entry,) = _journal(dsn, "mcp-slow").values()
    assert entry.state == "started" and entry.result is None
    done = run_cli("resume", "mcp-slow", dsn=dsn)  # the default limit: read-only, so run again with its key
    assert done.returncode == 0 and "Succeeded" in done.stdout, done.stdout
    (entry,) = _journal(dsn, "mcp-slow").values()
    assert entry.attempts == 2 and entry.result.content == "A-1: delivered"


# (tool.after_persist: the result was kept, as for the idempotent note above: nothing to settle)
@pytest.mark.parametrize("fault", ["tool.before_call", "tool.after_call"])
def test_sigkill_around_a_non_idempotent_mcp_call_never_repeats_it_blindly(fault: str, dsn: str, tmp_path: Path) -> None:
    path, db = _kill_run(tmp_path, "mcp-send")
    assert run_cli("run", str(path), "--no-wait", dsn=dsn).returncode == 0
    assert run_cli("approve", "mcp-send", "call-1-1", dsn=dsn).returncode == 0
    killed = run_cli("resume", "mcp-send", dsn=dsn, fault=f"{fault}:orders_send_message")
    assert killed.returncode == -9, killed.stdout
    sent = [] if fault == "tool.before_call" else [_journal(dsn, "mcp-send")["call-1-1"].idempotency_key]
    assert _keys(db, "send_message") == sent
    again = run_cli("resume", "mcp-send", "--no-wait", dsn=dsn)
    # in flight and not idempotent: a human decides (G4), under a decision id of its own
    assert again.returncode == 0 and "call-1-1-rerun1" in again.stdout, again.stdout
    assert _keys(db, "send_message") == sent
    # denied: the model reads the reason, and the server never gets the call again
    assert run_cli("deny", "mcp-send", "call-1-1-rerun1", "--reason", "it went out", dsn=dsn).returncode == 0
    done = run_cli("resume", "mcp-send", dsn=dsn)
    assert done.returncode == 0 and "Succeeded" in done.stdout, done.stdout
    assert "it went out" in _journal(dsn, "mcp-send")["call-1-1"].result.content
    assert _keys(db, "send_message") == sent


def _agentrun(servers: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Any:
    from agentfast.runner.spec import AgentRun

    return AgentRun.model_validate(
        {
            "apiVersion": "agentfast.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": "unit"},
            "spec": {"model": {"name": "m", "script": "refund"}, "input": "go", "tools": tools or [], "mcpServers": servers},
        }
    )


def _stdio(**extra: Any) -> dict[str, Any]:
    return {"name": "orders", "command": STDIO, **extra}


def test_annotations_set_the_defaults_and_a_spec_may_add_or_lift_a_gate_never_declare_idempotent() -> None:
    from agentfast.runner.errors import SpecError
    from agentfast.runner.mcp import mcp_tools

    tools, conn = mcp_tools(_agentrun([_stdio()]), set())
    assert conn is not None
    conn.close()
    got = {t.name: (t.idempotent, t.requires_approval) for t in tools}
    assert got == {
        "orders_lookup_order": (True, False),  # readOnlyHint
        "orders_add_note": (True, False),  # idempotentHint, destructiveHint false
        "orders_send_message": (False, True),  # no hints: MCP's defaults, destructive and not idempotent
        "orders_always_fails": (True, False),
        "orders_slow_lookup": (True, False),
    }
    assert tools[0].schema["function"]["parameters"]["required"] == ["order_id"]
    overrides = {
        "send_message": {"requiresApproval": False},  # a hint's gate: the spec may lift it
        "lookup_order": {"requiresApproval": True, "idempotent": False},  # more careful: always
    }
    tools, conn = mcp_tools(_agentrun([_stdio(tools=overrides)]), set())
    assert conn is not None
    conn.close()
    got = {t.name: (t.idempotent, t.requires_approval) for t in tools}
    assert got["orders_send_message"] == (False, False) and got["orders_lookup_order"] == (False, True)
    refused = {
        "spec.mcpServers[0].tools.send_message.idempotent": _agentrun([_stdio(tools={"send_message": {"idempotent": True}})]),
        "spec.mcpServers[0].tools: MCP server 'orders' has no tool 'nope'": _agentrun([_stdio(tools={"nope": {}})]),
        "would be named 'orders_add_note', which another tool": _agentrun(
            [_stdio()], [{"name": "orders_add_note", "ref": "agentfast.testing.tools:echo"}]
        ),
    }
    for said, run in refused.items():
        with pytest.raises(SpecError, match=re.escape(said)):
            mcp_tools(run, {t.name for t in run.spec.tools})


def test_a_cluster_takes_urls_from_its_admin_and_commands_from_its_allow_list() -> None:
    from agentfast.runner.errors import SpecError
    from agentfast.runner.spec import check_cluster_policy

    run = _agentrun([_stdio(), {"name": "crm", "serverRef": "crm"}])
    check_cluster_policy(run, (), ["refund"], mcp_servers={"crm": "http://crm:8000/mcp"}, mcp_commands=(" ".join(STDIO[:3]),))
    bad = _agentrun([_stdio(), {"name": "crm", "serverRef": "crmx"}, {"name": "web", "url": "http://evil.example/mcp"}])
    with pytest.raises(SpecError) as err:
        check_cluster_policy(bad, (), ["refund"], mcp_servers={"crm": "http://crm:8000/mcp"}, mcp_commands=("python",))
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "spec.mcpServers[0].command",
        "spec.mcpServers[1].serverRef",
        "spec.mcpServers[2].url",
    ], lines


def test_a_runner_pod_learns_only_its_own_runs_mcp_servers() -> None:
    from agentfast.operator.workload import EgressPolicy, RunnerConfig, build_network_policy, build_pod

    body = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": "r", "namespace": "team-a", "uid": "u1"},
        "spec": {"mcpServers": [{"name": "crm", "serverRef": "crm"}]},
    }
    pod = build_pod(
        body,
        RunnerConfig(),
        mcp_servers={"crm": "http://crm:8000/mcp", "billing": "http://billing:8000/mcp"},
        mcp_commands=("python",),
    )
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert json.loads(env["AGENTFAST_MCP_SERVERS"]) == {"crm": "http://crm:8000/mcp"}
    assert env["AGENTFAST_MCP_ALLOWED_COMMANDS"] == "python"
    rule = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tools"}}}]}
    policy = EgressPolicy.from_env({"AGENTFAST_NETWORK_POLICY": json.dumps({"postgres": [{"to": []}], "mcp": [rule]})})
    assert policy is not None and build_network_policy(body, policy)["spec"]["egress"][-1] == rule


def test_the_runner_and_the_cli_never_import_the_mcp_sdk() -> None:
    code = "import sys, agentfast.runner.cli, agentfast.runner.loop, agentfast.runner.toolhost; print([m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'mcp_types'))])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_annotation_defaults_follow_mcps_own_defaults_and_results_render_as_the_model_reads_them() -> None:
    from mcp_types import CallToolResult, ImageContent, TextContent, ToolAnnotations

    from agentfast.runner.mcp import declarations, model_tool_name, render

    cases = [
        (None, (False, True)),
        (ToolAnnotations(), (False, True)),
        (ToolAnnotations(read_only_hint=True), (True, False)),
        (ToolAnnotations(read_only_hint=True, destructive_hint=True), (True, False)),  # destructive means nothing when read-only
        (ToolAnnotations(idempotent_hint=True), (True, True)),
        (ToolAnnotations(idempotent_hint=True, destructive_hint=False), (True, False)),
        (ToolAnnotations(destructive_hint=False), (False, False)),
    ]
    for given, expected in cases:
        assert declarations(given) == expected, given
    assert model_tool_name("crm", "contacts.search/v2") == "crm_contacts_search_v2"
    text = CallToolResult(content=[TextContent(type="text", text="a"), TextContent(type="text", text="b")])
    assert render(text) == "a\nb"
    image = CallToolResult(content=[ImageContent(type="image", data="AAAA", mime_type="image/png")])
    assert render(image) == "[image content, image/png]"
    structured = CallToolResult(content=[], structured_content={"total": 3})
    assert render(structured) == '{"total": 3}'
