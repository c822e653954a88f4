"""End to end on a real cluster: spec.cancel and spec.activeDeadlineSeconds (issue 14 item 3).

The chart is installed as for tests/e2e/test_operator.py. A run waiting for approval is cancelled
with ``kubectl patch`` (and with the kubectl plugin): its runner wakes at once, the run ends
Cancelled with one Event, the gated refund never runs, the work done is kept, and no runner pod is
created for it again. A run past its deadline while waiting ends Failed/DeadlineExceeded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any

from .helpers import Kube
from .test_operator import apply_refund, release, runner_pods, sql, status, wait_awaiting  # noqa: F401 (fixture)


def events(k: Kube, name: str, reason: str) -> list[dict[str, Any]]:
    out = k.run("get", "events", "--field-selector", f"involvedObject.name={name},reason={reason}", "-o", "json").stdout
    return json.loads(out)["items"]


def running_pods(k: Kube, name: str) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in runner_pods(k, name)
        if p["status"].get("phase") in ("Pending", "Running") and not p["metadata"].get("deletionTimestamp")
    ]


def assert_cancelled(k: Kube, name: str, uid: str, *, by: str) -> dict[str, Any]:
    st = status(k, name)
    assert st["phase"] == "Cancelled", st
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Cancelled"]["status"] == "True" and conds["Cancelled"]["reason"] == "Cancelled", conds
    assert conds["Progressing"]["status"] == "False" and st["awaiting"] == "" and st["pendingApprovals"] == []
    assert "cancelled by kubernetes (spec.cancel" in st["message"] and by in st["message"], st["message"]
    run_id = f"{k.namespace}/{name}"
    [[requested_by]] = sql(k, "SELECT requested_by FROM agentfast_cancel_requests WHERE run_id = %s", run_id)
    assert requested_by.startswith("kubernetes (spec.cancel")
    # The gated refund never ran; the work done before the pause is kept.
    assert sql(k, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key LIKE %s", f"{uid}:%") == [[0]]
    notes = sql(
        k,
        "SELECT count(*) FROM agentfast_examples.demo_tool_invocations WHERE tool = 'add_case_note' AND idempotency_key LIKE %s",
        f"{uid}:%",
    )
    assert notes == [[1]]
    assert sql(k, "SELECT state FROM agentfast_tool_calls WHERE run_id = %s AND call_id = 'call-2-0'", run_id) == [["planned"]]
    # No runner for it any more, and none is created again (a resync or two later).
    k.wait_for("the runner pod to end", lambda: not running_pods(k, name), timeout=60)
    time.sleep(35)
    assert not running_pods(k, name) and status(k, name)["phase"] == "Cancelled"
    # One Event Cancelled, naming who asked.
    cancelled = events(k, name, "Cancelled")
    assert len(cancelled) == 1 and "cancelled by kubernetes (spec.cancel" in cancelled[0]["message"], cancelled
    return st


def test_cancel_with_kubectl_patch_while_waiting_for_approval(release: Kube) -> None:
    k = release
    name, uid = apply_refund(k)
    wait_awaiting(k, name)
    k.wait_for("a running runner pod", lambda: running_pods(k, name))
    k.run("patch", "agentrun", name, "--type", "merge", "-p", '{"spec":{"cancel":true}}')
    t0 = time.monotonic()
    k.wait_for(f"{name} to be Cancelled", lambda: status(k, name).get("phase") == "Cancelled", timeout=30, interval=0.2)
    took = time.monotonic() - t0
    assert took < 5, f"status showed Cancelled {took:.1f}s after the patch"
    assert_cancelled(k, name, uid, by="field manager kubectl-patch")
    # A cancel cannot be taken back, and the run cannot be approved any more.
    back = k.run("patch", "agentrun", name, "--type", "merge", "-p", '{"spec":{"cancel":false}}', check=False)
    assert back.returncode != 0 and "spec.cancel cannot be taken back" in back.stderr


def test_cancel_with_the_kubectl_plugin(release: Kube) -> None:
    k = release
    name, uid = apply_refund(k, "refund-langgraph.yaml")
    wait_awaiting(k, name)
    plugin = shutil.which("kubectl-agentfast")
    assert plugin, "kubectl-agentfast (the agentfast console script) is not on PATH"
    env = {**os.environ, "KUBECONFIG": k.kubeconfig}
    done = subprocess.run([plugin, "cancel", name, "-n", k.namespace], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "spec.cancel true" in done.stdout, done.stdout + done.stderr
    assert k.get("agentrun", name)["spec"]["cancel"] is True
    k.wait_for(f"{name} to be Cancelled", lambda: status(k, name).get("phase") == "Cancelled", timeout=30, interval=0.2)
    assert_cancelled(k, name, uid, by="field manager kubectl-agentfast")
    again = subprocess.run([plugin, "cancel", name, "-n", k.namespace], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already requested" in again.stdout, again.stdout + again.stderr


def test_an_agentrun_created_cancelled_never_gets_a_runner(release: Kube) -> None:
    k = release
    name, _ = apply_refund(k, cancel=True)
    k.wait_for(f"{name} to be Cancelled", lambda: status(k, name).get("phase") == "Cancelled", timeout=60)
    time.sleep(5)
    assert runner_pods(k, name) == []
    assert sql(k, "SELECT count(*) FROM agentfast_turns WHERE run_id = %s", f"{k.namespace}/{name}") == [[0]]  # no model call


def test_a_deadline_ends_a_run_waiting_for_approval(release: Kube) -> None:
    k = release
    name, uid = apply_refund(k, activeDeadlineSeconds=45)
    wait_awaiting(k, name)
    k.wait_for(f"{name} to fail on its deadline", lambda: status(k, name).get("phase") == "Failed", timeout=90, interval=1)
    st = status(k, name)
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Failed"]["reason"] == "DeadlineExceeded" and "spec.activeDeadlineSeconds" in st["message"], st
    assert sql(k, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key LIKE %s", f"{uid}:%") == [[0]]
    # A decision the run can no longer use is refused with why, never "recorded" (issue 31 item 5).
    plugin = shutil.which("kubectl-agentfast")
    assert plugin, "kubectl-agentfast (the agentfast console script) is not on PATH"
    env = {**os.environ, "KUBECONFIG": k.kubeconfig}
    late = subprocess.run(
        [plugin, "approve", name, "call-2-0", "-n", k.namespace], env=env, capture_output=True, text=True, timeout=60
    )
    said = late.stdout + late.stderr
    assert late.returncode == 2 and "cannot be decided" in said and "DeadlineExceeded" in said, said
    assert "approvals" not in (k.get("agentrun", name).get("spec") or {})  # nothing was patched
    k.wait_for("the runner pod to end", lambda: not running_pods(k, name), timeout=60)
    changed = k.run("patch", "agentrun", name, "--type", "merge", "-p", '{"spec":{"activeDeadlineSeconds":3600}}', check=False)
    assert changed.returncode != 0 and "spec is immutable after creation" in changed.stderr
