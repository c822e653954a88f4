"""Issue 12 (items 2, 3, 5) on a real cluster with the chart installed: the attacks, refused.

- ``requiresApproval: false`` on the gated refund tool: the runner pod ends the run
  Failed/InvalidSpec; no refund row, no approval ever asked.
- A ref outside ``runner.allowedModules``: the operator refuses it (Failed/InvalidSpec) without
  importing it, and creates no runner Job.
- A 253-character AgentRun name: its runner Job is created (label cut with a hash, full name in
  an annotation) and the run reaches WaitingForApproval.
- Junk approval keys never reach the operator: the CRD refuses them at creation, and the admission
  policy admits a decision only for a call status lists as pending (test_approval_policy.py).
"""

from __future__ import annotations

import json
import time
import uuid

import yaml

from .conftest import REPO, Kube
from .test_operator import E2E_LABEL, release, runner_pods, sql, status  # noqa: F401 (release is a fixture)


def _doc(k: Kube, name: str) -> dict:
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": k.namespace, "labels": {E2E_LABEL: "true"}}
    return doc


def test_a_gated_tool_cannot_be_opted_out(release: Kube) -> None:
    k = release
    name = f"opt-out-{uuid.uuid4().hex[:6]}"
    doc = _doc(k, name)
    doc["spec"]["tools"][1]["requiresApproval"] = False
    k.apply(doc)
    k.wait_for("Failed", lambda: status(k, name).get("phase") == "Failed", timeout=180)
    st = status(k, name)
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Failed"]["reason"] == "InvalidSpec" and "requiresApproval" in st["message"], st
    assert sql(k, "SELECT count(*) FROM agentfast_tool_calls WHERE run_id = %s", f"{k.namespace}/{name}") == [[0]]


def test_a_module_outside_the_allow_list_is_refused_by_the_operator_without_a_runner(release: Kube) -> None:
    k = release
    name = f"not-allowed-{uuid.uuid4().hex[:6]}"
    doc = _doc(k, name)
    doc["spec"]["tools"][0]["ref"] = "evil_sysexit:lookup_order"
    k.apply(doc)
    k.wait_for("Failed", lambda: status(k, name).get("phase") == "Failed", timeout=60)
    st = status(k, name)
    assert "not in the modules this cluster allows" in st["message"], st
    assert {c["type"]: c for c in st["conditions"]}["Failed"]["reason"] == "InvalidSpec"
    time.sleep(3)
    assert runner_pods(k, name) == []
    op = k.run("get", "deploy", "-l", "app.kubernetes.io/component=operator", "-o", "json").stdout
    assert all(d["status"].get("availableReplicas") == 1 for d in json.loads(op)["items"])


def test_a_253_character_name_gets_a_runner(release: Kube) -> None:
    k = release
    name = f"long-{uuid.uuid4().hex[:6]}-" + "x" * 241
    assert len(name) == 253
    k.apply(_doc(k, name))
    k.wait_for("WaitingForApproval", lambda: status(k, name).get("phase") == "WaitingForApproval", timeout=240)
    jobs = json.loads(k.run("get", "jobs", "-l", f"{E2E_LABEL}!=x", "-o", "json").stdout)["items"]
    mine = [j for j in jobs if j["metadata"].get("annotations", {}).get("agentfast.dev/run-name") == name]
    assert len(mine) == 1 and len(mine[0]["metadata"]["labels"]["agentfast.dev/run"]) <= 63
