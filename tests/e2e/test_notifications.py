"""Issue 18 item 4 on the real cluster: the operator notifies a webhook once per pending call.

A receiver pod (a few lines of ``http.server`` run by the project image's python; test code, in
the release namespace, behind a Service) prints one JSON line per POST. The operator Deployment
is pointed at it with ``kubectl set env`` (the chart renders ``AGENTFAST_NOTIFY_*``; the test puts
the empty URL back afterwards). A real refund run waits for approval: the receiver gets exactly
one POST for its call, with the idempotency key ``<uid>:call-2-0`` in the header and the body,
no arguments (not opted in), and an approve command naming the run, the call, the namespace and
the uid (POSTs about other runs left waiting in the namespace are told apart by the run's uid).
Every operator pod is then deleted while the run still waits: the new ones announce the
same call again at their resync, and the receiver still has one POST. The approve command from
the notification, run as the plugin, ends the run Succeeded with one refund.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .helpers import E2E_LABEL, Kube
from .test_operator import apply_refund, assert_succeeded_once, release, sql, status, wait_awaiting  # noqa: F401 (release is a fixture)

_RECEIVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        print("POST " + json.dumps({"headers": dict(self.headers.items()), "body": json.loads(raw)}), flush=True)
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
print("listening", flush=True)
HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def _operator_deployment(k: Kube) -> str:
    out = k.run("get", "deploy", "-l", "app.kubernetes.io/component=operator", "-o", "name").stdout.split()
    assert len(out) == 1, out
    return out[0]


def _set_operator_env(k: Kube, deploy: str, url: str) -> None:
    k.run("set", "env", deploy, f"AGENTFAST_NOTIFY_URL={url}", "AGENTFAST_NOTIFY_FORMAT=generic")
    k.run("rollout", "status", deploy, "--timeout=300s", timeout=320)


@pytest.fixture
def receiver(release: Kube) -> Iterator[tuple[Kube, str]]:
    """(the release's Kube, the receiver pod's name), the operator notifying it; undone afterwards."""
    k = release
    name = f"e2e-hook-{uuid.uuid4().hex[:6]}"
    labels = {E2E_LABEL: "true", "app": name}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": k.namespace, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "hook",
                    "image": k.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-u", "-c", _RECEIVER],
                    "ports": [{"containerPort": 8080}],
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": k.namespace, "labels": {E2E_LABEL: "true"}},
        "spec": {"selector": {"app": name}, "ports": [{"port": 8080, "targetPort": 8080}]},
    }
    k.apply(pod)
    k.apply(service)
    k.wait_for("the receiver to listen", lambda: "listening" in k.run("logs", name, check=False).stdout, timeout=120, interval=1)
    deploy = _operator_deployment(k)
    _set_operator_env(k, deploy, f"http://{name}.{k.namespace}.svc:8080/hook")
    try:
        yield k, name
    finally:
        _set_operator_env(k, deploy, "")  # the chart's default: off
        k.run("delete", "pod,service", name, "--wait=false", check=False)


def _operators(k: Kube) -> list[dict[str, Any]]:
    out = k.run("get", "pods", "-l", "app.kubernetes.io/component=operator", "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def _new_operator_acting(k: Kube, old: set[str]) -> bool:
    """Whether an operator pod not in ``old`` is ready and acts: holds the leader Lease (the
    chart's ``agentfast-operator``, made with more than one replica), or is the only one."""
    ready = {
        p["metadata"]["name"] for p in _operators(k) if all(c.get("ready") for c in p["status"].get("containerStatuses") or [{}])
    } - old
    found = k.run("get", "lease", "agentfast-operator", "-o", "json", check=False)
    if found.returncode != 0:  # one replica: no election
        return bool(ready)
    return (json.loads(found.stdout)["spec"].get("holderIdentity") or "") in ready


def posts(k: Kube, pod: str, uid: str) -> list[dict[str, Any]]:
    """Every POST the receiver got about the run of ``uid``, in order: ``{"headers", "body"}``
    (other tests may leave runs waiting in the namespace: the operator announces those too)."""
    lines = k.run("logs", pod).stdout.splitlines()
    got = [json.loads(line[5:]) for line in lines if line.startswith("POST ")]
    return [p for p in got if p["body"].get("run", {}).get("uid") == uid]


def test_one_notification_per_pending_call_survives_an_operator_restart_and_its_command_decides(
    receiver: tuple[Kube, str],
) -> None:
    k, pod = receiver
    name, uid = apply_refund(k)
    call = wait_awaiting(k, name)
    key = f"{uid}:{call}"
    k.wait_for("the notification", lambda: posts(k, pod, uid), timeout=60, interval=1)
    got = posts(k, pod, uid)
    assert len(got) == 1, got
    headers = {h.lower(): v for h, v in got[0]["headers"].items()}
    event = got[0]["body"]
    assert headers["idempotency-key"] == key and headers["content-type"] == "application/json"
    assert event["type"] == "agentfast.pending_call" and event["idempotencyKey"] == key
    assert event["run"] == {"namespace": k.namespace, "name": name, "uid": uid}
    assert (
        event["call"]["id"] == call and event["call"]["tool"] == "issue_refund" and event["call"]["reason"] == "requires_approval"
    )
    assert "arguments" not in event and "A-1042" not in json.dumps(event)  # not opted in
    approve = event["commands"]["approve"]
    assert approve == f"kubectl agentfast approve {name} {call} -n {k.namespace} --uid {uid}"

    run_id = f"{k.namespace}/{name}"
    assert sql(k, "SELECT state, attempts FROM agentfast_notifications WHERE run_id = %s", run_id) == [["delivered", 1]]

    # Every operator replica restarts while the run still waits: they re-announce, nobody re-sends.
    old = {p["metadata"]["name"] for p in _operators(k)}
    k.run("delete", "pods", "-l", "app.kubernetes.io/component=operator", "--wait=false")
    k.wait_for("a new operator acting", lambda: _new_operator_acting(k, old), timeout=300, interval=1)
    resync = int(
        k.run(
            "get",
            "deploy",
            "-l",
            "app.kubernetes.io/component=operator",
            "-o",
            "jsonpath={.items[0].spec.template.spec.containers[0].env[?(@.name=='AGENTFAST_RESYNC_SECONDS')].value}",
        ).stdout
        or "30"
    )
    time.sleep(2 * resync + 10)  # two resync passes: each publishes the waiting run's status
    assert status(k, name)["phase"] == "WaitingForApproval"
    assert len(posts(k, pod, uid)) == 1
    assert sql(k, "SELECT state, attempts FROM agentfast_notifications WHERE run_id = %s", run_id) == [["delivered", 1]]

    plugin = shutil.which("kubectl-agentfast")
    assert plugin, "kubectl-agentfast (the agentfast console script) is not on PATH"
    args = shlex.split(approve)[2:]  # the notification's command, as the plugin runs it
    env = {**os.environ, "KUBECONFIG": k.kubeconfig}
    proc = subprocess.run([plugin, *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_succeeded_once(k, name, uid, min_restarts=0)
    assert len(posts(k, pod, uid)) == 1  # a decided run is announced no more
