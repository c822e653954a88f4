"""A bad AgentRun is rejected by the API server (schema and CEL) with a message naming the field.

Server-side dry runs against the real API server with the agentfast CRD installed.
"""

from __future__ import annotations

import copy
import json
import uuid

import pytest
import yaml

from .helpers import REPO, Kube

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
    ("config and script", lambda s: s["model"].update(config="openai"), "set exactly one of spec.model.config"),
    ("neither config nor script", lambda s: s["model"].pop("script"), "set exactly one of spec.model.config"),
    ("tool without ref", lambda s: s["tools"][0].pop("ref"), "spec.tools[0].ref: Required value"),
    ("tool ref not module:attr", lambda s: s["tools"][0].update(ref="nocolon"), "spec.tools[0].ref"),
    ("duplicate tool names", lambda s: s["tools"].append(dict(s["tools"][0])), "spec.tools[3]: Duplicate value"),
    ("langgraph without graph", lambda s: s.update(adapter="langgraph"), "spec.graph.ref is required"),
    (
        "bad decision",
        lambda s: s.update(approvals={"call-1-0": {"decision": "maybe", "decidedBy": "u"}}),
        "spec.approvals.call-1-0.decision",
    ),
    (
        "deny without reason",
        lambda s: s.update(approvals={"call-1-0": {"decision": "deny", "decidedBy": "u"}}),
        "a deny decision needs a reason",
    ),
    (
        "deny with a blank reason",
        lambda s: s.update(approvals={"call-1-0": {"decision": "deny", "reason": "  ", "decidedBy": "u"}}),
        "a deny decision needs a reason",
    ),
    (
        "complete without result",
        lambda s: s.update(approvals={"call-1-0": {"decision": "complete", "decidedBy": "u"}}),
        "a complete decision needs result",
    ),
    (
        "result on approve",
        lambda s: s.update(approvals={"call-1-0": {"decision": "approve", "result": "{}", "decidedBy": "u"}}),
        "result is given only with decision complete",
    ),
    # issue 12, item 5
    # issue 12, item 4: an AgentRun names a ModelConfig, never a URL, a Secret or a variable.
    # kubectl apply asks the API server for strict field validation: an unknown field is an error
    # (a client that does not ask gets it pruned: test_a_url_or_a_secret_is_never_stored_in_an_agentrun).
    ("model baseURL", lambda s: s["model"].update(baseURL="http://169.254.169.254/v1"), 'unknown field "spec.model.baseURL"'),
    (
        "model apiKeySecretRef",
        lambda s: s["model"].update(apiKeySecretRef={"name": "agentfast-postgres", "key": "dsn"}),
        'unknown field "spec.model.apiKeySecretRef"',
    ),
    ("model apiKeyEnv", lambda s: s["model"].update(apiKeyEnv="LD_PRELOAD"), 'unknown field "spec.model.apiKeyEnv"'),
    ("model timeoutSeconds", lambda s: s["model"].update(timeoutSeconds=5), 'unknown field "spec.model.timeoutSeconds"'),
    ("model maxRetries", lambda s: s["model"].update(maxRetries=0), 'unknown field "spec.model.maxRetries"'),
    (
        "model config not DNS-1123",
        lambda s: (s["model"].pop("script"), s["model"].update(config="Bad_Name")),
        "spec.model.config",
    ),
    ("model config a path", lambda s: (s["model"].pop("script"), s["model"].update(config="../../secrets")), "spec.model.config"),
    ("model name with a space", lambda s: s["model"].update(name="gpt 4"), "spec.model.name"),
    ("model script is a path", lambda s: s["model"].update(script="/dev/zero"), "spec.model.script"),
    ("model script is /etc/passwd", lambda s: s["model"].update(script="/etc/passwd"), "spec.model.script"),
    ("tool ref with a path", lambda s: s["tools"][0].update(ref="../../etc/passwd:x"), "spec.tools[0].ref"),
    ("classifier not a ref", lambda s: s["budget"].update(classifier="os.system('id')"), "spec.budget.classifier"),
    ("max_tokens without bound", lambda s: s["budget"].update(max_tokens=10**12), "spec.budget.max_tokens"),
    ("max_iterations without bound", lambda s: s["budget"].update(max_iterations=10**9), "spec.budget.max_iterations"),
    ("max_duration_ms without bound", lambda s: s["budget"].update(max_duration_ms=10**15), "spec.budget.max_duration_ms"),
    ("temperature without bound", lambda s: s["model"].update(temperature=1e300), "spec.model.temperature"),
    # issue 17 item 5: a cost limit is a positive, bounded amount, and needs prices
    ("zero max_cost", lambda s: s["budget"].update(max_cost=0), "spec.budget.max_cost"),
    ("max_cost without bound", lambda s: s["budget"].update(max_cost=1e12), "spec.budget.max_cost"),
    (
        "max_cost on the scripted model without prices",
        lambda s: s["budget"].update(max_cost=0.5),
        "spec.budget.max_cost needs prices",
    ),
    (
        "prices beside a ModelConfig",
        lambda s: (
            s["model"].pop("script"),
            s["model"].update(config="openai", prices={"promptPerMillionTokens": 1, "completionPerMillionTokens": 2}),
        ),
        "spec.model.prices is only for the scripted model",
    ),
    (
        "pre-approval at creation",
        lambda s: s.update(approvals={"call-2-0": {"decision": "approve", "decidedBy": "u"}}),
        "spec.approvals cannot be set when an AgentRun is created",
    ),
    (
        "decision without decidedBy",
        lambda s: s.update(approvals={"call-2-0": {"decision": "approve"}}),
        "spec.approvals.call-2-0.decidedBy: Required value",
    ),
    (
        "approval key not a call id",
        lambda s: s.update(approvals={"junk": {"decision": "approve", "decidedBy": "u"}}),
        "approval keys are call ids",
    ),
    (
        "approval key too long",
        lambda s: s.update(approvals={"call-" + "1" * 100 + "-0": {"decision": "approve", "decidedBy": "u"}}),
        "approval keys are call ids",
    ),
    ("zero deadline", lambda s: s.update(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds"),
    ("deadline without bound", lambda s: s.update(activeDeadlineSeconds=10**9), "spec.activeDeadlineSeconds"),
    ("cancel not a boolean", lambda s: s.update(cancel="yes"), "spec.cancel"),
    (
        "too many approval keys",
        lambda s: s.update(approvals={f"call-{i}-0": {"decision": "approve", "decidedBy": "u"} for i in range(129)}),
        "spec.approvals: Too many",
    ),
    # issue 30 item 3: an MCP server's env never holds a variable that changes what it loads or runs
    (
        "mcp env LD_PRELOAD",
        lambda s: s.update(mcpServers=[{"name": "o", "command": ["orders-mcp"], "env": {"LD_PRELOAD": "/tmp/x.so"}}]),
        "no run may set a variable that changes what the MCP server loads or runs",
    ),
    (
        "mcp env PATH",
        lambda s: s.update(mcpServers=[{"name": "o", "command": ["orders-mcp"], "env": {"PATH": "/tmp"}}]),
        "no run may set a variable that changes what the MCP server loads or runs",
    ),
    # issue 14 item 7: spec.runner sizes and places the pod, nothing else of it, and is bounded
    (
        "runner securityContext",
        lambda s: s.update(runner={"securityContext": {"privileged": True}}),
        'unknown field "spec.runner.securityContext"',
    ),
    (
        "runner volumes",
        lambda s: s.update(runner={"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}),
        'unknown field "spec.runner.volumes"',
    ),
    (
        "runner serviceAccountName",
        lambda s: s.update(runner={"serviceAccountName": "admin"}),
        'unknown field "spec.runner.serviceAccountName"',
    ),
    ("runner env", lambda s: s.update(runner={"env": [{"name": "LD_PRELOAD", "value": "x"}]}), 'unknown field "spec.runner.env"'),
    (
        "runner resource other than cpu and memory",
        lambda s: s.update(runner={"resources": {"limits": {"nvidia.com/gpu": "8"}}}),
        'unknown field "spec.runner.resources.limits.nvidia.com/gpu"',
    ),
    (
        "runner quantity not a quantity",
        lambda s: s.update(runner={"resources": {"requests": {"cpu": "all"}}}),
        "spec.runner.resources.requests.cpu",
    ),
    ("runner image not a reference", lambda s: s.update(runner={"image": "reg.io/team/../x:1"}), "spec.runner.image"),
    (
        "runner too many node labels",
        lambda s: s.update(runner={"nodeSelector": {f"k{i}": "v" for i in range(33)}}),
        "spec.runner.nodeSelector: Too many",
    ),
    (
        "runner too many tolerations",
        lambda s: s.update(runner={"tolerations": [{"key": f"k{i}"} for i in range(33)]}),
        "spec.runner.tolerations: Too many",
    ),
    (
        "runner toleration of every taint",
        lambda s: s.update(runner={"tolerations": [{"operator": "Exists"}]}),
        "spec.runner.tolerations[0].key: Required value",
    ),
    (
        "runner restates the node-loss toleration",
        lambda s: s.update(runner={"tolerations": [{"key": "node.kubernetes.io/unreachable", "operator": "Exists"}]}),
        "the operator's own tolerations",
    ),
    (
        "runner system priority class",
        lambda s: s.update(runner={"priorityClassName": "system-cluster-critical"}),
        "the system- priority classes",
    ),
    (
        "runner too many affinity terms",
        lambda s: s.update(
            runner={
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "kubernetes.io/hostname"}] * 9
                    }
                }
            }
        ),
        "Too many",
    ),
]


