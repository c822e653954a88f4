"""The runner workload of one AgentRun: a Pod that runs ``agentfast resume NAMESPACE/NAME``.

Why bare Pods owned by the operator, not a Job: the Job controller replaces a failed pod only
after its exponential backoff (10 s, 20 s, ... capped at 6 min; measured: 11-12 s for the first
loss, 21 s for the second), although the runner leaves within 0.1 s of SIGTERM and resumes in
about a second. A deleted, evicted or killed runner loses nothing (every iteration is committed,
G1/G2), so there is nothing to back off from: the operator (``operator/lifecycle.py``) creates the
next pod as soon as the last one's runner container has stopped, and backs off only from
failures that would repeat (an OOM kill, a runner that dies at start), up to the restart limit.
One pod per attempt, named ``agentrun-NAME-N``: a retried create of the same attempt gets 409,
never a second runner; the fencing epoch in Postgres covers any overlap anyway (G6).

The pod needs no Kubernetes credentials (no service-account token), runs as non-root with a
read-only root filesystem, and reads the DSN and the model key from Secrets: the key only from the
Secret key the run's ModelConfig names, as ``AGENTFAST_MODEL_API_KEY``; an AgentRun names no
Secret and no variable. The tools' own settings (their databases, their API keys) come from the
namespace's Secret ``agentfast-tools`` (the chart's ``runner.toolSecret``), if there is one,
mounted as files that only the tool host turns into its environment (``runner/toolhost.py``):
the runner's process never has them in its environment, and the tools never see the DSN or the
model key (G11).

With the chart's ``networkPolicy.enabled``, :func:`build_network_policy` gives each runner pod a
NetworkPolicy of its own: no ingress, egress only to DNS, Postgres and the admin's model peers.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from agentfast.runner.spec import MODEL_API_KEY_ENV
from agentfast.runner.toolhost import TOOL_ENV_DIR_ENV

LABEL_RUN = "agentfast.dev/run"
#: The AgentRun's full name on its runner objects (a name over 63 characters does not fit the label).
ANNOTATION_RUN = "agentfast.dev/run-name"
RUNNER_CONTAINER = "runner"
#: The uid of the AgentRun a runner pod serves (a pod of an earlier AgentRun of the same name is not its).
LABEL_RUN_UID = "agentfast.dev/run-uid"
#: On a runner pod: its attempt number (1, 2, ...), failures counted against the restart limit so
#: far, and, on a replacement, when its predecessor was lost (ISO 8601; for the Resumed Event).
ANNOTATION_ATTEMPT = "agentfast.dev/attempt"
ANNOTATION_COUNTED = "agentfast.dev/counted-failures"
ANNOTATION_LOST_AT = "agentfast.dev/replaces-loss-at"
#: Seconds any one Kubernetes API call of the operator may take; then it is given up (the next
#: reconcile or resync tries again), so one hung call never stalls a handler for ever.
API_TIMEOUT_S = 30
#: Seconds a runner pod stays bound to a node that stopped answering before it is evicted.
NODE_LOSS_TOLERATION_S = 20
#: The Secret in a run's namespace holding its runners' DSN (made by operator/credentials.py).
RUNNER_SECRET = "agentfast-runner"
RUNNER_SECRET_KEY = "dsn"
#: Where a runner pod mounts its namespace's tool Secret (read by runner/toolhost.py).
TOOL_ENV_DIR = "/var/run/agentfast/tool-env"


@dataclass(frozen=True)
class RunnerConfig:
    """Operator settings for runner pods, from the environment the chart sets."""

    image: str = "agentfast:dev"
    image_pull_policy: str = "IfNotPresent"
    # The operator's own DSN Secret (release namespace): never mounted in a runner; named here so
    # a ModelConfig cannot name it as a model key.
    dsn_secret: str = "agentfast-postgres"
    dsn_secret_key: str = "dsn"
    # Failures that would repeat (an OOM kill, a runner dying at start), in a row, before the run
    # fails; deletions, evictions, a lost node and a clean "retry me" (75) never count.
    restart_limit: int = 6
    # A run waiting for a human longer than this releases its pod (spec.suspendAfter wins; 0: never), s.
    suspend_after_s: int = 60
    service_account: str = ""
    resources: dict[str, Any] = field(
        default_factory=lambda: {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    )
    termination_grace_s: int = 30
    # The Secret, in each run's namespace, whose keys become the tool host's environment ("": none).
    tool_secret: str = "agentfast-tools"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "RunnerConfig":
        """The settings in ``env`` (default: the process's). Raises ValueError when the tool Secret
        would be a Postgres credential (the runners' or the operator's Secret)."""
        e = dict(os.environ if env is None else env)
        tool_secret = e.get("AGENTFAST_RUNNER_TOOL_SECRET", cls.tool_secret)
        if tool_secret in (RUNNER_SECRET, e.get("AGENTFAST_DSN_SECRET", cls.dsn_secret)):
            raise ValueError(f"AGENTFAST_RUNNER_TOOL_SECRET: {tool_secret!r} is a Postgres credential; tools never receive one")
        return cls(
            image=e.get("AGENTFAST_RUNNER_IMAGE", cls.image),
            image_pull_policy=e.get("AGENTFAST_RUNNER_PULL_POLICY", cls.image_pull_policy),
            dsn_secret=e.get("AGENTFAST_DSN_SECRET", cls.dsn_secret),
            dsn_secret_key=e.get("AGENTFAST_DSN_SECRET_KEY", cls.dsn_secret_key),
            restart_limit=int(e.get("AGENTFAST_RESTART_LIMIT", cls.restart_limit)),
            suspend_after_s=int(e.get("AGENTFAST_SUSPEND_AFTER_SECONDS", cls.suspend_after_s)),
            service_account=e.get("AGENTFAST_RUNNER_SERVICE_ACCOUNT", ""),
            tool_secret=tool_secret,
        )


def _fit63(text: str, key: str) -> str:
    """``text`` if at most 63 characters, else its first 54 (no trailing - or .) plus ``-`` and 8
    hex digits of sha256(``key``): deterministic, distinct for distinct keys, a valid DNS label
    and label value (begins and ends alphanumeric)."""
    if len(text) <= 63:
        return text
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return f"{text[:54].rstrip('-.')}-{digest}"


def runner_name(run_name: str) -> str:
    """The base name of a run's runner objects (its NetworkPolicy; its pods add ``-N``), ≤ 63
    chars: AgentRun names may be up to 253 characters, so a long one is cut and made unique with
    a hash of the whole name."""
    return _fit63(f"agentrun-{run_name}", run_name)


def pod_name(run_name: str, attempt: int) -> str:
    """The name of attempt ``attempt`` (1, 2, ...) of the run's runner pod: deterministic, so a
    create retried after the operator died mid-reconcile gets 409, never a second runner."""
    return f"{runner_name(run_name)}-{attempt}"


def run_label(run_name: str) -> str:
    """The value of the ``agentfast.dev/run`` label: the AgentRun's name when it fits a label
    value (63 characters), else a cut of it plus a hash of the whole (the annotation
    ``agentfast.dev/run-name`` always holds the full name)."""
    return _fit63(run_name, run_name)


def build_pod(body: dict[str, Any], cfg: RunnerConfig, *, attempt: int = 1, counted_failures: int = 0, lost_at: str | None = None,
              allowed_modules: tuple[str, ...] = (), model_key: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest of attempt ``attempt`` of the runner pod of an AgentRun ``body`` (the
    ownerReference is added by kopf.adopt). ``counted_failures`` and ``lost_at`` are carried in
    its annotations (operator/lifecycle.py reads them back from the latest pod).

    ``allowed_modules`` reaches the runner as ``AGENTFAST_ALLOWED_MODULES``: the runner checks
    the refs against it again before importing anything. ``model_key`` is the ``apiKeySecretRef``
    (``{"name", "key"}``) of the ModelConfig the run was registered with, or None (the scripted
    model, an endpoint without a key): that one Secret key, and no other, becomes
    ``AGENTFAST_MODEL_API_KEY``, a fixed name of ours; nothing in the AgentRun's spec reaches the
    environment. Raises ValueError when ``model_key`` is the DSN's Secret key itself."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    env: list[dict[str, Any]] = [
        # The namespace's runner credential (operator/credentials.py), never the operator's DSN.
        {"name": "AGENTFAST_DSN", "valueFrom": {"secretKeyRef": {"name": RUNNER_SECRET, "key": RUNNER_SECRET_KEY}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "AGENTFAST_LOG_LEVEL", "value": "INFO"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "AGENTFAST_ALLOWED_MODULES", "value": ",".join(allowed_modules)},
        # A run waiting for a human longer than this commits, exits 0 and frees its pod (spec.suspendAfter wins).
        {"name": "AGENTFAST_SUSPEND_AFTER_SECONDS", "value": str(suspend_after_s(body, cfg))},
    ]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if cfg.tool_secret:
        # optional: a namespace whose tools need no settings has no such Secret, and its runs start all the same
        env.append({"name": TOOL_ENV_DIR_ENV, "value": TOOL_ENV_DIR})
        mounts.append({"name": "tool-env", "mountPath": TOOL_ENV_DIR, "readOnly": True})
        volumes.append({"name": "tool-env", "secret": {"secretName": cfg.tool_secret, "optional": True}})
    if model_key is not None:
        if (model_key["name"], model_key["key"]) == (cfg.dsn_secret, cfg.dsn_secret_key) or model_key["name"] == RUNNER_SECRET:
            raise ValueError(f"the model key would be a Postgres credential (Secret {model_key['name']!r}, key {model_key['key']!r})")
        env.append({"name": MODEL_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": model_key["name"], "key": model_key["key"]}}})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": cfg.termination_grace_s,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        # A lost node's pods are evicted after 20 s instead of the default 300 s; the operator
        # replaces a pod once its deletion deadline passes, even if the kubelet never confirms (G6
        # fences a runner that is in fact still alive there).
        "tolerations": [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": NODE_LOSS_TOLERATION_S}
                        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")],
        "containers": [
            {
                "name": RUNNER_CONTAINER,
                "image": cfg.image,
                "imagePullPolicy": cfg.image_pull_policy,
                "command": ["agentfast", "resume", f"{namespace}/{name}"],
                "env": env,
                "resources": cfg.resources,
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if cfg.service_account:
        pod_spec["serviceAccountName"] = cfg.service_account
    pod_meta = _runner_object_meta(name, namespace)
    pod_meta["name"] = pod_name(name, attempt)
    pod_meta["labels"][LABEL_RUN_UID] = meta["uid"]
    pod_meta["annotations"].update({ANNOTATION_ATTEMPT: str(attempt), ANNOTATION_COUNTED: str(counted_failures)})
    if lost_at:
        pod_meta["annotations"][ANNOTATION_LOST_AT] = lost_at
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": pod_spec}


def suspend_after_s(body: dict[str, Any], cfg: RunnerConfig) -> int:
    """How long the run's runner waits for a human before it releases its pod, s: the AgentRun's
    ``spec.suspendAfter``, else the chart's ``runner.suspendAfterSeconds``; 0: never."""
    value = (body.get("spec") or {}).get("suspendAfter")
    return cfg.suspend_after_s if value is None else int(value)


#: Egress to the cluster DNS when the admin gives none: kube-system, port 53 over UDP and TCP.
DEFAULT_DNS_EGRESS: tuple[dict[str, Any], ...] = (
    {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}],
     "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
)
_RULE_KEYS = {"to", "ports"}
_PEER_KEYS = {"ipBlock", "namespaceSelector", "podSelector"}
_PORT_KEYS = {"port", "endPort", "protocol"}


