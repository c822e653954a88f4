"""The operator's rights as the API server grants them (issue 30 item 5), with ``operator.watchNamespaces``.

The chart's RBAC for the operator, rendered for a release of this test's own (its names unique,
so the installed release is untouched) watching one namespace, is applied with a ServiceAccount
of that name; then the API server's own authorizer is asked (``kubectl auth can-i --as``) what
that account may do: everything the Role grants in the watched namespace, nothing on Secrets,
pods, AgentRuns or Events in another namespace or cluster-wide, and cluster-wide only the reading
of the approval admission policy (no CRD or namespace listing: the operator turns kopf's
observation off when it watches named namespaces).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import yaml

from .helpers import REPO, Kube

pytestmark = pytest.mark.e2e


@pytest.fixture
def other_namespace(kube: Kube) -> Iterator[str]:
    ns = f"agentfast-e2e-other-{uuid.uuid4().hex[:8]}"
    kube.run("create", "namespace", ns, namespaced=False)
    try:
        yield ns
    finally:
        kube.run("delete", "namespace", ns, "--wait=false", namespaced=False, check=False)


def test_with_watch_namespaces_the_operator_account_may_act_in_those_only(kube: Kube, other_namespace: str) -> None:
    k = kube
    helm = os.environ.get("HELM") or shutil.which("helm")
    assert helm, "helm not found (PATH or HELM)"
    release = f"e2e-rbac-{uuid.uuid4().hex[:6]}"
    rendered = subprocess.run(
        [
            helm,
            "template",
            release,
            str(REPO / "charts" / "agentfast"),
            "--namespace",
            k.namespace,
            "--set",
            f"operator.watchNamespaces={{{k.namespace}}}",
            "--set",
            "networkPolicy.enabled=true",
            "--show-only",
            "templates/rbac.yaml",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # The operator's objects only (the aggregated edit/view/approver roles are the installed release's business).
    mine = [
        d
        for d in yaml.safe_load_all(rendered)
        if d and d["metadata"]["name"].startswith(release) and "-operator" in d["metadata"]["name"]
    ]
    assert {d["kind"] for d in mine} == {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    operator = next(d for d in mine if d["kind"] == "ClusterRoleBinding")["subjects"][0]["name"]  # RELEASE-agentfast-operator
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": operator, "namespace": k.namespace}}
    k.run("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [account, *mine]}), namespaced=False)
    try:
        who = f"--as=system:serviceaccount:{k.namespace}:{operator}"

        def can(verb: str, resource: str, *where: str, sub: str = "") -> bool:
            """``resource``: as kubectl names it (``pods``, ``agentruns.agentfast.dev``, ``secrets/NAME``)."""
            args = [verb, resource, *(["--subresource", sub] if sub else []), who, *where]
            return k.run("auth", "can-i", *args, namespaced=False, check=False).stdout.strip() == "yes"

        here = ("-n", k.namespace)
        role = next(d for d in mine if d["kind"] == "Role" and d["metadata"]["name"] == operator)
        granted = [  # (verb, TYPE[/NAME], subresource)
            (verb, r.partition("/")[0] + (f".{g}" if g else "") + (f"/{n}" if n else ""), r.partition("/")[2])
            for rule in role["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for verb in rule["verbs"]
            for n in rule.get("resourceNames") or [""]
        ]
        assert ("patch", "agentruns.agentfast.dev", "status") in granted
        assert ("delete", "networkpolicies.networking.k8s.io", "") in granted
        assert ("get", "secrets/agentfast-runner", "") in granted
        k.wait_for("the Role to take effect", lambda: can("create", "pods", *here), timeout=30, interval=1)
        refused_here = [(v, r, sub) for v, r, sub in granted if not can(v, r, *here, sub=sub)]
        assert not refused_here, refused_here
        # Its own Secret by name; no other Secret (a ModelConfig's key, the tools'), no verb it never uses.
        assert can("get", "secrets/agentfast-runner", *here) and can("delete", "secrets/agentfast-runner", *here)
        assert not can("get", "secrets/model-key", *here) and not can("get", "secrets", *here)
        assert not can("list", "secrets", *here) and not can("patch", "pods", *here)
        elsewhere = ("-n", other_namespace)
        for verb, resource in [
            ("get", "secrets/agentfast-runner"),
            ("create", "secrets"),
            ("update", "secrets/agentfast-runner"),
            ("delete", "secrets/agentfast-runner"),
            ("create", "pods"),
            ("delete", "pods"),
            ("list", "pods"),
            ("list", "agentruns.agentfast.dev"),
            ("patch", "agentruns.agentfast.dev"),
            ("get", "modelconfigs.agentfast.dev"),
            ("create", "events"),
        ]:
            assert not can(verb, resource, *elsewhere), f"{verb} {resource} in {other_namespace}"
            assert not can(verb, resource, "--all-namespaces"), f"{verb} {resource} cluster-wide"
        assert can("get", "validatingadmissionpolicies.admissionregistration.k8s.io")
        assert can("list", "validatingadmissionpolicybindings.admissionregistration.k8s.io")
        assert not can("list", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can("list", "namespaces")
    finally:
        for d in mine:
            if d["kind"].startswith("Cluster"):
                k.run("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found", namespaced=False, check=False)
