"""Issue 12 item 4 on a real cluster with the chart installed: a run's model endpoint and key are an
admin's ModelConfig, never the AgentRun's.

A scripted model server runs in the cluster from the project image (a Deployment and a Service:
``python -m agentfast.testing.scripted --require-key-env MODEL_KEY``) and answers only requests
carrying the key of a Secret. An admin's ModelConfig points at it and names that Secret key.

- An AgentRun naming the ModelConfig runs to completion (the refund approved as in
  test_operator.py); its runner pods mount exactly one Secret key besides the DSN, the
  ModelConfig's, as AGENTFAST_MODEL_API_KEY; the run's registered document in Postgres holds the
  resolved endpoint and the Secret's name, never its value.
- An AgentRun naming a ModelConfig that does not exist stays Pending (reason
  ModelConfigNotFound) without a runner, and starts once the ModelConfig is created (the
  operator's periodic resync, 30 s in the chart's default).
- A model name the ModelConfig does not allow ends the run Failed/InvalidSpec, naming both.
- A ModelConfig naming a Secret the namespace does not have: the runner pod waits in
  CreateContainerConfigError, which status (reason, message, condition RunnerPodReady) and
  ``kubectl get agentruns`` (the REASON column) show within seconds; once the Secret exists the
  kubelet starts that same pod, the run completes and the condition clears (issue 14 item 6).
- The NetworkPolicy the operator gives a runner pod (networkPolicy.enabled) is accepted by the
  API server (whether it is enforced depends on the CNI; the test cluster's bridge CNI does not).

Runs in the chart's namespace (AGENTFAST_NAMESPACE), where runner pods find the DSN Secret.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from .helpers import REPO, Kube, apply_http_server
from .test_operator import E2E_LABEL, NAMESPACE, approve, release, runner_pods, sql, status  # noqa: F401 (release is a fixture)

KEY_VALUE_PREFIX = "sk-e2e-"
SERVER_PORT = 8080


def _labels(tag: str) -> dict[str, str]:
    return {E2E_LABEL: "true", "agentfast.dev/e2e-model": tag}


@pytest.fixture
def model_server(release: Kube) -> Iterator[dict[str, str]]:
    """The scripted refund model served in the cluster, answering only with its Secret's key
    (:func:`serve_scripted_model`)."""
    with serve_scripted_model(release) as server:
        yield server


@contextlib.contextmanager
def serve_scripted_model(k: Kube, script: str | None = None) -> Iterator[dict[str, str]]:
    """A scripted model served in the cluster from the testing image (a Deployment and a Service),
    answering only with its Secret's key, as a remote model would. It plays the bundled refund
    script, or ``script`` (a script's YAML text, mounted from a ConfigMap).

    Yields ``{"tag", "secret", "key", "key_value", "deployment", "url"}``: ``secret``/``key`` name
    the Secret key holding the API key (value ``key_value``), ``url`` is the base URL a
    ModelConfig points at. Deletes what it made (and what carries its tag) on exit.
    """
    tag = uuid.uuid4().hex[:6]
    name, secret = f"scripted-model-{tag}", f"model-key-{tag}"
    key_value = KEY_VALUE_PREFIX + uuid.uuid4().hex
    k.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": secret, "namespace": k.namespace, "labels": _labels(tag)},
            "type": "Opaque",
            "stringData": {"api-key": key_value},
        }
    )
    script_arg, mounts, volumes = "refund", [], []
    if script is not None:
        k.apply(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": k.namespace, "labels": _labels(tag)},
                "data": {"script.yaml": script},
            }
        )
        script_arg = "/scripts/script.yaml"
        mounts = [{"name": "script", "mountPath": "/scripts", "readOnly": True}]
        volumes = [{"name": "script", "configMap": {"name": name}}]
    apply_http_server(
        k,
        name,
        labels=_labels(tag),
        pod_labels={"app.kubernetes.io/name": name, **_labels(tag)},
        container="model",
        command=[
            "python",
            "-m",
            "agentfast.testing.scripted",
            "--script",
            script_arg,
            "--host",
            "0.0.0.0",
            "--port",
            str(SERVER_PORT),
            "--require-key-env",
            "MODEL_KEY",
        ],
        env=[{"name": "MODEL_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": "api-key"}}}],
        port=SERVER_PORT,
        mounts=mounts,
        volumes=volumes,
    )
    try:
        k.run("rollout", "status", f"deploy/{name}", "--timeout=180s", timeout=200)
        yield {
            "tag": tag,
            "secret": secret,
            "key": "api-key",
            "key_value": key_value,
            "deployment": name,
            "url": f"http://{name}.{k.namespace}.svc:{SERVER_PORT}/v1",
        }
    finally:
        for kind in ("agentrun", "modelconfig", "service", "deployment", "configmap", "secret"):
            k.run("delete", kind, "-l", f"agentfast.dev/e2e-model={tag}", "--wait=false", check=False)


def modelconfig(k: Kube, server: dict[str, str], name: str, models: list[str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "ModelConfig",
        "metadata": {"name": name, "namespace": k.namespace, "labels": _labels(server["tag"])},
        "spec": {
            "baseURL": server["url"],
            "apiKeySecretRef": {"name": server["secret"], "key": server["key"]},
            "models": models or ["scripted-refund"],
            "timeoutSeconds": 30,
            "maxRetries": 2,
            "prices": {"promptPerMillionTokens": 1.0, "completionPerMillionTokens": 2.0},
        },
    }


def agentrun(k: Kube, server: dict[str, str], name: str, config: str, model: str = "scripted-refund") -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": k.namespace, "labels": _labels(server["tag"])}
    doc["spec"]["model"] = {"name": model, "config": config}
    return doc


def _condition(k: Kube, name: str, ctype: str) -> dict[str, Any]:
    return {c["type"]: c for c in status(k, name).get("conditions") or []}.get(ctype, {})


def _pod(k: Kube, name: str) -> dict[str, Any] | None:
    """The run's first runner pod (attempt 1), or None."""
    items = sorted(runner_pods(k, name), key=lambda p: int(p["metadata"]["annotations"]["agentfast.dev/attempt"]))
    return items[0] if items else None


def _finish(k: Kube, name: str) -> dict[str, Any]:
    """Wait for the refund's approval, approve it, and wait for the run to succeed."""
    k.wait_for(
        f"{name} to wait for approval", lambda: status(k, name).get("phase") in ("WaitingForApproval", "Failed"), timeout=240
    )
    st = status(k, name)
    assert st["phase"] == "WaitingForApproval" and st["awaiting"] == "call-2-0", st
    approve(k, name, "call-2-0")
    k.wait_for(f"{name} to end", lambda: status(k, name).get("phase") in ("Succeeded", "Failed"), timeout=180)
    st = status(k, name)
    assert st["phase"] == "Succeeded" and st["iteration"] == 3, st
    return st


def test_a_run_uses_its_model_configs_endpoint_and_only_its_key(release: Kube, model_server: dict[str, str]) -> None:
    k, server = release, model_server
    # The in-cluster model refuses a request without the key (so a Succeeded run proves the key reached it).
    probe = (
        "import urllib.request,urllib.error\n"
        f"try: urllib.request.urlopen('http://127.0.0.1:{SERVER_PORT}/v1/models', timeout=5); print(200)\n"
        "except urllib.error.HTTPError as e: print(e.code)\n"
    )
    assert k.run("exec", f"deploy/{server['deployment']}", "--", "python", "-c", probe).stdout.strip() == "401"
    config = f"llm-{server['tag']}"
    k.apply(modelconfig(k, server, config))
    name = f"mc-run-{server['tag']}"
    k.apply(agentrun(k, server, name, config))
    st = _finish(k, name)
    # issue 17 item 5: usage and the cost at the ModelConfig's prices (1 and 2 per million) survive
    # the structural schema's pruning, and the COST column (priority 1) shows with -o wide
    usage = st["usage"]
    assert usage["totalTokens"] == st["tokensUsed"] == usage["promptTokens"] + usage["completionTokens"] > 0, st
    expected = round((usage["promptTokens"] * 1.0 + usage["completionTokens"] * 2.0) / 1_000_000, 6)
    assert st["cost"]["currency"] == "USD" and st["cost"]["amount"] == pytest.approx(expected), st
    header, row = k.run("get", "agentrun", name, "-o", "wide").stdout.splitlines()[:2]
    assert "COST" in header.split() and any(_is_amount(cell, expected) for cell in row.split()), (header, row)

    for pod in runner_pods(k, name):  # what every runner pod of the run ran with
        [container] = pod["spec"]["containers"]
        secret_refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in (e.get("valueFrom") or {})
        }
        assert secret_refs.pop("AGENTFAST_MODEL_API_KEY") == {"name": server["secret"], "key": server["key"]}
        assert list(secret_refs) == ["AGENTFAST_DSN"], secret_refs  # no other Secret reaches the runner's environment
        # the one Secret volume: the tools' own settings, for the tool host only (G11)
        secrets = [v["secret"]["secretName"] for v in pod["spec"].get("volumes") or [] if "secret" in v]
        assert not container.get("envFrom") and secrets == ["agentfast-tools"], secrets

    [[registered]] = sql(k, "SELECT spec FROM agentfast_runs WHERE run_id = %s", f"{k.namespace}/{name}")
    registered = registered if isinstance(registered, dict) else json.loads(registered)
    mc = registered["modelConfig"]
    assert mc["name"] == config and mc["baseURL"] == server["url"] and mc["maxRetries"] == 2 and mc["resourceVersion"]
    assert mc["apiKeySecretRef"] == {"name": server["secret"], "key": server["key"]}
    assert server["key_value"] not in json.dumps(registered)  # the operator never read the Secret
    assert "modelConfig" not in (k.get("agentrun", name) or {})  # nor copied anything into the AgentRun