@dataclass(frozen=True)
class EgressPolicy:
    """Where runner pods may connect when the chart enables ``networkPolicy``: NetworkPolicy egress
    rules (``{"to": [peers], "ports": [ports]}``, the Kubernetes shape: a NetworkPolicy names pods,
    namespaces and IP blocks, never host names) for DNS, Postgres and the model endpoints."""

    dns: tuple[dict[str, Any], ...] = DEFAULT_DNS_EGRESS
    postgres: tuple[dict[str, Any], ...] = ()
    model: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "EgressPolicy | None":
        """The policy in ``AGENTFAST_NETWORK_POLICY`` (JSON ``{"dns": [...], "postgres": [...],
        "model": [...]}``, set by the chart when ``networkPolicy.enabled``), or None when unset or
        empty (no NetworkPolicy). Raises ValueError on a malformed value or no Postgres rule (every
        runner would be cut off from its store)."""
        raw = (os.environ if env is None else env).get("AGENTFAST_NETWORK_POLICY", "").strip()
        if not raw:
            return None
        try:
            doc = json.loads(raw)
        except ValueError as err:
            raise ValueError(f"AGENTFAST_NETWORK_POLICY is not JSON: {err}") from None
        if not isinstance(doc, dict) or set(doc) - {"dns", "postgres", "model"}:
            raise ValueError("AGENTFAST_NETWORK_POLICY must be an object with keys dns, postgres, model")
        parts = {k: tuple(_check_rules(doc.get(k) or [], k)) for k in ("dns", "postgres", "model")}
        if not parts["postgres"]:
            raise ValueError("AGENTFAST_NETWORK_POLICY has no postgres rule: runners could not reach their store (networkPolicy.postgresEgress)")
        return cls(dns=parts["dns"] or DEFAULT_DNS_EGRESS, postgres=parts["postgres"], model=parts["model"])


