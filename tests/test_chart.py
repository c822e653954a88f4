"""The Helm chart: lints strictly, renders, rejects bad values, and matches the plain manifests.

Needs the `helm` binary, which hack/cluster/build.sh builds from the Go module proxy (HELM=path
overrides). A missing helm is a failure, not a skip.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .helpers import CACHE

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "agentfast"


@pytest.fixture(scope="module")
def helm() -> str:
    found = os.environ.get("HELM") or shutil.which("helm")
    if not found:
        cached = sorted(glob.glob(str(CACHE / "k8s-bin" / "*" / "helm")))
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


@pytest.mark.process
def test_lint_strict(helm: str) -> None:
    proc = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.process
def test_default_render_installs_everything(helm: str) -> None:
    docs = render(helm)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert ("CustomResourceDefinition", "agentruns.agentfast.dev") in kinds
    assert ("Deployment", "agentfast-operator") in kinds and ("Deployment", "agentfast-postgresql") in kinds
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
    # Two replicas electing a leader on a Lease (operator/leader.py), a PDB, and a Role on leases only.
    assert operator["spec"]["replicas"] == 2 and "strategy" not in operator["spec"]
    assert operator["spec"]["template"]["spec"]["containers"][0]["command"][:3] == ["python", "-m", "agentfast.operator"]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AGENTFAST_LEADER_ELECTION"] == "true" and env["AGENTFAST_LEADER_LEASE"] == "agentfast-operator"
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    leader = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "agentfast-operator-leader")
    assert leader["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["agentfast-operator"],  # AGENTFAST_LEADER_LEASE
            "verbs": ["get", "update"],
        },
    ]
    single = next(
        d
        for d in render(helm, "operator.replicas=1")
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator"
    )
    assert single["spec"]["strategy"]["type"] == "Recreate"  # one replica without election: never two at once
    assert {e["name"]: e.get("value") for e in single["spec"]["template"]["spec"]["containers"][0]["env"]}[
        "AGENTFAST_LEADER_ELECTION"
    ] == "false"
    pod = operator["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "agentfast-operator")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    # Runner pods: the operator creates and prunes them (operator/lifecycle.py); no Jobs any more.
    assert next(r["verbs"] for r in role["rules"] if "pods" in r["resources"]) == ["list", "watch", "create", "delete"]
    assert ("batch", "jobs") not in granted
    # Secrets: only to keep the runners' own credential; never list, watch or patch them, and read,
    # replace or delete only that one by name (no ModelConfig key or tools' Secret is readable).
    secret_rules = [(r.get("resourceNames"), r["verbs"]) for r in role["rules"] if "secrets" in r["resources"]]
    assert secret_rules == [(None, ["create"]), (["agentfast-runner"], ["get", "update", "delete"])]


def _images(docs: list[dict]) -> set[str]:
    """Every image the render names: the containers' and the runners' (the operator's env)."""
    found = {
        c["image"]
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"].get("initContainers", []) + d["spec"]["template"]["spec"]["containers"]
    }
    return found | {_operator_env(docs)["AGENTFAST_RUNNER_IMAGE"]}


@pytest.mark.process
def test_the_image_tag_defaults_to_the_charts_app_version(helm: str) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert app_version == "0.1.0"
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"]["tag"] == ""
    # The operator, the runners and the bundled Postgres all run the image released with the chart...
    assert _images(render(helm)) == {f"agentfast:{app_version}"}
    # ...or the one named; an empty tag (as in values.yaml) is the appVersion too.
    assert _images(render(helm, "image.tag=dev", "image.repository=agentfast-testing")) == {"agentfast-testing:dev"}
    assert _images(render(helm, "image.tag=")) == {f"agentfast:{app_version}"}
    proc = subprocess.run([helm, "template", "x", str(CHART), "--set", "image.tag=null"], capture_output=True, text=True)
    assert proc.returncode == 0 and f"image: agentfast:{app_version}" in proc.stdout


@pytest.mark.process
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


@pytest.mark.process
def test_values_schema_rejects_unknown_keys(helm: str) -> None:
    proc = subprocess.run([helm, "template", "x", str(CHART), "--set", "operatr.resyncSeconds=5"], capture_output=True, text=True)
    assert proc.returncode != 0 and "operatr" in proc.stderr


@pytest.mark.process
def test_plain_manifests_are_rendered_from_the_chart(helm: str, tmp_path: Path) -> None:
    committed = (REPO / "manifests" / "install.yaml").read_text()
    env = {**os.environ, "HELM": helm}
    subprocess.run(["bash", str(REPO / "hack" / "gen-manifests.sh")], check=True, env=env, capture_output=True)
    fresh = (REPO / "manifests" / "install.yaml").read_text()
    (REPO / "manifests" / "install.yaml").write_text(committed)
    assert fresh == committed, "manifests/install.yaml is stale: run hack/gen-manifests.sh"


@pytest.mark.process
def test_deciding_is_a_right_of_its_own_that_edit_does_not_carry(helm: str) -> None:
    docs = render(helm)
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}

    def grants(role: dict) -> set[tuple[str, str]]:
        return {(r, v) for rule in role.get("rules") or [] for r in rule["resources"] for v in rule["verbs"]}

    approver = roles["agentfast-approver"]
    assert approver["aggregationRule"]["clusterRoleSelectors"] == [
        {"matchLabels": {"agentfast.dev/aggregate-to-approver": "true"}}
    ]
    base = [r for r in roles.values() if r["metadata"]["labels"].get("agentfast.dev/aggregate-to-approver") == "true"]
    assert len(base) == 1 and ("agentruns/approval", "approve") in grants(base[0])
    for name, role in roles.items():  # the right is carried by the approver role alone
        if role is not base[0]:
            assert not any(r == "agentruns/approval" for r, _ in grants(role)), name
    edit = roles["agentfast-edit"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert ("agentruns", "create") in grants(edit)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("ValidatingAdmissionPolicy", "agentfast-approvals"),
        ("ValidatingAdmissionPolicyBinding", "agentfast-approvals"),
    } <= kinds


