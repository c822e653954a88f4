"""What the cluster tier's tests share that is not a fixture: :class:`Kube` (kubectl against the
cluster from ``KUBECONFIG``, in one namespace), where the chart is installed, and the example
tools' Secret. Fixtures and hooks are in tests/e2e/conftest.py.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..helpers import CACHE

REPO = Path(__file__).resolve().parents[2]
#: Where the chart is installed (hack/cluster/e2e.sh, hack/kind-e2e.sh).
NAMESPACE = os.environ.get("AGENTFAST_NAMESPACE", "agentfast-system")


def find_kubectl() -> str:
    explicit = os.environ.get("KUBECTL")
    if explicit:
        return explicit
    on_path = shutil.which("kubectl")
    if on_path:
        return on_path
    built = sorted(glob.glob(str(CACHE / "k8s-bin" / "*" / "kubectl")))
    if built:
        return built[-1]
    pytest.fail(
        "kubectl not found: set KUBECTL, put kubectl on PATH, or run hack/cluster/build.sh",
        pytrace=False,
    )


class Kube:
    """kubectl against the cluster of KUBECONFIG, in one throwaway namespace."""

    def __init__(self, kubectl: str, kubeconfig: str, namespace: str) -> None:
        self.kubectl = kubectl
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.image = os.environ.get("AGENTFAST_IMAGE", "agentfast-testing:dev")

    def run(
        self, *args: str, input: str | None = None, check: bool = True, namespaced: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        cmd = [self.kubectl, "--kubeconfig", self.kubeconfig]
        if namespaced:
            cmd += ["-n", self.namespace]
        cmd += list(args)
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}")
        return proc

    def logs(self, pod: str, timeout: float = 60) -> str:
        """``kubectl logs POD``, once the kubelet has reported its container started.

        A run's status comes from Postgres (the runner writes it, the operator reads it), so it
        can say the run ended before the kubelet's next pod status update still shows the
        container as ``ContainerCreating``; kubectl refuses logs until then."""

        def fetched() -> subprocess.CompletedProcess[str] | None:
            proc = self.run("logs", pod, check=False)
            return proc if proc.returncode == 0 else None

        return self.wait_for(f"pod {pod}'s log", fetched, timeout=timeout, interval=1).stdout

    def whoami(self) -> str:
        """The user name the API server authenticates this kubeconfig as (``kubectl auth whoami``)."""
        return self.run("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}", namespaced=False).stdout.strip()

    def apply(self, obj: dict[str, Any]) -> None:
        self.run("apply", "-f", "-", input=json.dumps(obj))

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        proc = self.run("get", kind, name, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(f"kubectl get {kind} {name}: {proc.stderr}")
        return json.loads(proc.stdout)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 120, interval: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        # The cluster's side of the story is attached to the report by pytest_runtest_makereport.
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")

    def diagnostics(self) -> str:
        """What a person would look at when a wait times out, as one text for the CI log.

        The operator's last log lines (and its previous container's, after a crash), every
        AgentRun's status in this namespace, ``describe`` of the runner pods, the last
        runner logs and the namespace's recent Events. Best effort: a section that cannot be
        read says why instead of raising.
        """
        sections: list[tuple[str, tuple[str, ...], bool]] = [
            (
                "operator log (last 60 lines)",
                ("logs", "-l", "app.kubernetes.io/component=operator", "--tail=60", "--all-containers", "--prefix"),
                False,
            ),
            (
                "operator log, previous container",
                ("logs", "-l", "app.kubernetes.io/component=operator", "--tail=30", "--previous", "--prefix"),
                False,
            ),
            ("AgentRuns", ("get", "agentruns", "-o", "custom-columns=NAME:.metadata.name,STATUS:.status", "--no-headers"), True),
            ("runner pods", ("describe", "pods", "-l", "app.kubernetes.io/component=runner"), True),
            (
                "runner logs (last 30 lines each)",
                ("logs", "-l", "app.kubernetes.io/component=runner", "--tail=30", "--prefix", "--max-log-requests=10"),
                True,
            ),
            ("recent Events", ("get", "events", "--sort-by=.lastTimestamp"), True),
        ]
        out = [f"--- diagnostics: namespace {self.namespace} ---"]
        operator_ns = os.environ.get("AGENTFAST_NAMESPACE", "agentfast-system")
        for title, args, here in sections:
            cmd = [self.kubectl, "--kubeconfig", self.kubeconfig, "-n", self.namespace if here else operator_ns, *args]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                text = (proc.stdout or proc.stderr).strip() or "(nothing)"
            except (OSError, subprocess.SubprocessError) as e:
                text = f"(could not run kubectl: {e})"
            lines = text.splitlines()
            if len(lines) > 80:
                lines = [f"... {len(lines) - 80} earlier lines left out"] + lines[-80:]
            out.append(f"## {title}\n" + "\n".join(lines))
        return "\n".join(out)

    def pod_phase(self, name: str) -> str | None:
        pod = self.get("pod", name)
        return None if pod is None else pod.get("status", {}).get("phase")

    def describe(self, kind: str, name: str) -> str:
        return self.run("describe", kind, name, check=False).stdout


#: The label of everything the suite makes, so a failed test's leftovers can be found and removed.
E2E_LABEL = "agentfast.dev/e2e"


def python_in_pod(
    k: Kube,
    name: str,
    code: str,
    *,
    namespace: str | None = None,
    image: str | None = None,
    env: list[dict[str, Any]] | None = None,
    timeout: float = 120,
) -> str:
    """Run ``code`` with python in a pod of ``image`` (default: the chart's, ``k.image``) in
    ``namespace`` (default ``k``'s), as the restricted Pod Security profile allows, with ``env``
    (container env entries); wait for it to end and return its log. The pod is left (labelled
    :data:`E2E_LABEL`) for the namespace's cleanup."""
    namespace = namespace or k.namespace
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {E2E_LABEL: "true"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "probe",
                    "image": image or k.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", code],
                    "env": env or [],
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }
    k.run("apply", "-f", "-", input=json.dumps(pod), namespaced=False)
    k.wait_for(
        f"pod {name} to finish",
        lambda: (
            k.run("get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}", namespaced=False).stdout
            in ("Succeeded", "Failed")
        ),
        timeout=timeout,
        interval=1,
    )
    return k.run("logs", name, "-n", namespace, namespaced=False).stdout


def apply_http_server(
    k: Kube,
    name: str,
    *,
    labels: dict[str, str],
    pod_labels: dict[str, str],
    container: str,
    command: list[str],
    env: list[dict[str, Any]],
    port: int,
    mounts: list[dict[str, Any]] | None = None,
    volumes: list[dict[str, Any]] | None = None,
) -> None:
    """A test's HTTP server in ``k``'s namespace: a Deployment of one container of the chart's
    image running ``command`` (``env``: container env entries), serving on ``port`` (ready when it
    accepts connections), locked down as the restricted Pod Security profile asks (non-root, read-only
    root filesystem with /tmp an emptyDir, no capabilities, no service account token), and a
    Service ``name`` in front of it. ``pod_labels`` must hold ``app.kubernetes.io/name: name``
    (the selector); ``labels`` go on the Deployment and the Service."""
    k.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": k.namespace, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                "template": {
                    "metadata": {"labels": pod_labels},
                    "spec": {
                        "automountServiceAccountToken": False,
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 10001,
                            "runAsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": container,
                                "image": k.image,
                                "imagePullPolicy": "IfNotPresent",
                                "command": command,
                                "env": [*env, {"name": "HOME", "value": "/tmp"}],
                                "ports": [{"name": "http", "containerPort": port}],
                                "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 2},
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *(mounts or [])],
                            }
                        ],
                        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}, *(volumes or [])],
                    },
                },
            },
        }
    )
    k.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": k.namespace, "labels": labels},
            "spec": {
                "selector": {"app.kubernetes.io/name": name},
                "ports": [{"name": "http", "port": port, "targetPort": "http"}],
            },
        }
    )


def give_example_tools(k: Kube, examples_dsn: str) -> None:
    """The Secret agentfast-tools in ``k``'s namespace, as a team gives its tools their settings:
    the example tools' DSN (the operator mounts it for the tool host only)."""
    k.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "agentfast-tools", "namespace": k.namespace},
            "stringData": {"EXAMPLE_TOOLS_DSN": examples_dsn},
        }
    )