def test_a_missing_model_config_keeps_the_run_pending_until_it_exists(release: Kube, model_server: dict[str, str]) -> None:
    k, server = release, model_server
    config = f"later-{server['tag']}"
    name = f"mc-later-{server['tag']}"
    k.apply(agentrun(k, server, name, config))
    k.wait_for(
        "Pending with reason ModelConfigNotFound",
        lambda: (
            status(k, name).get("phase") == "Pending"
            and _condition(k, name, "Progressing").get("reason") == "ModelConfigNotFound"
        ),
        timeout=60,
    )
    st = status(k, name)
    assert config in st["message"] and "does not exist" in st["message"], st
    assert _pod(k, name) is None and runner_pods(k, name) == []
    k.apply(modelconfig(k, server, config))
    _finish(k, name)  # the resync (30 s) finds the ModelConfig; the run starts and completes


def test_a_model_the_config_does_not_allow_fails_the_run(release: Kube, model_server: dict[str, str]) -> None:
    k, server = release, model_server
    config = f"narrow-{server['tag']}"
    k.apply(modelconfig(k, server, config, models=["scripted-refund"]))
    name = f"mc-other-model-{server['tag']}"
    k.apply(agentrun(k, server, name, config, model="gpt-4o"))
    k.wait_for("Failed", lambda: status(k, name).get("phase") == "Failed", timeout=60)
    st = status(k, name)
    assert _condition(k, name, "Failed").get("reason") == "InvalidSpec", st
    assert "spec.model.name" in st["message"] and "'gpt-4o'" in st["message"] and config in st["message"], st
    assert _pod(k, name) is None


