"""The Helm chart: lints strictly, renders, rejects bad values, and matches the plain manifests.

Needs the `helm` binary, which hack/cluster/build.sh builds from the Go module proxy (HELM=path
overrides). A missing helm is a failure, not a skip.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "agentfast"


@pytest.fixture(scope="module")
def helm() -> str:
    found = os.environ.get("HELM") or shutil.which("helm")
    if not found:
        cached = sorted(glob.glob(os.path.expanduser("~/.cache/agentfast/k8s-bin/*/helm")))
        found = cached[-1] if cached else None
    if not found:
        pytest.fail("helm not found: run hack/cluster/build.sh (or set HELM=/path/to/helm)")
    return found


def render(helm: str, *sets: str) -> list[dict]:
    args = [helm, "template", "agentfast", str(CHART), "--namespace", "agentfast", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_lint_strict(helm: str) -> None:
    proc = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_render_installs_everything(helm: str) -> None:
    docs = render(helm)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert ("CustomResourceDefinition", "agentruns.agentfast.dev") in kinds
    assert ("Deployment", "agentfast-operator") in kinds and ("Deployment", "agentfast-postgresql") in kinds
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
    assert operator["spec"]["replicas"] == 1 and operator["spec"]["strategy"]["type"] == "Recreate"
    pod = operator["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "agentfast-operator")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert ("", "pods") not in granted  # least privilege
    # Secrets: only to keep the runners' own credential; never list, watch, patch or delete them.
    secret_verbs = {v for rule in role["rules"] if "secrets" in rule["resources"] for v in rule["verbs"]}
    assert secret_verbs == {"get", "create", "update", "delete"}


def test_external_database_needs_a_secret(helm: str) -> None:
    proc = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", "postgresql.bundled=false"], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "existingSecret" in proc.stderr
    docs = render(helm, "postgresql.bundled=false", "externalDatabase.existingSecret=pg")
    assert not any(d["kind"] == "Deployment" and d["metadata"]["name"].endswith("postgresql") for d in docs)
    op = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AGENTFAST_DSN"]["valueFrom"]["secretKeyRef"] == {"name": "pg", "key": "dsn"}


def test_values_schema_rejects_unknown_keys(helm: str) -> None:
    proc = subprocess.run([helm, "template", "x", str(CHART), "--set", "operatr.resyncSeconds=5"], capture_output=True, text=True)
    assert proc.returncode != 0 and "operatr" in proc.stderr


def test_plain_manifests_are_rendered_from_the_chart(helm: str, tmp_path: Path) -> None:
    committed = (REPO / "manifests" / "install.yaml").read_text()
    env = {**os.environ, "HELM": helm}
    subprocess.run(["bash", str(REPO / "hack" / "gen-manifests.sh")], check=True, env=env, capture_output=True)
    fresh = (REPO / "manifests" / "install.yaml").read_text()
    (REPO / "manifests" / "install.yaml").write_text(committed)
    assert fresh == committed, "manifests/install.yaml is stale: run hack/gen-manifests.sh"


def test_deciding_is_a_right_of_its_own_that_edit_does_not_carry(helm: str) -> None:
    docs = render(helm)
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}

    def grants(role: dict) -> set[tuple[str, str]]:
        return {(r, v) for rule in role.get("rules") or [] for r in rule["resources"] for v in rule["verbs"]}

    approver = roles["agentfast-approver"]
    assert approver["aggregationRule"]["clusterRoleSelectors"] == [{"matchLabels": {"agentfast.dev/aggregate-to-approver": "true"}}]
    base = [r for r in roles.values() if r["metadata"]["labels"].get("agentfast.dev/aggregate-to-approver") == "true"]
    assert len(base) == 1 and ("agentruns/approval", "approve") in grants(base[0])
    for name, role in roles.items():  # the right is carried by the approver role alone
        if role is not base[0]:
            assert not any(r == "agentruns/approval" for r, _ in grants(role)), name
    edit = roles["agentfast-edit"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert ("agentruns", "create") in grants(edit)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("ValidatingAdmissionPolicy", "agentfast-approvals"), ("ValidatingAdmissionPolicyBinding", "agentfast-approvals")} <= kinds


def test_forbid_self_approval_adds_the_creator_rules_only_when_asked(helm: str) -> None:
    def policy(*sets: str) -> dict:
        return next(d for d in render(helm, *sets) if d["kind"] == "ValidatingAdmissionPolicy")

    default, strict = policy(), policy("approval.forbidSelfApproval=true")
    text = lambda p: " ".join(v.get("expression", "") for v in p["spec"]["validations"])  # noqa: E731
    assert "created-by" not in text(default) and "variables.creator != variables.user" in text(strict)
    assert "check('approve')" in text(default) and "decidedBy == variables.user" in text(default)
    binding = next(d for d in render(helm) if d["kind"] == "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["validationActions"] == ["Deny"] and default["spec"]["failurePolicy"] == "Fail"


def test_model_config_rights_teams_read_admins_write(helm: str) -> None:
    # Issue 12 item 4: ModelConfigs are readable wherever a namespace is (aggregated to view, and
    # so to edit and admin), writable only through a role cluster admins bind; the operator reads
    # them and never gets Secrets.
    docs = render(helm)
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    viewer = roles["agentfast-modelconfig-viewer"]
    assert viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert [(r["resources"], sorted(r["verbs"])) for r in viewer["rules"]] == [(["modelconfigs"], ["get", "list", "watch"])]
    admin = roles["agentfast-model-admin"]
    assert not any(k.startswith("rbac.authorization.k8s.io/aggregate-to") for k in admin["metadata"]["labels"])
    assert {"create", "update", "patch", "delete"} <= set(admin["rules"][0]["verbs"]) and admin["rules"][0]["resources"] == ["modelconfigs"]
    operator = roles["agentfast-operator"]
    mc = [r for r in operator["rules"] if "modelconfigs" in r["resources"]]
    assert len(mc) == 1 and sorted(mc[0]["verbs"]) == ["get", "list", "watch"]
    writers = [n for n, role in roles.items() for r in role["rules"] if "modelconfigs" in r["resources"] and set(r["verbs"]) & {"create", "patch", "update"}]
    assert writers == ["agentfast-model-admin"]
    assert ("CustomResourceDefinition", "modelconfigs.agentfast.dev") in {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_network_policies_are_off_by_default_and_complete_when_on(helm: str) -> None:
    import json

    def operator_env(docs: list[dict]) -> dict:
        op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
        return {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}

    docs = render(helm)
    assert not any(d["kind"] == "NetworkPolicy" for d in docs) and "AGENTFAST_NETWORK_POLICY" not in operator_env(docs)
    docs = render(helm, "networkPolicy.enabled=true")
    [pg_policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert pg_policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "postgresql"
    assert pg_policy["spec"]["policyTypes"] == ["Ingress"]
    sources = pg_policy["spec"]["ingress"][0]["from"]
    assert [s["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for s in sources] == ["operator", "runner"]
    # what the operator puts in every runner pod's NetworkPolicy: its own parser accepts it
    from agentfast.operator.workload import EgressPolicy

    policy = EgressPolicy.from_env({"AGENTFAST_NETWORK_POLICY": operator_env(docs)["AGENTFAST_NETWORK_POLICY"]})
    [pg] = policy.postgres
    assert pg["to"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "agentfast", "app.kubernetes.io/component": "postgresql"}
    assert pg["ports"] == [{"port": 5432, "protocol": "TCP"}] and policy.model == ()
    assert policy.dns[0]["ports"][0]["port"] == 53
    # an external database needs its egress rules: a NetworkPolicy cannot name its host
    proc = subprocess.run([helm, "template", "x", str(CHART), "--set", "networkPolicy.enabled=true", "--set", "postgresql.bundled=false",
                           "--set", "externalDatabase.existingSecret=pg"], capture_output=True, text=True)
    assert proc.returncode != 0 and "networkPolicy.postgresEgress" in proc.stderr
    values = {"networkPolicy": {"enabled": True, "modelEgress": [{"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 443}]}],
                                "postgresEgress": [{"to": [{"ipBlock": {"cidr": "10.8.0.5/32"}}], "ports": [{"protocol": "TCP", "port": 5432}]}]},
              "postgresql": {"bundled": False}, "externalDatabase": {"existingSecret": "pg"}}
    out = subprocess.run([helm, "template", "x", str(CHART), "-f", "-"], input=json.dumps(values), check=True, capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert not any(d["kind"] == "NetworkPolicy" for d in docs)  # no bundled Postgres to protect
    env = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    policy = EgressPolicy.from_env({"AGENTFAST_NETWORK_POLICY": next(e["value"] for e in env if e["name"] == "AGENTFAST_NETWORK_POLICY")})
    assert policy.postgres[0]["to"] == [{"ipBlock": {"cidr": "10.8.0.5/32"}}] and policy.model[0]["ports"] == [{"protocol": "TCP", "port": 443}]
    bad = subprocess.run([helm, "template", "x", str(CHART), "--set", "networkPolicy.modelEgress[0].to[0].host=api.openai.com"],
                         capture_output=True, text=True)
    assert bad.returncode != 0  # the values schema: peers are ipBlock, namespaceSelector, podSelector