def _check_rules(rules: Any, where: str) -> list[dict[str, Any]]:
    """``rules`` if it is a list of egress rules with only the keys a NetworkPolicy knows (the API
    server checks the rest); raises ValueError naming ``where`` otherwise."""
    if not isinstance(rules, list):
        raise ValueError(f"AGENTFAST_NETWORK_POLICY.{where}: expected a list of egress rules")
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or set(rule) - _RULE_KEYS:
            raise ValueError(f"AGENTFAST_NETWORK_POLICY.{where}[{i}]: an egress rule has only 'to' and 'ports'")
        for peer in rule.get("to") or []:
            if not isinstance(peer, dict) or not peer or set(peer) - _PEER_KEYS:
                raise ValueError(f"AGENTFAST_NETWORK_POLICY.{where}[{i}].to: a peer has ipBlock, namespaceSelector or podSelector")
        for port in rule.get("ports") or []:
            if not isinstance(port, dict) or set(port) - _PORT_KEYS:
                raise ValueError(f"AGENTFAST_NETWORK_POLICY.{where}[{i}].ports: a port has port, endPort, protocol")
    return rules


def _runner_object_meta(name: str, namespace: str) -> dict[str, Any]:
    """Metadata of the objects made for one AgentRun's runner (its pods, its NetworkPolicy): the
    base name, the run label (cut with a hash past 63 characters) and the full name in an
    annotation."""
    return {
        "name": runner_name(name),
        "namespace": namespace,
        "labels": {LABEL_RUN: run_label(name), "app.kubernetes.io/managed-by": "agentfast", "app.kubernetes.io/component": "runner"},
        "annotations": {ANNOTATION_RUN: name},
    }


def build_network_policy(body: dict[str, Any], policy: EgressPolicy) -> dict[str, Any]:
    """The NetworkPolicy of one AgentRun's runner pods (ownerReference added by kopf.adopt, like
    the pods'): it selects them by their labels, allows no ingress, and allows egress only
    by ``policy``'s rules, DNS first, then Postgres, then the model endpoints. A pod running the
    scripted model talks to it over loopback, which no NetworkPolicy filters."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _runner_object_meta(name, namespace),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_RUN: run_label(name), "app.kubernetes.io/component": "runner"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [*policy.dns, *policy.postgres, *policy.model],
        },
    }