def test_the_runner_network_policy_is_accepted_by_the_api_server(release: Kube) -> None:
    # What the operator creates per runner pod with networkPolicy.enabled and the bundled Postgres
    # (the chart's default rules), checked by the real API server (a dry run: nothing is created).
    from agentfast.operator.workload import EgressPolicy, build_network_policy

    k = release
    rules = {
        "postgres": [
            {
                "to": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "postgresql"}},
                    }
                ],
                "ports": [{"protocol": "TCP", "port": 5432}],
            }
        ],
        "model": [
            {
                "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}],
                "ports": [{"protocol": "TCP", "port": 443}],
            }
        ],
    }
    policy = EgressPolicy.from_env({"AGENTFAST_NETWORK_POLICY": json.dumps(rules)})
    body = {"metadata": {"name": f"np-{uuid.uuid4().hex[:6]}-" + "x" * 240, "namespace": k.namespace}}
    proc = k.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(build_network_policy(body, policy)), check=False)
    assert proc.returncode == 0, proc.stderr


def _is_amount(cell: str, amount: float) -> bool:
    try:
        return float(cell) == pytest.approx(amount)
    except ValueError:
        return False


def _get_agentruns_row(k: Kube, name: str) -> dict[str, str]:
    """The row ``kubectl get agentruns`` prints for ``name``, by column header (the CRD's printer
    columns; only the columns before the first empty one line up, NAME, PHASE and REASON among them)."""
    header, *rows = k.run("get", "agentruns").stdout.splitlines()
    row = next(r for r in rows if r.split()[0] == name)
    return dict(zip(header.split(), row.split()))


