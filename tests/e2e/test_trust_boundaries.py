"""Issue 12 (items 2, 3, 5) on a real cluster with the chart installed: the attacks, refused.

- ``requiresApproval: false`` on the gated refund tool: the runner pod ends the run
  Failed/InvalidSpec; no refund row, no approval ever asked.
- A ref outside ``runner.allowedModules``: the operator refuses it (Failed/InvalidSpec) without
  importing it, and creates no runner pod.
- A 253-character AgentRun name: its runner pod is created (label cut with a hash, full name in
  an annotation) and the run reaches WaitingForApproval.
- Junk approval keys never reach the operator: the CRD refuses them at creation, and the admission
  policy admits a decision only for a call status lists as pending (test_approval_policy.py).

Issue 13: a namespace's runner credential reaches only its namespace; a hostile tool in a runner
pod sees neither the runner's credential nor the model key (G11), only its own settings.
"""

from __future__ import annotations

import base64
import json
import time
import uuid

import psycopg

from .helpers import Kube, python_in_pod
from .test_operator import give_example_tools, refund_manifest, release, runner_pods, sql, status  # noqa: F401 (release is a fixture)


def test_a_gated_tool_cannot_be_opted_out(release: Kube) -> None:
    k = release
    name = f"opt-out-{uuid.uuid4().hex[:6]}"
    doc = refund_manifest(k, name)
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
    doc = refund_manifest(k, name)
    doc["spec"]["tools"][0]["ref"] = "evil_sysexit:lookup_order"
    k.apply(doc)
    k.wait_for("Failed", lambda: status(k, name).get("phase") == "Failed", timeout=60)
    st = status(k, name)
    assert "not in the modules this cluster allows" in st["message"], st
    assert {c["type"]: c for c in st["conditions"]}["Failed"]["reason"] == "InvalidSpec"
    time.sleep(3)
    assert runner_pods(k, name) == []
    op = k.run("get", "deploy", "-l", "app.kubernetes.io/component=operator", "-o", "json").stdout
    assert all(d["status"].get("availableReplicas") == d["spec"]["replicas"] for d in json.loads(op)["items"])  # none crashed


def test_a_253_character_name_gets_a_runner(release: Kube) -> None:
    k = release
    name = f"long-{uuid.uuid4().hex[:6]}-" + "x" * 241
    assert len(name) == 253
    k.apply(refund_manifest(k, name))
    k.wait_for("WaitingForApproval", lambda: status(k, name).get("phase") == "WaitingForApproval", timeout=240)
    pods = json.loads(k.run("get", "pods", "-l", "app.kubernetes.io/component=runner", "-o", "json").stdout)["items"]
    mine = [p for p in pods if p["metadata"].get("annotations", {}).get("agentfast.dev/run-name") == name]
    assert len(mine) == 1 and len(mine[0]["metadata"]["labels"]["agentfast.dev/run"]) <= 63


