"""MCP tools (issue 17 item 2, docs/mcp.md) on a real cluster.

The chart is installed (hack/lib.sh, ``e2e_helm_install``) with the admin's MCP server
``test-mcp`` at ``http://agentfast-test-mcp.<release namespace>.svc:8000/mcp`` and ``python`` as
an allowed stdio command. These tests run the test MCP server (``agentfast.testing.mcp_server``,
in the testing image) both ways, on the bundled script ``mcp_orders`` (a read-only lookup, an
idempotent note, and an unannotated send, gated by MCP's defaults, in one batch):

- over streamable HTTP, as a Deployment and Service named by ``serverRef``: the run pauses for
  the send after its siblings ran, loses its runner pod while it waits, is approved and succeeds
  in a new pod; the server recorded the note and the send once each, under the journal's keys;
- over stdio, a command in the runner pod: the run pauses, is approved and succeeds, each call
  done on its first attempt, the note answered as a first-time effect;
- a ``url``, an unknown ``serverRef`` and a command not allowed end the run ``InvalidSpec``
  before any runner pod exists (G12).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .helpers import E2E_LABEL, Kube, apply_http_server
from .test_operator import approve, release, runner_pods, running_runner, sql, status  # noqa: F401 (release is a fixture)

SERVER = "agentfast-test-mcp"  # the chart's mcp.servers.test-mcp points here (hack/lib.sh)
PORT = 8000
STDIO = ["python", "-m", "agentfast.testing.mcp_server", "--stdio"]
#: The mcp_orders script's journal at the end: (call id, tool, state, attempts), each call made once.
JOURNAL = [
    ["call-1-0", "orders_lookup_order", "done", 1],
    ["call-1-1", "orders_add_note", "done", 1],
    ["call-1-2", "orders_send_message", "done", 1],
]


@pytest.fixture
def mcp_server(release: Kube) -> Iterator[Kube]:
    """The test MCP server over streamable HTTP, a Deployment and a Service in the release
    namespace; its effects in /tmp/effects.sqlite3 of its pod."""
    k = release
    labels = {"app.kubernetes.io/name": SERVER, E2E_LABEL: "true"}
    apply_http_server(
        k,
        SERVER,
        labels=labels,
        pod_labels=labels,
        container="mcp",
        command=["python", "-m", "agentfast.testing.mcp_server", "--http", "--host", "0.0.0.0", "--port", str(PORT)],
        env=[{"name": "MCP_TEST_EFFECTS", "value": "/tmp/effects.sqlite3"}],
        port=PORT,
    )
    try:
        k.run("rollout", "status", f"deploy/{SERVER}", "--timeout=180s", timeout=200)
        yield k
    finally:
        for kind in ("service", "deployment"):
            k.run("delete", kind, SERVER, "--wait=true", check=False, timeout=180)


def _effects(k: Kube) -> list[list[Any]]:
    """``[tool, key, arguments]`` of every effect the HTTP server recorded."""
    code = "import json; from agentfast.testing.mcp_server import effects; print(json.dumps(effects('/tmp/effects.sqlite3')))"
    return json.loads(k.run("exec", f"deploy/{SERVER}", "--", "python", "-c", code).stdout)


def _run(k: Kube, name: str, server: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "namespace": k.namespace, "labels": {E2E_LABEL: "true"}},
        "spec": {
            "model": {"name": "scripted-mcp", "script": "mcp_orders"},
            "input": "Note on order A-1 that the refund is agreed, and tell the customer.",
            "mcpServers": [{"name": "orders", **server}],
            "suspendAfter": 0,  # the pod waits with the run, so a test can delete it
        },
    }


def _journal(k: Kube, name: str) -> list[list[Any]]:
    return sql(
        k,
        "SELECT call_id, tool_name, state, attempts, idempotency_key, result->>'content' FROM agentfast_tool_calls"
        " WHERE run_id = %s ORDER BY call_id",
        f"{k.namespace}/{name}",
    )


def _wait_for_approval(k: Kube, name: str) -> None:
    k.wait_for(
        f"{name} to wait for approval",
        lambda: status(k, name).get("phase") in ("WaitingForApproval", "Failed", "Succeeded"),
        timeout=240,
    )
    st = status(k, name)
    assert st["phase"] == "WaitingForApproval" and st["awaiting"] == "call-1-2", st


def _wait_for_success(k: Kube, name: str) -> None:
    k.wait_for(f"{name} to end", lambda: status(k, name).get("phase") in ("Succeeded", "Failed"), timeout=240)
    st = status(k, name)
    assert st["phase"] == "Succeeded", st


def test_an_http_mcp_server_the_admin_named_survives_a_lost_runner_pod_each_effect_once(mcp_server: Kube) -> None:
    k = mcp_server
    name = f"mcp-http-{uuid.uuid4().hex[:6]}"
    k.apply(_run(k, name, {"serverRef": "test-mcp"}))
    _wait_for_approval(k, name)
    first = running_runner(k, name)
    assert first is not None
    k.run("delete", "pod", first, "--wait=true", timeout=120)
    approve(k, name, "call-1-2")
    _wait_for_success(k, name)
    # The deleted pod is gone (--wait=true); a later attempt took the run over and finished it.
    pods = runner_pods(k, name)
    assert first not in [p["metadata"]["name"] for p in pods]
    assert max(int(p["metadata"]["annotations"]["agentfast.dev/attempt"]) for p in pods) >= 2, pods
    assert status(k, name)["restarts"] >= 1
    journal = _journal(k, name)
    assert [row[:4] for row in journal] == JOURNAL, journal
    keys = {row[1]: row[4] for row in journal}
    uid = k.get("agentrun", name)["metadata"]["uid"]  # keys are RUN_UID:ITERATION:POSITION
    ours = [(tool, key) for tool, key, _ in _effects(k) if key.startswith(f"{uid}:")]
    assert sorted(ours) == sorted([("add_note", keys["orders_add_note"]), ("send_message", keys["orders_send_message"])]), ours


def test_a_stdio_mcp_server_runs_in_the_runner_pod(release: Kube) -> None:
    k = release
    name = f"mcp-stdio-{uuid.uuid4().hex[:6]}"
    k.apply(_run(k, name, {"command": STDIO, "env": {"MCP_TEST_EFFECTS": "/tmp/mcp-effects.sqlite3"}}))
    _wait_for_approval(k, name)
    approve(k, name, "call-1-2")
    _wait_for_success(k, name)
    journal = _journal(k, name)
    assert [row[:4] for row in journal] == JOURNAL, journal
    assert journal[1][5] == "note added to A-1" and journal[2][5] == "sent to ann"


@pytest.mark.parametrize(
    ("server", "said"),
    [
        ({"url": "http://example.com/mcp"}, "spec.mcpServers[0].url"),
        ({"serverRef": "nope"}, "spec.mcpServers[0].serverRef"),
        ({"command": ["/bin/sh", "-c", "true"]}, "spec.mcpServers[0].command"),
    ],
)
def test_the_operator_refuses_an_mcp_server_the_admin_did_not_allow(release: Kube, server: dict[str, Any], said: str) -> None:
    k = release
    name = f"mcp-refused-{list(server)[0].lower()}-{uuid.uuid4().hex[:6]}"
    k.apply(_run(k, name, server))
    k.wait_for(f"{name} to fail", lambda: status(k, name).get("phase") == "Failed", timeout=120)
    st = status(k, name)
    assert any(c.get("type") == "Failed" and c.get("reason") == "InvalidSpec" for c in st.get("conditions", [])), st
    assert said in st["message"], st
    assert runner_pods(k, name) == []