def test_a_runner_that_cannot_start_says_why_until_its_secret_exists(release: Kube, model_server: dict[str, str]) -> None:
    # Issue 14 item 6: the ModelConfig names a Secret the namespace does not have (yet). The runner
    # pod waits in CreateContainerConfigError; status says so at once (reason, message, condition
    # RunnerPodReady False), not "waiting for the runner pod to start" for ever, and so does
    # `kubectl get agentruns`. Once an admin creates the Secret the kubelet starts the same pod,
    # the run goes on and the condition clears.
    k, server = release, model_server
    tag = server["tag"]
    late = f"late-key-{tag}"
    mc = modelconfig(k, server, f"late-secret-{tag}")
    mc["spec"]["apiKeySecretRef"] = {"name": late, "key": server["key"]}
    k.apply(mc)
    name = f"mc-no-secret-{tag}"
    k.apply(agentrun(k, server, name, mc["metadata"]["name"]))
    started = time.monotonic()
    k.wait_for(
        "the reason the runner cannot start",
        lambda: status(k, name).get("reason") == "CreateContainerConfigError",
        timeout=90,
        interval=0.5,
    )
    print(f"status said CreateContainerConfigError {time.monotonic() - started:.1f} s after the AgentRun was applied")
    st = status(k, name)
    pod = _pod(k, name)
    assert pod is not None and pod["metadata"]["name"] in st["message"], (st, pod)
    assert st["phase"] == "Pending" and "cannot start" in st["message"] and late in st["message"], st
    assert st["message"] != "waiting for the runner pod to start"
    ready = _condition(k, name, "RunnerPodReady")
    assert ready["status"] == "False" and ready["reason"] == "CreateContainerConfigError" and late in ready["message"], ready
    assert ready["observedGeneration"] == k.get("agentrun", name)["metadata"]["generation"]
    row = _get_agentruns_row(k, name)
    assert (row["PHASE"], row["REASON"]) == ("Pending", "CreateContainerConfigError"), row
    # It stays blocked (and says so) rather than failing the run or looping through pods.
    time.sleep(10)
    assert status(k, name).get("reason") == "CreateContainerConfigError" and len(runner_pods(k, name)) == 1

    k.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": late, "namespace": k.namespace, "labels": _labels(tag)},
            "type": "Opaque",
            "stringData": {server["key"]: server["key_value"]},
        }
    )
    k.wait_for(
        "the run to go on once the Secret exists",
        lambda: status(k, name).get("phase") in ("Running", "WaitingForApproval", "Succeeded", "Failed"),
        timeout=180,
        interval=1,
    )
    k.wait_for("the condition to clear", lambda: _condition(k, name, "RunnerPodReady").get("status") == "True", timeout=60)
    assert _condition(k, name, "RunnerPodReady")["reason"] == "RunnerPodOK"
    assert status(k, name).get("reason") != "CreateContainerConfigError"
    assert _get_agentruns_row(k, name)["REASON"] != "CreateContainerConfigError"
    st = _finish(k, name)
    assert st.get("restarts", 0) == 0, st  # the kubelet started the same pod: no replacement was needed
    [only] = runner_pods(k, name)
    assert only["metadata"]["name"] == pod["metadata"]["name"]