MODELCONFIG = {
    "apiVersion": "agentfast.dev/v1alpha1",
    "kind": "ModelConfig",
    "metadata": {"name": "llm"},
    "spec": {
        "baseURL": "https://api.openai.com/v1",
        "apiKeySecretRef": {"name": "openai-key", "key": "api-key"},
        "models": ["gpt-4o-mini"],
        "timeoutSeconds": 60,
        "maxRetries": 4,
        "maxTokensPerRequest": 4096,
        "prices": {"promptPerMillionTokens": 0.15, "completionPerMillionTokens": 0.6},
    },
}

BAD_MODELCONFIG = [
    ("no baseURL", lambda s: s.pop("baseURL"), "spec.baseURL: Required value"),
    ("baseURL not http", lambda s: s.update(baseURL="file:///etc/passwd"), "spec.baseURL"),
    ("baseURL ftp", lambda s: s.update(baseURL="ftp://models.example/v1"), "spec.baseURL"),
    ("baseURL with user info", lambda s: s.update(baseURL="http://user:pw@models.example/v1"), "spec.baseURL"),
    ("baseURL with a query", lambda s: s.update(baseURL="http://models.example/v1?x=1"), "spec.baseURL"),
    ("baseURL too long", lambda s: s.update(baseURL="https://x/" + "a" * 2048), "spec.baseURL"),
    ("no models", lambda s: s.pop("models"), "spec.models: Required value"),
    ("empty models", lambda s: s.update(models=[]), "spec.models"),
    ("too many models", lambda s: s.update(models=[f"m-{i}" for i in range(65)]), "spec.models: Too many"),
    ("duplicate models", lambda s: s.update(models=["m", "m"]), "spec.models[1]: Duplicate value"),
    ("model name with a space", lambda s: s.update(models=["gpt 4"]), "spec.models[0]"),
    (
        "secret name not DNS-1123",
        lambda s: s.update(apiKeySecretRef={"name": "Bad_Name", "key": "k"}),
        "spec.apiKeySecretRef.name",
    ),
    ("secret key with a slash", lambda s: s.update(apiKeySecretRef={"name": "s", "key": "a/b"}), "spec.apiKeySecretRef.key"),
    ("timeoutSeconds without bound", lambda s: s.update(timeoutSeconds=1e12), "spec.timeoutSeconds"),
    ("maxRetries without bound", lambda s: s.update(maxRetries=10**6), "spec.maxRetries"),
    ("maxTokensPerRequest without bound", lambda s: s.update(maxTokensPerRequest=10**9), "spec.maxTokensPerRequest"),
    ("negative price", lambda s: s["prices"].update(promptPerMillionTokens=-1), "spec.prices.promptPerMillionTokens"),
    (
        "price without bound",
        lambda s: s["prices"].update(completionPerMillionTokens=1e12),
        "spec.prices.completionPerMillionTokens",
    ),
    ("apiKeyEnv", lambda s: s.update(apiKeyEnv="LD_PRELOAD"), 'unknown field "spec.apiKeyEnv"'),
]


