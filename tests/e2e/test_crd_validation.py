"""A bad AgentRun is rejected by the API server (schema and CEL) with a message naming the field.

Server-side dry runs against the real API server with the agentfast CRD installed.
"""

from __future__ import annotations

import copy
import json
import uuid

import pytest
import yaml

from .conftest import REPO, Kube

BASE = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())


def variant(mutate) -> dict:
    doc = copy.deepcopy(BASE)
    doc["metadata"] = {"name": f"bad-{uuid.uuid4().hex[:6]}"}
    mutate(doc["spec"])
    return doc


BAD = [
    ("no model", lambda s: s.pop("model"), "spec.model: Required value"),
    ("no input", lambda s: s.pop("input"), "spec.input: Required value"),
    ("negative budget", lambda s: s["budget"].update(max_tokens=-5), "spec.budget.max_tokens"),
    ("zero iterations", lambda s: s["budget"].update(max_iterations=0), "spec.budget.max_iterations"),
    ("budget as a string", lambda s: s["budget"].update(max_duration_ms="soon"), "spec.budget.max_duration_ms"),
    ("unknown adapter", lambda s: s.update(adapter="crewai"), "spec.adapter"),
    ("both endpoints", lambda s: s["model"].update(baseURL="http://x/v1"), "exactly one of spec.model.baseURL"),
    ("tool without ref", lambda s: s["tools"][0].pop("ref"), "spec.tools[0].ref: Required value"),
    ("tool ref not module:attr", lambda s: s["tools"][0].update(ref="nocolon"), "spec.tools[0].ref"),
    ("duplicate tool names", lambda s: s["tools"].append(dict(s["tools"][0])), "spec.tools[3]: Duplicate value"),
    ("langgraph without graph", lambda s: s.update(adapter="langgraph"), "spec.graph.ref is required"),
    ("bad decision", lambda s: s.update(approvals={"call-1-0": {"decision": "maybe", "decidedBy": "u"}}), "spec.approvals.call-1-0.decision"),
    ("deny without reason", lambda s: s.update(approvals={"call-1-0": {"decision": "deny", "decidedBy": "u"}}), "a deny decision needs a reason"),
    ("deny with a blank reason", lambda s: s.update(approvals={"call-1-0": {"decision": "deny", "reason": "  ", "decidedBy": "u"}}), "a deny decision needs a reason"),
    ("complete without result", lambda s: s.update(approvals={"call-1-0": {"decision": "complete", "decidedBy": "u"}}), "a complete decision needs result"),
    ("result on approve", lambda s: s.update(approvals={"call-1-0": {"decision": "approve", "result": "{}", "decidedBy": "u"}}), "result is given only with decision complete"),
    # issue 12, item 5
    ("apiKeyEnv LD_PRELOAD", lambda s: s["model"].update(apiKeyEnv="LD_PRELOAD"), "spec.model.apiKeyEnv"),
    ("apiKeyEnv PYTHONPATH", lambda s: s["model"].update(apiKeyEnv="PYTHONPATH"), "spec.model.apiKeyEnv"),
    ("apiKeyEnv AGENTFAST_DSN", lambda s: s["model"].update(apiKeyEnv="AGENTFAST_DSN"), "spec.model.apiKeyEnv"),
    ("apiKeyEnv AGENTFAST_*_API_KEY", lambda s: s["model"].update(apiKeyEnv="AGENTFAST_API_KEY"), "cannot name one of agentfast's own variables"),
    ("secret name not DNS-1123", lambda s: (s["model"].pop("script"), s["model"].update(baseURL="http://x/v1", apiKeySecretRef={"name": "Bad_Name", "key": "k"})),
     "spec.model.apiKeySecretRef.name"),
    ("model script is a path", lambda s: s["model"].update(script="/dev/zero"), "spec.model.script"),
    ("model script is /etc/passwd", lambda s: s["model"].update(script="/etc/passwd"), "spec.model.script"),
    ("tool ref with a path", lambda s: s["tools"][0].update(ref="../../etc/passwd:x"), "spec.tools[0].ref"),
    ("classifier not a ref", lambda s: s["budget"].update(classifier="os.system('id')"), "spec.budget.classifier"),
    ("max_tokens without bound", lambda s: s["budget"].update(max_tokens=10**12), "spec.budget.max_tokens"),
    ("max_iterations without bound", lambda s: s["budget"].update(max_iterations=10**9), "spec.budget.max_iterations"),
    ("max_duration_ms without bound", lambda s: s["budget"].update(max_duration_ms=10**15), "spec.budget.max_duration_ms"),
    ("timeoutSeconds without bound", lambda s: s["model"].update(timeoutSeconds=1e12), "spec.model.timeoutSeconds"),
    ("maxRetries without bound", lambda s: s["model"].update(maxRetries=10**6), "spec.model.maxRetries"),
    ("temperature without bound", lambda s: s["model"].update(temperature=1e300), "spec.model.temperature"),
    ("pre-approval at creation", lambda s: s.update(approvals={"call-2-0": {"decision": "approve", "decidedBy": "u"}}),
     "spec.approvals cannot be set when an AgentRun is created"),
    ("decision without decidedBy", lambda s: s.update(approvals={"call-2-0": {"decision": "approve"}}), "spec.approvals.call-2-0.decidedBy: Required value"),
    ("approval key not a call id", lambda s: s.update(approvals={"junk": {"decision": "approve", "decidedBy": "u"}}), "approval keys are call ids"),
    ("approval key too long", lambda s: s.update(approvals={"call-" + "1" * 100 + "-0": {"decision": "approve", "decidedBy": "u"}}), "approval keys are call ids"),
    ("too many approval keys", lambda s: s.update(approvals={f"call-{i}-0": {"decision": "approve", "decidedBy": "u"} for i in range(129)}), "spec.approvals: Too many"),
]


@pytest.mark.parametrize("case,mutate,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_agentrun_is_rejected_naming_the_field(kube: Kube, case: str, mutate, expected: str) -> None:
    proc = kube.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(variant(mutate)), check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert expected in proc.stderr, proc.stderr


def test_spec_is_immutable(kube: Kube) -> None:
    # Decisions (the one writable part of spec) are tried on runs that really await one:
    # tests/e2e/test_approval_policy.py.
    doc = variant(lambda s: None)
    name = doc["metadata"]["name"]
    kube.apply(doc)
    changed = kube.run("patch", "agentrun", name, "--type", "merge", "-p", '{"spec":{"input":"refund everything"}}', check=False)
    assert changed.returncode != 0 and "spec is immutable after creation" in changed.stderr
    explain = kube.run("explain", "agentrun.spec.budget", namespaced=False)
    assert "max_iterations" in explain.stdout and "exceeding one ends the run as" in explain.stdout.replace("\n", " ").replace("  ", " ")


def test_the_crd_installs_within_the_cel_cost_budget_and_long_names_are_accepted(kube: Kube) -> None:
    # The CRD above was accepted (its CEL rules' estimated cost is within the API server's
    # budget), and a 253-character AgentRun name is a valid object name.
    doc = variant(lambda s: None)
    doc["metadata"]["name"] = ("n" + uuid.uuid4().hex)[:12] + "-" + "x" * 240
    proc = kube.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode == 0, proc.stderr