@pytest.mark.process
def test_forbid_self_approval_adds_the_creator_rules_only_when_asked(helm: str) -> None:
    def policy(*sets: str) -> dict:
        return next(d for d in render(helm, *sets) if d["kind"] == "ValidatingAdmissionPolicy")

    default, strict = policy(), policy("approval.forbidSelfApproval=true")
    text = lambda p: " ".join(v.get("expression", "") for v in p["spec"]["validations"])  # noqa: E731
    assert "created-by" not in text(default) and "variables.creator != variables.user" in text(strict)
    assert "check('approve')" in text(default) and "decidedBy == variables.user" in text(default)
    binding = next(d for d in render(helm) if d["kind"] == "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["validationActions"] == ["Deny"] and default["spec"]["failurePolicy"] == "Fail"


@pytest.mark.process
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
    assert {"create", "update", "patch", "delete"} <= set(admin["rules"][0]["verbs"]) and admin["rules"][0]["resources"] == [
        "modelconfigs"
    ]
    operator = roles["agentfast-operator"]
    mc = [r for r in operator["rules"] if "modelconfigs" in r["resources"]]
    assert len(mc) == 1 and mc[0]["verbs"] == ["get"]  # one read by name when a run is registered
    writers = [
        n
        for n, role in roles.items()
        for r in role["rules"]
        if "modelconfigs" in r["resources"] and set(r["verbs"]) & {"create", "patch", "update"}
    ]
    assert writers == ["agentfast-model-admin"]
    assert ("CustomResourceDefinition", "modelconfigs.agentfast.dev") in {(d["kind"], d["metadata"]["name"]) for d in docs}


@pytest.mark.process
def test_network_policies_are_off_by_default_and_complete_when_on(helm: str) -> None:
    import json

    def operator_env(docs: list[dict]) -> dict:
        op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
        return {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}

    docs = render(helm)  # off: no runner egress policies; the bundled Postgres's ingress policy is there anyway
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"] == ["agentfast-postgresql"]
    assert "AGENTFAST_NETWORK_POLICY" not in operator_env(docs)
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
    assert pg["to"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "agentfast",
        "app.kubernetes.io/component": "postgresql",
    }
    assert pg["ports"] == [{"port": 5432, "protocol": "TCP"}] and policy.model == ()
    assert policy.dns[0]["ports"][0]["port"] == 53
    # an external database needs its egress rules: a NetworkPolicy cannot name its host
    proc = subprocess.run(
        [
            helm,
            "template",
            "x",
            str(CHART),
            "--set",
            "networkPolicy.enabled=true",
            "--set",
            "postgresql.bundled=false",
            "--set",
            "externalDatabase.existingSecret=pg",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "networkPolicy.postgresEgress" in proc.stderr
    values = {
        "networkPolicy": {
            "enabled": True,
            "modelEgress": [{"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 443}]}],
            "postgresEgress": [{"to": [{"ipBlock": {"cidr": "10.8.0.5/32"}}], "ports": [{"protocol": "TCP", "port": 5432}]}],
        },
        "postgresql": {"bundled": False},
        "externalDatabase": {"existingSecret": "pg"},
    }
    out = subprocess.run(
        [helm, "template", "x", str(CHART), "-f", "-"], input=json.dumps(values), check=True, capture_output=True, text=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert not any(d["kind"] == "NetworkPolicy" for d in docs)  # no bundled Postgres to protect
    env = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    policy = EgressPolicy.from_env(
        {"AGENTFAST_NETWORK_POLICY": next(e["value"] for e in env if e["name"] == "AGENTFAST_NETWORK_POLICY")}
    )
    assert policy.postgres[0]["to"] == [{"ipBlock": {"cidr": "10.8.0.5/32"}}] and policy.model[0]["ports"] == [
        {"protocol": "TCP", "port": 443}
    ]
    bad = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", "networkPolicy.modelEgress[0].to[0].host=api.openai.com"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0  # the values schema: peers are ipBlock, namespaceSelector, podSelector


# -- the bundled trial Postgres (issue 13 item 5) ------------------------------------------------


def _postgres_env(docs: list[dict]) -> dict:
    pg = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-postgresql")
    return {e["name"]: e for e in pg["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_install_yaml_holds_no_password_and_says_how_to_make_the_secret() -> None:
    import re

    from agentfast.runner.store import parse_dsn

    text = (REPO / "manifests" / "install.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert not any(d["kind"] == "Secret" for d in docs)
    assert "agentfast-trial-only" not in text and not re.search(
        r"postgresql://[^:\s]+:[A-Za-z0-9]", text.split("\napiVersion", 1)[1]
    )
    env = _postgres_env(docs)
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "agentfast-postgres", "key": "password"}
    assert env["AGENTFAST_DSN"]["valueFrom"]["secretKeyRef"] == {"name": "agentfast-postgres", "key": "dsn"}
    # the header's command makes that Secret, and its DSN names the Service install.yaml creates
    header = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    assert "kubectl -n agentfast create secret generic agentfast-postgres" in header and header.count("openssl rand") == 2
    dsn = re.search(r'--from-literal=dsn="([^"]+)"', header).group(1).replace("$P", "0123abcd")
    info = parse_dsn(dsn)
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("postgresql"))
    assert info["host"] == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc" and info["port"] == "5432"
    assert info["user"] == "agentfast" and info["dbname"] == "postgres" and info["password"] == "0123abcd"
    readme = (REPO / "README.md").read_text()
    assert "create secret generic agentfast-postgres" in readme and "postgresql.existingSecret" in readme


@pytest.mark.process
def test_existing_secret_mode_renders_no_secret(helm: str) -> None:
    docs = render(helm, "postgresql.existingSecret=trial-db")
    assert not any(d["kind"] == "Secret" for d in docs)
    env = _postgres_env(docs)
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "trial-db", "key": "password"}
    assert env["AGENTFAST_DSN"]["valueFrom"]["secretKeyRef"] == {"name": "trial-db", "key": "dsn"}
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
    op_env = {e["name"]: e for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert op_env["AGENTFAST_DSN"]["valueFrom"]["secretKeyRef"] == {"name": "trial-db", "key": "dsn"}
    assert op_env["AGENTFAST_DSN_SECRET"]["value"] == "trial-db"
    assert "agentfast.dev/dsn-checksum" not in (op["spec"]["template"]["metadata"].get("annotations") or {})
    bad = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", "postgresql.existingSecret=Not_A_Name"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "existingSecret" in bad.stderr
    gone = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", "postgresql.password=fixed"], capture_output=True, text=True
    )
    assert gone.returncode != 0  # no value holds a password any more


@pytest.mark.process
def test_generated_passwords_are_random_per_install_and_read_back_on_upgrade(helm: str) -> None:
    import hashlib

    from agentfast.runner.store import parse_dsn

    def secret() -> dict:
        docs = render(helm)
        [s] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "agentfast-postgres"]
        # the operator restarts when its DSN changes (it reads it at start): same value, one render
        op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
        checksum = op["spec"]["template"]["metadata"]["annotations"]["agentfast.dev/dsn-checksum"]
        assert checksum == hashlib.sha256(s["stringData"]["dsn"].encode()).hexdigest()[:16]
        return s["stringData"]

    first, second = secret(), secret()
    info = parse_dsn(first["dsn"])
    assert set(first) == {"password", "dsn"}
    assert info["user"] == "agentfast" and info["host"] == "agentfast-postgresql.agentfast.svc" and info["dbname"] == "postgres"
    for pw in (first["password"], info["password"]):
        assert len(pw) >= 32 and pw.isalnum()
    assert first["password"] != info["password"]  # two roles, two passwords
    assert first["password"] != second["password"] and first["dsn"] != second["dsn"]  # generated, not fixed
    # `helm template` has no lookup (an upgrade's path): what the template reads back is the
    # Secret it writes, both keys of it (the role's password from the dsn it wrote)
    assert "name: agentfast-postgres" in (CHART / "templates" / "postgresql.yaml").read_text()
    tpl = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace "agentfast-postgres"' in tpl
    assert 'index $existing.data "password"' in tpl and 'index $existing.data "dsn"' in tpl
    assert 'trimPrefix "postgresql://agentfast:"' in tpl and 'printf "postgresql://agentfast:%s@' in tpl


@pytest.mark.process
def test_pg_hba_networks_come_from_the_values(helm: str) -> None:
    from agentfast.operator.devpostgres import DEFAULT_CLIENT_CIDRS, client_cidrs, hba_conf

    default = _postgres_env(render(helm))["AGENTFAST_PG_CLIENT_CIDRS"]["value"]
    assert client_cidrs(default) == list(DEFAULT_CLIENT_CIDRS)  # the chart's default is the server's
    value = _postgres_env(render(helm, "postgresql.clientCIDRs={10.244.0.0/16,fd00:10:244::/56}"))["AGENTFAST_PG_CLIENT_CIDRS"][
        "value"
    ]
    hba = hba_conf(client_cidrs(value))
    assert "host all all 10.244.0.0/16 scram-sha-256" in hba and "host all all fd00:10:244::/56 scram-sha-256" in hba
    assert hba.index("host all postgres 0.0.0.0/0 reject") < hba.index("10.244.0.0/16") and "0.0.0.0/0 scram" not in hba
    for bad in ("postgresql.clientCIDRs={all}", "postgresql.clientCIDRs={10.0.0.0}"):
        proc = subprocess.run([helm, "template", "x", str(CHART), "--set", bad], capture_output=True, text=True)
        assert proc.returncode != 0, bad


@pytest.mark.process
def test_the_bundled_postgres_admits_only_operator_and_runner_pods(helm: str) -> None:
    for sets in ((), ("networkPolicy.enabled=true",)):
        [policy] = [
            d for d in render(helm, *sets) if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "agentfast-postgresql"
        ]
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"] == {
            "app.kubernetes.io/instance": "agentfast",
            "app.kubernetes.io/component": "postgresql",
        }
        assert spec["policyTypes"] == ["Ingress"] and len(spec["ingress"]) == 1
        operator, runner = spec["ingress"][0]["from"]
        assert operator == {
            "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "agentfast", "app.kubernetes.io/component": "operator"}}
        }
        assert runner["namespaceSelector"] == {}  # runners run in any namespace
        assert runner["podSelector"]["matchLabels"] == {"app.kubernetes.io/component": "runner"}
        assert spec["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 5432}]
    [policy] = [d for d in render(helm, "operator.watchNamespaces={team-a,team-b}") if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"][0]["from"][1]["namespaceSelector"]["matchExpressions"][0]["values"] == ["team-a", "team-b"]
    assert not any(
        d["kind"] == "NetworkPolicy" for d in render(helm, "postgresql.bundled=false", "externalDatabase.existingSecret=pg")
    )
    # the runner pods the operator makes carry the labels the policy selects
    from agentfast.operator.workload import LABEL_RUN

    [_, runner] = policy["spec"]["ingress"][0]["from"]
    assert runner["podSelector"]["matchExpressions"] == [{"key": LABEL_RUN, "operator": "Exists"}]


# -- runner pods configurable (issue 14 item 7) -----------------------------------------------------


def _operator_env(docs: list[dict]) -> dict[str, str]:
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator"))
    return {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}


def _render_values(helm: str, values: dict) -> subprocess.CompletedProcess:
    import json

    return subprocess.run(
        [helm, "template", "agentfast", str(CHART), "--namespace", "agentfast", "-f", "-"],
        input=json.dumps(values),
        capture_output=True,
        text=True,
    )


@pytest.mark.process
def test_runner_values_reach_the_operator_and_its_parser_accepts_them(helm: str) -> None:
    from agentfast.operator.workload import RunnerConfig, build_pod

    default = RunnerConfig.from_env(_operator_env(render(helm)))
    assert default.resources == {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    assert default.allowed_images == () and default.service_account == "" and not default.automount_token
    values = {
        "runner": {
            "resources": {"requests": {"cpu": 1, "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
            "nodeSelector": {"pool": "agents"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "agents", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}
                        ]
                    }
                }
            },
            "priorityClassName": "agents",
            "allowedImages": ["reg.example.com/team-a/", "reg.example.com/shared/agent"],
            "serviceAccount": {
                "create": True,
                "annotations": {"iam.gke.io/gcp-service-account": "runner@p.iam.gserviceaccount.com"},
            },
        }
    }
    proc = _render_values(helm, values)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    cfg = RunnerConfig.from_env(_operator_env(docs))
    assert cfg.resources == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert cfg.node_selector == {"pool": "agents"} and cfg.tolerations[0]["key"] == "dedicated" and cfg.priority_class == "agents"
    assert cfg.allowed_images == ("reg.example.com/team-a/", "reg.example.com/shared/agent")
    assert cfg.service_account == "agentfast-runner" and cfg.service_account_create
    assert cfg.service_account_annotations == {"iam.gke.io/gcp-service-account": "runner@p.iam.gserviceaccount.com"}
    pod = build_pod({"metadata": {"name": "r", "namespace": "team-a", "uid": "u"}, "spec": {}}, cfg)["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"memory": "2Gi"} and pod["nodeSelector"] == {"pool": "agents"}

    # the operator may manage ServiceAccounts only when asked to make them
    def sa_rules(docs: list[dict]) -> list:
        role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-operator"))
        return [(r.get("resourceNames"), r["verbs"]) for r in role["rules"] if "serviceaccounts" in r["resources"]]

    # create, then get and patch the one it makes only (RBAC cannot name what is created)
    assert sa_rules(docs) == [(None, ["create"]), ([cfg.service_account], ["get", "patch"])] and sa_rules(render(helm)) == []
    named = [
        d
        for d in yaml.safe_load_all(_render_values(helm, {"runner": {"serviceAccount": {"create": True, "name": "r"}}}).stdout)
        if d
    ]
    assert sa_rules(named) == [(None, ["create"]), (["r"], ["get", "patch"])]


@pytest.mark.process
def test_payload_limits_reach_the_runner_pods_env(helm: str) -> None:
    from agentfast.operator.workload import RunnerConfig, build_pod

    default = RunnerConfig.from_env(_operator_env(render(helm)))
    assert (default.payload_threshold_bytes, default.payload_max_bytes) == (1 << 20, 64 << 20)
    # from a values file a number is a float to helm: 256 MiB must not render as 2.68435456e+08
    proc = _render_values(helm, {"runner": {"payloadThresholdBytes": 4194304, "payloadMaxBytes": 268435456}})
    assert proc.returncode == 0, proc.stderr
    cfg = RunnerConfig.from_env(_operator_env([d for d in yaml.safe_load_all(proc.stdout) if d]))
    pod = build_pod({"metadata": {"name": "r", "namespace": "team-a", "uid": "u"}, "spec": {}}, cfg)["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert (env["AGENTFAST_PAYLOAD_THRESHOLD_BYTES"], env["AGENTFAST_PAYLOAD_MAX_BYTES"]) == ("4194304", "268435456")
    with pytest.raises(ValueError, match="AGENTFAST_RUNNER_PAYLOAD_MAX_BYTES"):
        RunnerConfig.from_env({"AGENTFAST_RUNNER_PAYLOAD_MAX_BYTES": "lots"})


@pytest.mark.process
def test_max_iteration_crashes_reaches_the_runner_pods_env(helm: str) -> None:
    """runner.maxIterationCrashes (issue 30 item 4): the runner's AGENTFAST_MAX_ITERATION_CRASHES, 5 by default."""
    from agentfast.operator.workload import RunnerConfig, build_pod

    body = {"metadata": {"name": "r", "namespace": "team-a", "uid": "u"}, "spec": {}}
    default = RunnerConfig.from_env(_operator_env(render(helm)))
    pod = build_pod(body, default)["spec"]
    assert {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}["AGENTFAST_MAX_ITERATION_CRASHES"] == "5"
    proc = _render_values(helm, {"runner": {"maxIterationCrashes": 2}})
    assert proc.returncode == 0, proc.stderr
    cfg = RunnerConfig.from_env(_operator_env([d for d in yaml.safe_load_all(proc.stdout) if d]))
    pod = build_pod(body, cfg)["spec"]
    assert {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}["AGENTFAST_MAX_ITERATION_CRASHES"] == "2"
    refused = _render_values(helm, {"runner": {"maxIterationCrashes": 0}})
    assert refused.returncode != 0 and "maxIterationCrashes" in refused.stderr
    with pytest.raises(ValueError, match="AGENTFAST_RUNNER_MAX_ITERATION_CRASHES"):
        RunnerConfig.from_env({"AGENTFAST_RUNNER_MAX_ITERATION_CRASHES": "0"})


@pytest.mark.process
def test_the_otlp_endpoint_reaches_the_runner_pods_env(helm: str) -> None:
    """runner.otlpEndpoint turns traces on in runner pods (docs/observability.md); unset, no OTEL_* variable."""
    from agentfast.operator.workload import RunnerConfig, build_pod

    body = {"metadata": {"name": "r", "namespace": "team-a", "uid": "u"}, "spec": {}}

    def pod_env(docs: list[dict]) -> dict[str, str | None]:
        pod = build_pod(body, RunnerConfig.from_env(_operator_env(docs)))["spec"]
        return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}

    assert not [k for k in pod_env(render(helm)) if k.startswith("OTEL_")]
    proc = _render_values(helm, {"runner": {"otlpEndpoint": "http://otel-collector.observability:4318"}})
    assert proc.returncode == 0, proc.stderr
    env = pod_env([d for d in yaml.safe_load_all(proc.stdout) if d])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4318"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.namespace.name=team-a"
    with pytest.raises(ValueError, match="AGENTFAST_RUNNER_OTLP_ENDPOINT"):
        RunnerConfig.from_env({"AGENTFAST_RUNNER_OTLP_ENDPOINT": "otel-collector:4318"})


@pytest.mark.parametrize(
    "values, problem",
    [
        ({"runner": {"otlpEndpoint": "otel-collector:4318"}}, "otlpEndpoint"),
        ({"runner": {"allowedImages": ["*"]}}, "allowedImages"),
        ({"runner": {"allowedImages": ["reg.example.com/team"]}}, None),  # a repository
        ({"runner": {"allowedImages": ["reg.example.com/../x/"]}}, "allowedImages"),
        ({"runner": {"resources": {"requests": {"cpu": "lots"}}}}, "cpu"),
        ({"runner": {"resources": {"claims": []}}}, "claims"),
        ({"runner": {"tolerations": [{"key": "x", "operator": "Maybe"}]}}, "operator"),
        ({"runner": {"affinity": {"nodeAfinity": {}}}}, "nodeAfinity"),
        ({"runner": {"priorityClassName": "Not_A_Name"}}, "priorityClassName"),
        ({"runner": {"serviceAccount": {"name": "team/x"}}}, "name"),
        ({"runner": {"serviceAccount": {"annotations": {"a": "b"}}}}, "only with runner.serviceAccount.create"),
        ({"runner": {"serviceAccount": {"create": True, "name": "default"}}}, "default ServiceAccount"),
        ({"runner": {"serviceAccount": {"name": "agentfast-operator"}}}, "operator's own ServiceAccount"),
        ({"runner": {"serviceAccount": {"token": True}}}, "token"),
        ({"runner": {"payloadMaxBytes": 0}}, "payloadMaxBytes"),
        ({"runner": {"payloadThresholdBytes": 2097152, "payloadMaxBytes": 1048576}}, "payloadThresholdBytes is over"),
    ],
)
@pytest.mark.process
def test_bad_runner_values_are_refused_at_install(helm: str, values: dict, problem: str | None) -> None:
    proc = _render_values(helm, values)
    if problem is None:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0 and problem in proc.stderr, proc.stderr


# -- an ended run's runner pods: runner.podTTLSecondsAfterFinished (issue 14 item 3) ----------------


@pytest.mark.process
def test_the_runner_pod_ttl_reaches_the_operator_and_keep_is_minus_one_or_null(helm: str) -> None:
    from agentfast.operator.workload import RunnerConfig

    assert RunnerConfig.from_env(_operator_env(render(helm))).pod_ttl_s == 3600  # the default: an hour for kubectl logs
    for value, expected in (("0", 0), ("-1", None), ("null", None)):
        assert (
            RunnerConfig.from_env(_operator_env(render(helm, f"runner.podTTLSecondsAfterFinished={value}"))).pod_ttl_s == expected
        ), value
    # from a values file a number is a float to helm: a month must not render as 2.592e+06
    proc = _render_values(helm, {"runner": {"podTTLSecondsAfterFinished": 2592000}})
    assert proc.returncode == 0, proc.stderr
    assert RunnerConfig.from_env(_operator_env([d for d in yaml.safe_load_all(proc.stdout) if d])).pod_ttl_s == 2592000
    for bad in (-2, "1h", 31536001):
        proc = _render_values(helm, {"runner": {"podTTLSecondsAfterFinished": bad}})
        assert proc.returncode != 0 and "podTTLSecondsAfterFinished" in proc.stderr, (bad, proc.stderr)


@pytest.mark.process
def test_the_operator_may_delete_network_policies_only_when_it_makes_them(helm: str) -> None:
    def np_verbs(docs: list[dict]) -> list[str]:
        role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "agentfast-operator")
        return next((r["verbs"] for r in role["rules"] if "networkpolicies" in r["resources"]), [])

    assert np_verbs(render(helm)) == []  # it makes none, so it may touch none
    assert np_verbs(render(helm, "networkPolicy.enabled=true")) == ["get", "create", "delete"]


def test_metrics_are_served_and_the_service_monitor_and_dashboard_are_opt_in(helm: str) -> None:
    def operator_container(docs: list[dict]) -> dict:
        deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
        return deployment["spec"]["template"]["spec"]["containers"][0]

    docs = render(helm)
    container = operator_container(docs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["AGENTFAST_METRICS_PORT"] == "8081"
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "agentfast-operator-metrics")
    assert service["spec"]["selector"] == {"app.kubernetes.io/instance": "agentfast", "app.kubernetes.io/component": "operator"}
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]  # off by default: its CRD may not exist
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "agentfast-dashboard"]

    docs = render(
        helm,
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.labels.release=prom",
        "metrics.dashboard.enabled=true",
    )
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    # The monitor selects the metrics Service by its labels, in the release namespace.
    assert all(service["metadata"]["labels"][k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["agentfast"]}
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "agentfast-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["agentfast.json"])
    assert board == json.loads((CHART / "dashboards" / "agentfast.json").read_text())
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for name in (
        "agentfast_runs",
        "agentfast_approvals_waiting",
        "agentfast_model_call_duration_seconds_bucket",
        "agentfast_tokens_total",
    ):
        assert name in exprs

    docs = render(helm, "metrics.enabled=false")
    assert "AGENTFAST_METRICS_PORT" not in {e["name"] for e in operator_container(docs)["env"]}
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "agentfast-operator-metrics"]
    proc = subprocess.run([helm, "template", "x", str(CHART), "--set", "metrics.port=8080"], capture_output=True, text=True)
    assert proc.returncode != 0 and "metrics" in proc.stderr  # the liveness endpoint's port


# -- notifications (issue 18 item 4, docs/notifications.md) --------------------------------------------


def _operator_env_full(docs: list[dict]) -> dict[str, dict]:
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator"))
    return {e["name"]: e for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.process
def test_notification_values_reach_the_operator_and_its_parser_accepts_them(helm: str) -> None:
    from agentfast.runner.notify import WebhookConfig

    assert WebhookConfig.from_env(_operator_env(render(helm))) is None  # off by default
    plain = _operator_env(
        render(
            helm,
            "notifications.webhook.url=https://hooks.example/agentfast",
            "notifications.webhook.format=slack",
            "notifications.webhook.includeArguments=true",
            "notifications.webhook.maxAttempts=7",
        )
    )
    config = WebhookConfig.from_env({k: v for k, v in plain.items() if v is not None})
    assert config is not None and (config.url, config.format, config.include_arguments, config.max_attempts, config.token) == (
        "https://hooks.example/agentfast",
        "slack",
        True,
        7,
        "",
    )
    # the URL and a bearer token from a Secret: never in the rendered manifests
    env = _operator_env_full(
        render(helm, "notifications.webhook.secretRef.name=hook", "notifications.webhook.secretRef.tokenKey=token")
    )
    assert env["AGENTFAST_NOTIFY_URL"] == {
        "name": "AGENTFAST_NOTIFY_URL",
        "valueFrom": {"secretKeyRef": {"name": "hook", "key": "url"}},
    }
    assert env["AGENTFAST_NOTIFY_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hook", "key": "token"}}
    for values, problem in (
        ({"webhook": {"url": "https://x.example", "secretRef": {"name": "hook"}}}, "not both"),
        ({"webhook": {"secretRef": {"tokenKey": "token"}}}, "needs secretRef.name"),
        ({"webhook": {"url": "ftp://x.example"}}, "does not match pattern"),
        ({"webhook": {"format": "teams"}}, "format"),
        ({"webhook": {"includeArgs": True}}, "additional properties"),
    ):
        proc = _render_values(helm, {"notifications": values})
        assert proc.returncode != 0 and problem in proc.stderr, (values, proc.stderr)


# -- the approvals inbox (issue 18 item 5, docs/ui.md) ---------------------------------------------


def test_the_inbox_is_off_by_default_and_acts_only_with_each_persons_own_token(helm: str) -> None:
    assert not [d for d in render(helm) if d["metadata"]["name"] == "agentfast-ui"]
    docs = render(helm, "ui.enabled=true", "ui.allowedHosts={inbox.example.com}")
    ui = {d["kind"]: d for d in docs if d["metadata"]["name"] == "agentfast-ui"}
    assert set(ui) == {"ServiceAccount", "Deployment", "Service", "Secret"}
    assert len(base64.b64decode(ui["Secret"]["data"]["cookieKey"])) == 48  # the login cookie's key, random per install
    # No identity of its own: no token mounted, and no Role or ClusterRole binds its account.
    assert ui["ServiceAccount"]["automountServiceAccountToken"] is False
    pod = ui["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "agentfast-ui"
    bound = [
        s
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for s in d.get("subjects", [])
        if s.get("name") == "agentfast-ui"
    ]
    assert bound == []
    [container] = pod["containers"]
    assert container["command"][:4] == ["agentfast", "ui", "--kube", "--auth=token"]
    assert "--namespace=agentfast" in container["command"] and "--allowed-host=inbox.example.com" in container["command"]
    env = {e["name"]: e for e in container["env"]}
    assert env["AGENTFAST_KUBE_CA_FILE"]["value"] == "/etc/agentfast/kube-ca/ca.crt"
    assert env["AGENTFAST_UI_COOKIE_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "agentfast-ui", "key": "cookieKey"}
    assert env["AGENTFAST_DSN"]["valueFrom"]["secretKeyRef"]["name"]  # transcripts: the operator's DSN Secret
    assert {"name": "kube-ca", "configMap": {"name": "kube-root-ca.crt"}} in pod["volumes"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The bundled Postgres admits the inbox only when it reads transcripts.
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "agentfast-postgresql"]
    components = [
        p["podSelector"]["matchLabels"].get("app.kubernetes.io/component") for p in policy["spec"]["ingress"][0]["from"]
    ]
    assert components == ["operator", "ui", "runner"]
    docs = render(helm, "ui.enabled=true", "ui.transcripts=false")
    [deployment] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-ui"]
    assert "AGENTFAST_DSN" not in {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "agentfast-postgresql"]
    assert len(policy["spec"]["ingress"][0]["from"]) == 2


@pytest.mark.process
def test_mcp_values_reach_the_operator_and_a_runner_pod_as_the_checks_read_them(helm: str) -> None:
    from agentfast.operator.workload import RunnerConfig, build_pod
    from agentfast.runner.errors import SettingError
    from agentfast.runner.spec import mcp_commands_from_env, mcp_env_from_env

    default = _operator_env(render(helm))
    assert mcp_commands_from_env(default) == () and mcp_env_from_env(default) == ()  # nothing unless the admin says
    values = {"mcp": {"allowedCommands": ["python -m orders_mcp", "orders-mcp --stdio"], "allowedEnv": ["ORDERS_REGION", "LANG"]}}
    proc = _render_values(helm, values)
    assert proc.returncode == 0, proc.stderr
    env = _operator_env([d for d in yaml.safe_load_all(proc.stdout) if d])
    commands, names = mcp_commands_from_env(env), mcp_env_from_env(env)
    assert commands == ("python -m orders_mcp", "orders-mcp --stdio") and names == ("ORDERS_REGION", "LANG")
    body = {"apiVersion": "agentfast.dev/v1alpha1", "kind": "AgentRun", "metadata": {"name": "r", "namespace": "a", "uid": "u"}}
    pod = build_pod(body, RunnerConfig.from_env(env), mcp_commands=commands, mcp_env=names)
    pod_env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert mcp_commands_from_env(pod_env) == commands and mcp_env_from_env(pod_env) == names
    # A name that changes what a program loads renders (the schema checks the shape only), and the
    # operator refuses to start with it, naming it.
    proc = _render_values(helm, {"mcp": {"allowedEnv": ["LD_PRELOAD"]}})
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(SettingError, match="mcp.allowedEnv.*'LD_PRELOAD'"):
        mcp_env_from_env(_operator_env([d for d in yaml.safe_load_all(proc.stdout) if d]))
    assert _render_values(helm, {"mcp": {"allowedEnv": ["A-B"]}}).returncode != 0  # not a name: the schema refuses it


# -- the operator's rights (issue 30 item 5) ---------------------------------------------------------

#: The kubernetes client classes the operator calls, and the API group of each.
_API_GROUPS = {
    "CoreV1Api": "",
    "NetworkingV1Api": "networking.k8s.io",
    "AdmissionregistrationV1Api": "admissionregistration.k8s.io",
    "CoordinationV1Api": "coordination.k8s.io",
    "CustomObjectsApi": "agentfast.dev",
}
_VERBS = {
    "read": "get",
    "get": "get",
    "create": "create",
    "replace": "update",
    "patch": "patch",
    "delete": "delete",
    "list": "list",
}
_SCOPED = ("pods", "secrets", "events", "serviceaccounts", "networkpolicies", "agentruns", "agentruns/status", "modelconfigs")


def _operator_calls() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every kubernetes client call in operator/*.py, read from
    the source (``.read_namespaced_secret(`` is get on secrets; a custom object call names its
    plural), and of kopf as the operator's handlers use it: it lists and watches the resources of
    its handlers, patches (annotations, finalizer) those of its change handlers, posts Events."""
    import re

    import kubernetes.client

    calls: set[tuple[str, str, str]] = set()
    plurals = {"PLURAL": "agentruns", "MODELCONFIG_PLURAL": "modelconfigs"}
    for path in sorted((REPO / "operator").glob("*.py")):
        text = path.read_text()
        for m in re.finditer(
            r"\.((read|get|create|replace|patch|delete|list)_(?:namespaced_|cluster_)?(\w+?)(_status)?)[(,]", text
        ):
            name, verb, kind, status = m.groups()
            api = next((a for a in _API_GROUPS if hasattr(getattr(kubernetes.client, a), name)), None)
            if api is None:
                continue  # not a kubernetes call (the store's get_run, ...)
            if kind == "custom_object":
                resource = plurals[re.match(r"[(,]\s*GROUP, VERSION, (?:[^,]+, )?(\w*PLURAL)\b", text[m.end(1) :]).group(1)]
            else:
                resource = kind.replace("_", "")
                resource = resource[:-1] + "ies" if resource.endswith("y") else resource + "s"
            calls.add((_API_GROUPS[api], resource + ("/status" if status else ""), _VERBS[verb]))
        for m in re.finditer(r"@kopf\.on\.(\w+)\((GROUP, VERSION, PLURAL|\"\", \"v1\", \"(\w+)\")", text):
            handler, _, core = m.groups()
            group, resource = ("", core) if core else ("agentfast.dev", "agentruns")
            calls |= {(group, resource, "list"), (group, resource, "watch")}
            if handler in ("create", "update", "resume", "delete"):
                calls.add((group, resource, "patch"))
            calls.add(("", "events", "create"))
    return calls


def _rules(doc: dict) -> set[tuple[str, str, str, str | None]]:
    """(group, resource, verb, the one name it is held to or None) of each right a role grants."""
    return {
        (g, r, v, n)
        for rule in doc.get("rules") or []
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
        for n in rule.get("resourceNames") or [None]
    }


def _named(calls: set[tuple[str, str, str]], lease: str = "agentfast-operator") -> set[tuple[str, str, str, str | None]]:
    """``calls`` as rights: those on the objects the operator names itself (its Secret, its
    runners' ServiceAccount, its Lease) held to that name, but create (RBAC cannot name what does
    not exist yet)."""
    from agentfast.operator.workload import DEFAULT_RUNNER_SERVICE_ACCOUNT, RUNNER_SECRET

    names = {"secrets": RUNNER_SECRET, "serviceaccounts": DEFAULT_RUNNER_SERVICE_ACCOUNT, "leases": lease}
    return {(g, r, v, None if v == "create" else names.get(r)) for g, r, v in calls}


def _operator_roles(docs: list[dict]) -> tuple[set, dict[str, set]]:
    """The operator's ClusterRole rules and its Roles' rules by namespace, each checked bound to
    its ServiceAccount (and only to it)."""
    sa = [{"kind": "ServiceAccount", "name": "agentfast-operator", "namespace": "agentfast"}]
    cluster = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "agentfast-operator")
    roles = {}
    for d in docs:
        if d["kind"] == "Role" and d["metadata"]["name"].startswith("agentfast-operator"):
            roles[d["metadata"]["namespace"]] = roles.get(d["metadata"]["namespace"], set()) | _rules(d)
            binding = next(
                b
                for b in docs
                if b["kind"] == "RoleBinding"
                and b["metadata"]["namespace"] == d["metadata"]["namespace"]
                and b["roleRef"]["name"] == d["metadata"]["name"]
            )
            assert binding["subjects"] == sa and binding["roleRef"]["kind"] == "Role"
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "agentfast-operator")
    assert binding["subjects"] == sa
    return _rules(cluster), roles


CRD_WATCH = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}


@pytest.mark.process
def test_the_operator_is_granted_exactly_the_calls_it_makes_when_it_watches_every_namespace(helm: str) -> None:
    calls = _operator_calls()
    # The reading of the source found the calls it must (a broken reading would pass anything).
    assert {("", "secrets", "delete"), ("", "pods", "create"), ("agentfast.dev", "agentruns/status", "patch")} <= calls
    assert {("agentfast.dev", "modelconfigs", "get"), ("coordination.k8s.io", "leases", "update")} <= calls
    assert ("", "pods", "watch") in calls and ("agentfast.dev", "agentruns", "patch") in calls
    docs = render(helm, "networkPolicy.enabled=true", "runner.serviceAccount.create=true")
    cluster, roles = _operator_roles(docs)
    assert set(roles) == {"agentfast"}  # the leader's Lease only, in the release namespace
    assert roles["agentfast"] == _named({c for c in calls if c[1] == "leases"})
    # Every right granted is a call the code makes (held to the name it uses), and every call is
    # granted; kopf observes CRDs.
    assert cluster | roles["agentfast"] == _named(calls | CRD_WATCH)
    assert ("", "secrets", "get", "agentfast-runner") in cluster and ("", "secrets", "get", None) not in cluster
    # Without the options that make them, no NetworkPolicy or ServiceAccount rights at all.
    cluster, _ = _operator_roles(render(helm))
    assert cluster == _named({c for c in calls | CRD_WATCH if c[1] not in ("networkpolicies", "serviceaccounts", "leases")})


@pytest.mark.process
def test_with_watch_namespaces_the_operator_has_rights_there_only(helm: str) -> None:
    """operator.watchNamespaces: the rights on namespaced resources are a Role in each watched
    namespace; cluster-wide, only reading the approval admission policy (cluster-scoped). No
    Secret, Pod, AgentRun or Event right anywhere else, and no CRD or namespace listing (the
    operator turns kopf's cluster observation off, operator/main.py configure_kopf)."""
    calls = _operator_calls()
    docs = render(
        helm, "operator.watchNamespaces={team-a,team-b}", "networkPolicy.enabled=true", "runner.serviceAccount.create=true"
    )
    cluster, roles = _operator_roles(docs)
    assert cluster == _named({c for c in calls if c[0] == "admissionregistration.k8s.io"})
    assert cluster == {
        ("admissionregistration.k8s.io", "validatingadmissionpolicies", "get", None),
        ("admissionregistration.k8s.io", "validatingadmissionpolicybindings", "list", None),
    }
    assert not {c for c in cluster if c[1] in _SCOPED or c[1] in ("namespaces", "customresourcedefinitions")}
    assert set(roles) == {"team-a", "team-b", "agentfast"}  # the release namespace: its Lease only
    scoped = _named({c for c in calls if c[1] in _SCOPED})
    assert roles["team-a"] == roles["team-b"] == scoped
    assert {("", "secrets", v, "agentfast-runner") for v in ("get", "update", "delete")} | {
        ("", "secrets", "create", None)
    } <= scoped
    assert roles["agentfast"] == _named({c for c in calls if c[1] == "leases"})
    # Together: exactly the calls, nothing more (no CRD watch: scanning is off).
    assert cluster | roles["team-a"] | roles["agentfast"] == _named(calls)
    env = _operator_env(docs)
    assert env["AGENTFAST_WATCH_NAMESPACES"] == "team-a,team-b"
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "agentfast-operator")
    command = op["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--namespace=team-a" in command and "--namespace=team-b" in command and "--all-namespaces" not in command
    # Defaults (no NetworkPolicies, no runner ServiceAccount): the Roles carry neither.
    _, roles = _operator_roles(render(helm, "operator.watchNamespaces={team-a}"))
    assert {c[1] for c in roles["team-a"]} == {"pods", "secrets", "events", "agentruns", "agentruns/status", "modelconfigs"}


@pytest.mark.process
@pytest.mark.parametrize("namespaces", [["team-*"], ["team-a", "team-a"], ["Team-A"], ["a" * 64]])
def test_watch_namespaces_are_exact_names(helm: str, namespaces: list[str]) -> None:
    """A Role is made in each: a glob (kopf would take it as a pattern), a repeated or invalid name is refused."""
    proc = _render_values(helm, {"operator": {"watchNamespaces": namespaces}})
    assert proc.returncode != 0 and "watchNamespaces" in proc.stderr, proc.stdout[-500:]
