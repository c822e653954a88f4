"""Issue 12 item 1 on a real API server: deciding a call is its own right, and attributed (G10).

The chart's ValidatingAdmissionPolicy ``<release>-approvals`` and the CRD's CEL rules, against
real identities: ServiceAccount tokens, each in a kubeconfig of its own, so the API server
authenticates and authorizes every request as that person (nothing is impersonated).

- An editor (the built-in ``edit`` role, which aggregates ``agentfast-edit``) creates a run but
  cannot decide its call; an approver (``agentfast-approver``) can, only for a call status lists
  as pending, only as themself, only once; removing the whole map is refused too.
- The approver decides through ``kubectl agentfast approve`` (the CLI's path is the same patch);
  who decided reaches spec, the store, ``status.decisions`` and an Event.
- With ``approval.forbidSelfApproval``, the creator cannot decide their own run's call.
- A decision is bound to the AgentRun (uid) the approver reviewed, and without an enforcing
  policy binding the operator records no decision, then or later.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .helpers import REPO, Kube
from .test_operator import assert_succeeded_once, refund_manifest, release, sql, status, wait_awaiting  # noqa: F401 (release is a fixture)

APPROVER_ROLE = "agentfast-approver"


@dataclass
class Person:
    user: str  # the user name the API server knows them by
    kube: Kube  # kubectl with their own credential


@pytest.fixture
def people(release: Kube, tmp_path: Path) -> Iterator:
    """``people(who, *cluster_roles)``: a ServiceAccount bound (RoleBinding) to those roles in the
    release namespace, with a token kubeconfig. Removed afterwards."""
    k = release
    made: list[str] = []
    server = json.loads(k.run("config", "view", "--raw", "--flatten", "--minify", "-o", "json", namespaced=False).stdout)[
        "clusters"
    ][0]

    def make(who: str, *roles: str) -> Person:
        sa = f"e2e-{who}-{uuid.uuid4().hex[:6]}"
        k.run("create", "serviceaccount", sa)
        made.append(sa)
        user = f"system:serviceaccount:{k.namespace}:{sa}"
        for role in roles:
            k.run("create", "rolebinding", sa + "-" + role, f"--clusterrole={role}", f"--serviceaccount={k.namespace}:{sa}")
            made.append(f"rolebinding/{sa}-{role}")
        token = k.run("create", "token", sa, "--duration=1h").stdout.strip()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [server],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [{"name": sa, "context": {"cluster": server["name"], "user": sa, "namespace": k.namespace}}],
            "current-context": sa,
        }
        path = tmp_path / f"{sa}.kubeconfig"
        path.write_text(json.dumps(config))
        person = Person(user, Kube(k.kubectl, str(path), k.namespace))
        assert person.kube.whoami() == user
        if "edit" in roles:  # the aggregation controller fills the built-in edit role in from ours
            k.wait_for(
                "edit to carry agentruns",
                lambda: k.run("auth", "can-i", "create", "agentruns", f"--as={user}", check=False).stdout.strip() == "yes",
                timeout=30,
            )
        return person

    yield make
    for obj in reversed(made):
        k.run("delete", obj if "/" in obj else f"serviceaccount/{obj}", "--wait=false", check=False)


def decide(
    p: Person, name: str, call_id: str, decided_by: str, decision: str = "approve", **extra: str
) -> subprocess.CompletedProcess[str]:
    patch = {"spec": {"approvals": {call_id: {"decision": decision, "decidedBy": decided_by, **extra}}}}
    return p.kube.run("patch", "agentrun", name, "--type", "merge", "-p", json.dumps(patch), check=False)


def refused(proc: subprocess.CompletedProcess[str], phrase: str) -> None:
    assert proc.returncode != 0, f"accepted: {proc.stdout}"
    assert phrase in proc.stderr, proc.stderr


def test_deciding_takes_the_approval_right_and_is_attributed_to_the_requesting_user(release: Kube, people) -> None:
    k = release
    editor = people("editor", "edit")
    approver = people("approver", APPROVER_ROLE)
    doc = refund_manifest(k, f"decide-{uuid.uuid4().hex[:6]}")
    name = doc["metadata"]["name"]
    refused(
        editor.kube.run(
            "apply",
            "-f",
            "-",
            input=json.dumps(
                {**doc, "spec": {**doc["spec"], "approvals": {"call-2-0": {"decision": "approve", "decidedBy": editor.user}}}}
            ),
            check=False,
        ),
        "spec.approvals cannot be set when an AgentRun is created",  # pre-approval of a predictable id
    )
    editor.kube.apply(doc)
    uid = k.get("agentrun", name)["metadata"]["uid"]
    call = wait_awaiting(k, name)
    shown = k.get("agentrun", name)["status"]["pendingApprovals"][0]["argumentsDigest"]  # the plugin binds to it (G13)

    refused(decide(editor, name, call, editor.user), f"user {editor.user} may not decide calls of agentrun {name}")
    refused(decide(approver, name, call, editor.user), f"decidedBy must be your own user name, {approver.user}")
    refused(
        decide(approver, name, "call-900-0", approver.user),
        "call-900-0 does not await a decision now; status.pendingApprovals lists: call-2-0",
    )
    assert not k.get("agentrun", name)["spec"].get("approvals")
    assert sql(k, "SELECT count(*) FROM agentfast_approvals WHERE run_id = %s", f"{k.namespace}/{name}") == [[0]]

    plugin = shutil.which("kubectl-agentfast")
    assert plugin, "kubectl-agentfast (the agentfast console script) is not on PATH"
    env = {**os.environ, "KUBECONFIG": approver.kube.kubeconfig}
    proc = subprocess.run([plugin, "approve", name, call, "-n", k.namespace], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"by {approver.user}" in proc.stdout, proc.stdout + proc.stderr
    decided = {"decision": "approve", "decidedBy": approver.user, "argumentsDigest": shown}
    assert k.get("agentrun", name)["spec"]["approvals"] == {call: decided}

    refused(decide(approver, name, call, approver.user, "deny", reason="changed my mind"), "write-once")
    removed = k.run("patch", "agentrun", name, "--type", "json", "-p", '[{"op":"remove","path":"/spec/approvals"}]', check=False)
    refused(removed, "cannot be removed once made (nor spec.approvals as a whole)")  # even by the cluster admin

    st = assert_succeeded_once(k, name, uid, min_restarts=0)
    assert st["decisions"] == [{"callId": call, "decision": "approve", "decidedBy": f"kubernetes:{approver.user}"}], st
    stored = sql(k, "SELECT decided_by FROM agentfast_approvals WHERE run_id = %s", f"{k.namespace}/{name}")
    assert stored == [[f"kubernetes:{approver.user}"]]
    events = json.loads(
        k.run("get", "events", "--field-selector", f"involvedObject.name={name},reason=Decided", "-o", "json").stdout
    )["items"]
    assert [e["message"] for e in events] == [f"{call} (approve) decided by {approver.user}"]


def test_with_forbid_self_approval_the_creator_cannot_decide(release: Kube, people, tmp_path: Path) -> None:
    """The chart's policy with ``approval.forbidSelfApproval=true``, bound to this test's runs only
    (an objectSelector on a label), beside the installed one."""
    k = release
    helm = os.environ.get("HELM") or shutil.which("helm")
    assert helm, "helm not found (PATH or HELM)"
    release_name = f"e2e-self-{uuid.uuid4().hex[:6]}"
    rendered = subprocess.run(
        [
            helm,
            "template",
            release_name,
            str(REPO / "charts" / "agentfast"),
            "--set",
            "approval.forbidSelfApproval=true",
            "--show-only",
            "templates/approval-policy.yaml",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    policy, binding = [d for d in yaml.safe_load_all(rendered) if d]
    binding["spec"]["matchResources"] = {"objectSelector": {"matchLabels": {"agentfast.dev/e2e-self": release_name}}}
    k.run(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [policy, binding]}), namespaced=False
    )
    try:
        creator = people("creator", "edit", APPROVER_ROLE)
        other = people("other", APPROVER_ROLE)
        doc = refund_manifest(k, f"decide-{uuid.uuid4().hex[:6]}", **{"agentfast.dev/e2e-self": release_name})
        name = doc["metadata"]["name"]

        def created() -> bool:  # the binding takes effect within a moment of being created
            proc = creator.kube.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
            return proc.returncode != 0 and "must carry the annotation agentfast.dev/created-by: " + creator.user in proc.stderr

        k.wait_for("the self-approval policy to take effect", created, timeout=30, interval=1)
        doc["metadata"]["annotations"] = {"agentfast.dev/created-by": other.user}
        # no posing as another
        refused(creator.kube.run("apply", "-f", "-", input=json.dumps(doc), check=False), "must carry the annotation")
        doc["metadata"]["annotations"] = {"agentfast.dev/created-by": creator.user}
        creator.kube.apply(doc)
        uid = k.get("agentrun", name)["metadata"]["uid"]
        call = wait_awaiting(k, name)
        refused(
            creator.kube.run("annotate", "agentrun", name, "--overwrite", f"agentfast.dev/created-by={other.user}", check=False),
            "cannot be changed",
        )
        refused(
            decide(creator, name, call, creator.user), f"user {creator.user} created agentrun {name} and may not decide its calls"
        )
        assert decide(other, name, call, other.user).returncode == 0
        st = assert_succeeded_once(k, name, uid, min_restarts=0)
        assert st["decisions"][0]["decidedBy"] == f"kubernetes:{other.user}"
    finally:
        for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
            k.run("delete", kind, policy["metadata"]["name"], namespaced=False, check=False)


def test_a_decision_is_bound_to_the_agentrun_the_approver_reviewed(release: Kube, people) -> None:
    # Deleted and re-created under the same name (other input, same predictable call ids) between
    # the approver's review and their decision: the decision does not land on the new object.
    k = release
    approver = people("approver", APPROVER_ROLE)
    doc = refund_manifest(k, f"decide-{uuid.uuid4().hex[:6]}")
    name = doc["metadata"]["name"]
    k.apply(doc)
    call = wait_awaiting(k, name)
    reviewed = k.get("agentrun", name)["metadata"]["uid"]
    k.run("delete", "agentrun", name, "--wait=true")
    doc["spec"]["input"] = "Refund every order of every customer."
    k.apply(doc)
    plugin = shutil.which("kubectl-agentfast")
    assert plugin, "kubectl-agentfast (the agentfast console script) is not on PATH"
    env = {**os.environ, "KUBECONFIG": approver.kube.kubeconfig}
    proc = subprocess.run(
        [plugin, "approve", name, call, "-n", k.namespace, "--uid", reviewed], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "re-created since you reviewed it" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not k.get("agentrun", name)["spec"].get("approvals")
    # The API server enforces the same precondition for a raw patch carrying the reviewed uid.
    patch = {"metadata": {"uid": reviewed}, "spec": {"approvals": {call: {"decision": "approve", "decidedBy": approver.user}}}}
    refused(approver.kube.run("patch", "agentrun", name, "--type", "merge", "-p", json.dumps(patch), check=False), "metadata.uid")


def test_without_an_enforcing_binding_no_decision_is_recorded_even_after_it_returns(release: Kube) -> None:
    # Only the admission policy checks the right and the decider. With its binding not enforcing
    # (Audit), an entry claiming another user is admitted by the API server; the operator must
    # record nothing, then or after the binding enforces again (the entry is void for good).
    k = release
    binding = "agentfast-approvals"
    doc = refund_manifest(k, f"decide-{uuid.uuid4().hex[:6]}")
    name = doc["metadata"]["name"]
    k.apply(doc)
    call = wait_awaiting(k, name)
    recheck = 12  # the operator re-reads the policy every 10 s; the API server's own policy cache is quicker
    k.run(
        "patch",
        "validatingadmissionpolicybinding",
        binding,
        "--type",
        "merge",
        "-p",
        '{"spec":{"validationActions":["Audit"]}}',
        namespaced=False,
    )
    try:
        time.sleep(recheck)
        forged = json.dumps(
            {"spec": {"approvals": {call: {"decision": "approve", "decidedBy": "system:serviceaccount:elsewhere:someone"}}}}
        )
        k.wait_for(
            "the unenforced policy to admit a forged decidedBy",
            lambda: k.run("patch", "agentrun", name, "--type", "merge", "-p", forged, check=False).returncode == 0,
            timeout=30,
            interval=2,
        )

        def warned() -> bool:
            out = k.run(
                "get", "events", "--field-selector", f"involvedObject.name={name},reason=ApprovalPolicyMissing", "-o", "json"
            ).stdout
            return bool(json.loads(out)["items"])

        k.wait_for("the operator to refuse the unchecked decision", warned, timeout=60, interval=1)
    finally:
        k.run(
            "patch",
            "validatingadmissionpolicybinding",
            binding,
            "--type",
            "merge",
            "-p",
            '{"spec":{"validationActions":["Deny"]}}',
            namespaced=False,
        )
    time.sleep(recheck)
    k.run("annotate", "agentrun", name, "--overwrite", "agentfast.dev/e2e-touch=1")  # a reconcile with the policy back
    time.sleep(5)
    assert sql(k, "SELECT count(*) FROM agentfast_approvals WHERE run_id = %s", f"{k.namespace}/{name}") == [[0]]
    assert status(k, name)["phase"] == "WaitingForApproval"