@pytest.mark.parametrize("case,mutate,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_agentrun_is_rejected_naming_the_field(kube: Kube, case: str, mutate, expected: str) -> None:
    proc = kube.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(variant(mutate)), check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert expected in proc.stderr, proc.stderr


@pytest.mark.parametrize("case,mutate,expected", BAD_MODELCONFIG, ids=[b[0] for b in BAD_MODELCONFIG])
def test_bad_modelconfig_is_rejected_naming_the_field(kube: Kube, case: str, mutate, expected: str) -> None:
    doc = copy.deepcopy(MODELCONFIG)
    doc["metadata"] = {"name": f"bad-{uuid.uuid4().hex[:6]}"}
    mutate(doc["spec"])
    proc = kube.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert expected in proc.stderr, proc.stderr


def test_a_good_modelconfig_is_accepted_with_its_defaults(kube: Kube) -> None:
    doc = copy.deepcopy(MODELCONFIG)
    for key in ("timeoutSeconds", "maxRetries"):
        doc["spec"].pop(key)
    doc["spec"]["baseURL"] = "http://vllm.models.svc.cluster.local:8000/v1"
    kube.apply(doc)
    got = kube.get("modelconfig", "llm")
    assert (got["spec"]["timeoutSeconds"], got["spec"]["maxRetries"], got["spec"]["prices"]["currency"]) == (60, 4, "USD")
    listed = kube.run("get", "mc").stdout  # the short name and the printer columns
    assert "BASEURL" in listed and "MODELS" in listed and "vllm.models.svc.cluster.local" in listed


def test_a_url_or_a_secret_is_never_stored_in_an_agentrun(kube: Kube) -> None:
    # A client that does not ask for strict field validation (kubectl --validate=false, the Python
    # client's default) is not refused: the API server prunes the unknown fields. Either way no
    # AgentRun object ever holds a URL or a Secret name.
    doc = variant(
        lambda s: s["model"].update(
            baseURL="http://169.254.169.254/v1",
            apiKeySecretRef={"name": "agentfast-postgres", "key": "dsn"},
            apiKeyEnv="LD_PRELOAD",
        )
    )
    # (`kubectl create`, not `apply`: client-side apply keeps the input's text in an annotation,
    # last-applied-configuration, which nothing of agentfast reads.)
    proc = kube.run("create", "--dry-run=server", "--validate=false", "-o", "json", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)
    assert set(stored["spec"]["model"]) == {"name", "script"}, stored["spec"]["model"]
    assert "169.254" not in proc.stdout and "agentfast-postgres" not in proc.stdout


def test_spec_is_immutable(kube: Kube) -> None:
    # Decisions (the one writable part of spec) are tried on runs that really await one:
    # tests/e2e/test_approval_policy.py.
    doc = variant(lambda s: None)
    name = doc["metadata"]["name"]
    kube.apply(doc)
    changed = kube.run("patch", "agentrun", name, "--type", "merge", "-p", '{"spec":{"input":"refund everything"}}', check=False)
    assert changed.returncode != 0 and "spec is immutable after creation" in changed.stderr
    # spec.runner too (issue 14 item 7)
    for runner in (
        {"nodeSelector": {"kubernetes.io/os": "linux"}},
        {"image": "agentfast:dev"},
    ):
        added = kube.run(
            "patch", "agentrun", name, "--type", "merge", "-p", json.dumps({"spec": {"runner": runner}}), check=False
        )
        assert added.returncode != 0 and "spec is immutable after creation" in added.stderr, runner
    explain = kube.run("explain", "agentrun.spec.budget", namespaced=False)
    assert "max_iterations" in explain.stdout and "exceeding one ends the run as" in explain.stdout.replace("\n", " ").replace(
        "  ", " "
    )


def test_the_crd_installs_within_the_cel_cost_budget_and_long_names_are_accepted(kube: Kube) -> None:
    # The CRD above was accepted (its CEL rules' estimated cost is within the API server's
    # budget), and a 253-character AgentRun name is a valid object name.
    doc = variant(lambda s: None)
    doc["metadata"]["name"] = ("n" + uuid.uuid4().hex)[:12] + "-" + "x" * 240
    proc = kube.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode == 0, proc.stderr


def test_cancel_is_a_one_way_switch_and_the_deadline_is_immutable(kube: Kube) -> None:
    doc = variant(lambda s: s.update(activeDeadlineSeconds=3600))
    name = doc["metadata"]["name"]
    kube.apply(doc)

    def patch(spec: str):
        return kube.run("patch", "agentrun", name, "--type", "merge", "-p", '{"spec":%s}' % spec, check=False)

    for spec in ('{"activeDeadlineSeconds":7200}', '{"activeDeadlineSeconds":null}'):
        refused = patch(spec)
        assert (
            refused.returncode != 0
            and "spec is immutable after creation, except spec.approvals, spec.replies and spec.cancel" in refused.stderr
        )
    assert patch('{"cancel":false}').returncode == 0  # false to false: nothing taken back
    assert patch('{"cancel":true}').returncode == 0
    for spec in ('{"cancel":false}', '{"cancel":null}'):
        back = patch(spec)
        assert back.returncode != 0 and "spec.cancel cannot be taken back" in back.stderr, back.stderr
    assert kube.get("agentrun", name)["spec"]["cancel"] is True
    undeadlined = variant(lambda s: None)
    kube.apply(undeadlined)
    added = kube.run(
        "patch",
        "agentrun",
        undeadlined["metadata"]["name"],
        "--type",
        "merge",
        "-p",
        '{"spec":{"activeDeadlineSeconds":60}}',
        check=False,
    )
    assert added.returncode != 0 and "spec is immutable after creation" in added.stderr