def test_a_namespaces_runner_credential_reaches_only_its_namespace(
    release: Kube, kubectl: str, kubeconfig: str, examples_dsn: str
) -> None:
    # Issue 13 items 2 and 3: runs start in any namespace without anyone copying a Secret (the
    # operator makes each namespace's Postgres role and Secret), and a pod holding namespace A's
    # credential cannot read namespace B's run nor write a decision for B's gated refund.
    k = release
    spaces = [f"af-tenant-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    try:
        runs = {}
        for ns in spaces:
            k.run("create", "namespace", ns, namespaced=False)
            team = Kube(kubectl, kubeconfig, ns)
            give_example_tools(team, examples_dsn)
            doc = refund_manifest(team, "refund")
            team.apply(doc)
            runs[ns] = doc["metadata"]["name"]
        for ns in spaces:
            team = Kube(kubectl, kubeconfig, ns)
            team.wait_for(
                f"{ns}'s run to wait for approval",
                lambda: status(team, runs[ns]).get("phase") == "WaitingForApproval",
                timeout=240,
            )
            secret = team.get("secret", "agentfast-runner")
            assert secret["metadata"]["annotations"]["agentfast.dev/credential-id"]
        a, b = spaces
        victim = f"{b}/{runs[b]}"
        code = (
            "import json,os,psycopg\n"
            "c=psycopg.connect(os.environ['AGENTFAST_DSN'],autocommit=True)\n"
            "out={'me':c.execute('SELECT agentfast_tenant()').fetchone()[0]}\n"
            f"out['runs']=[r[0] for r in c.execute('SELECT run_id FROM agentfast_runs').fetchall()]\n"
            f"out['their_messages']=c.execute('SELECT count(*) FROM agentfast_messages WHERE run_id=%s',({victim!r},)).fetchone()[0]\n"
            "try:\n"
            f" c.execute(\"INSERT INTO agentfast_approvals (run_id,call_id,decision,decided_by) VALUES (%s,'call-2-0','approve','x')\",({victim!r},))\n"
            " out['insert']='accepted'\n"
            "except psycopg.Error as e:\n out['insert']=e.sqlstate\n"
            "print(json.dumps(out))\n"
        )
        seen = json.loads(
            python_in_pod(
                k,
                "tenant-probe",
                code,
                namespace=a,
                env=[{"name": "AGENTFAST_DSN", "valueFrom": {"secretKeyRef": {"name": "agentfast-runner", "key": "dsn"}}}],
            )
            .strip()
            .splitlines()[-1]
        )
        assert seen == {"me": a, "runs": [f"{a}/{runs[a]}"], "their_messages": 0, "insert": "42501"}, seen
        assert sql(k, "SELECT count(*) FROM agentfast_approvals WHERE run_id = %s", victim) == [[0]]
        assert status(Kube(kubectl, kubeconfig, b), runs[b])["phase"] == "WaitingForApproval"
    finally:
        for ns in spaces:
            k.run("delete", "namespace", ns, "--wait=false", namespaced=False, check=False)


def test_a_hostile_tool_in_a_runner_pod_reads_no_credential_of_the_runner(release: Kube) -> None:
    # G11: the tool (a stand-in for a prompt-injected shell tool) runs in the tool host, a child of
    # the runner (PID 1, non-dumpable) as uid 10001 without CAP_SYS_PTRACE: its environment holds
    # its own settings only, and the runner's /proc/1/environ and memory are closed to it.
    k = release
    name = f"probe-{uuid.uuid4().hex[:6]}"
    doc = refund_manifest(k, name)
    doc["spec"]["model"] = {"name": "scripted-probe-credentials", "script": "probe_credentials"}
    doc["spec"]["tools"] = [{"name": "probe_credentials", "ref": "agentfast.testing.tools:probe_credentials"}]
    k.apply(doc)
    k.wait_for("Succeeded", lambda: status(k, name).get("phase") == "Succeeded", timeout=240)
    [[found]] = sql(k, "SELECT result->>'content' FROM agentfast_tool_calls WHERE run_id = %s", f"{k.namespace}/{name}")
    found = json.loads(found)
    runner_dsn = base64.b64decode(k.get("secret", "agentfast-runner")["data"]["dsn"]).decode()
    password = psycopg.conninfo.conninfo_to_dict(runner_dsn)["password"]
    assert password and password not in json.dumps(found), "the runner's Postgres password reached a tool"
    assert found["uid"] == 10001 and found["parent"] == 1, found  # the host, child of the runner (PID 1)
    assert "AGENTFAST_DSN" not in found["environ"] and "AGENTFAST_MODEL_API_KEY" not in found["environ"]
    assert "user=agentfast_examples" in found["environ"]["EXAMPLE_TOOLS_DSN"]  # its own settings did arrive
    for path in ("/proc/1/environ", "/proc/1/mem"):
        assert found["reads"][path].startswith("denied: PermissionError"), (path, found["reads"][path][:200])
