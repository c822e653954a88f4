"""Fixtures for the cluster tier: a real Kubernetes cluster, taken from ``KUBECONFIG``.

The suite does not care which provider made the cluster: ``hack/cluster/up.sh`` (a single-node
cluster built from upstream sources on this machine) or ``hack/kind-e2e.sh`` (kind). A missing
prerequisite is a failure, never a skip: CI must not go green without having touched a cluster.

Environment:
  KUBECONFIG        the cluster (required)
  KUBECTL           the kubectl binary (default: PATH, then the one hack/cluster/build.sh built)
  AGENTFAST_IMAGE   the image the chart was installed with, already on the node: the Dockerfile's
                    testing target (default ``agentfast-testing:dev``)
  AGENTFAST_PRODUCTION_IMAGE
                    the production image (the Dockerfile's default target), on the node and in
                    the chart's runner.allowedImages (tests/e2e/test_images.py; required)
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .helpers import NAMESPACE, Kube, find_kubectl


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
    exe = find_kubectl()
    proc = subprocess.run(
        [exe, "--kubeconfig", kubeconfig, "get", "--raw", "/readyz"], capture_output=True, text=True, timeout=30
    )
    if proc.returncode != 0 or proc.stdout.strip() != "ok":
        pytest.fail(f"the cluster of KUBECONFIG={kubeconfig} is not ready: {proc.stderr or proc.stdout}", pytrace=False)
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
