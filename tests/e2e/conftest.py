"""Fixtures for the cluster tier: a real Kubernetes cluster, taken from ``KUBECONFIG``.

The suite does not care which provider made the cluster: ``hack/cluster/up.sh`` (a single-node
cluster built from upstream sources on this machine) or ``hack/kind-e2e.sh`` (kind). A missing
prerequisite is a failure, never a skip: CI must not go green without having touched a cluster.

Environment:
  KUBECONFIG        the cluster (required)
  KUBECTL           the kubectl binary (default: PATH, then the one hack/cluster/build.sh built)
  AGENTFAST_IMAGE   the project image already present on the node (default ``agentfast:dev``)
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Where the chart is installed (hack/cluster/e2e.sh, hack/kind-e2e.sh).
NAMESPACE = os.environ.get("AGENTFAST_NAMESPACE", "agentfast-system")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed e2e test carries :meth:`Kube.diagnostics` of its namespace in its report.

    A bare "timed out waiting for ..." is not diagnosable from a CI log; the operator's log, the
    run's status, its pods and Events are (issue 10).
    """
    report = yield
    if report.failed and call.when == "call":
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Kube):
                report.sections.append((f"cluster diagnostics ({value.namespace})", value.diagnostics()))
                break
    return report


def _find_kubectl() -> str:
    explicit = os.environ.get("KUBECTL")
    if explicit:
        return explicit
    on_path = shutil.which("kubectl")
    if on_path:
        return on_path
    cache = os.environ.get("AGENTFAST_CACHE", os.path.expanduser("~/.cache/agentfast"))
    built = sorted(glob.glob(os.path.join(cache, "k8s-bin", "*", "kubectl")))
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
        self.image = os.environ.get("AGENTFAST_IMAGE", "agentfast:dev")

    def run(self, *args: str, input: str | None = None, check: bool = True,
            namespaced: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [self.kubectl, "--kubeconfig", self.kubeconfig]
        if namespaced:
            cmd += ["-n", self.namespace]
        cmd += list(args)
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

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

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 120,
                 interval: float = 0.5) -> Any:
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
            ("operator log (last 60 lines)", ("logs", "-l", "app.kubernetes.io/component=operator",
                                              "--tail=60", "--all-containers", "--prefix"), False),
            ("operator log, previous container", ("logs", "-l", "app.kubernetes.io/component=operator",
                                                  "--tail=30", "--previous", "--prefix"), False),
            ("AgentRuns", ("get", "agentruns", "-o", "custom-columns=NAME:.metadata.name,STATUS:.status",
                           "--no-headers"), True),
            ("runner pods", ("describe", "pods", "-l", "app.kubernetes.io/component=runner"), True),
            ("runner logs (last 30 lines each)", ("logs", "-l", "app.kubernetes.io/component=runner",
                                                  "--tail=30", "--prefix", "--max-log-requests=10"), True),
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


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    path = os.environ.get("KUBECONFIG")
    if not path:
        pytest.fail(
            "KUBECONFIG is not set: the e2e tier needs a real cluster. Start one with "
            "`export KUBECONFIG=$(hack/cluster/up.sh)` (local, see docs/testing.md) or "
            "hack/kind-e2e.sh (kind).",
            pytrace=False,
        )
    first = path.split(os.pathsep)[0]
    if not os.path.isfile(first):
        pytest.fail(f"KUBECONFIG names {first}, which does not exist", pytrace=False)
    return path


@pytest.fixture(scope="session")
def kubectl(kubeconfig: str) -> str:
    exe = _find_kubectl()
    proc = subprocess.run([exe, "--kubeconfig", kubeconfig, "get", "--raw", "/readyz"],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 or proc.stdout.strip() != "ok":
        pytest.fail(f"the cluster of KUBECONFIG={kubeconfig} is not ready: {proc.stderr or proc.stdout}",
                    pytrace=False)
    return exe


@pytest.fixture
def kube(kubectl: str, kubeconfig: str) -> Iterator[Kube]:
    ns = f"agentfast-e2e-{uuid.uuid4().hex[:8]}"
    k = Kube(kubectl, kubeconfig, ns)
    k.run("create", "namespace", ns, namespaced=False)
    # The namespace's default ServiceAccount appears asynchronously; pods need it.
    k.wait_for("default ServiceAccount", lambda: k.get("serviceaccount", "default"), timeout=60)
    try:
        yield k
    finally:
        k.run("delete", "namespace", ns, "--wait=false", namespaced=False, check=False)


@pytest.fixture(scope="session")
def examples_dsn(kubectl: str, kubeconfig: str) -> str:
    """The example tools' own DSN in the bundled Postgres, as a user gets it (README, "On
    Kubernetes"): ``python -m agentfast.runner.examples`` in the server's pod."""
    k = Kube(kubectl, kubeconfig, NAMESPACE)
    return k.run("exec", "deploy/agentfast-postgresql", "--", "python", "-m", "agentfast.runner.examples").stdout.strip()


def give_example_tools(k: Kube, examples_dsn: str) -> None:
    """The Secret agentfast-tools in ``k``'s namespace, as a team gives its tools their settings:
    the example tools' DSN (the operator mounts it for the tool host only)."""
    k.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "agentfast-tools", "namespace": k.namespace},
             "stringData": {"EXAMPLE_TOOLS_DSN": examples_dsn}})
