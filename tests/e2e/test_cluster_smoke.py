"""Smoke tests of the cluster tier itself: the things the e2e suite relies on, checked for real.

1. A pod from the project image runs the installed package; deleting the pod ends its container's
   process on the node (looked up in /proc, not only the API object disappearing).
2. A Service gets a DNS name that another pod resolves and connects to, and a pod reaches the API
   server through the in-cluster `kubernetes` Service with its ServiceAccount token.

The process check reads this machine's /proc, so it needs the node's processes to be visible here:
true for hack/cluster/up.sh (the kubelet runs on this machine) and for kind (its node is a
container on this machine's kernel).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def _pids_with_marker(marker: str) -> list[int]:
    """Processes on this machine whose command line contains ``marker``."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not readable
            continue
        if marker.encode() in cmdline and b"pytest" not in cmdline:
            found.append(int(entry.name))
    return found


def _pod(name: str, image: str, command: list[str], labels: dict[str, str] | None = None, restart: str = "Never") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 3,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": command,
                    "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True},
                }
            ],
        },
    }


def _wait_running(kube, name: str) -> None:
    def running() -> bool:
        phase = kube.pod_phase(name)
        if phase in ("Failed", "Succeeded"):
            pytest.fail(f"pod {name} ended ({phase}) instead of running:\n{kube.describe('pod', name)}")
        return phase == "Running"

    try:
        kube.wait_for(f"pod {name} Running", running, timeout=180)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{kube.describe('pod', name)}") from None


def test_project_pod_runs_and_its_process_ends_on_delete(kube) -> None:
    marker = f"agentfast-smoke-{uuid.uuid4().hex}"
    script = (
        "import sys, time, agentfast.runner, agentfast.runner.cli; "
        "print('ready', agentfast.runner.__name__, flush=True); time.sleep(3600)"
    )
    # The marker is an argument so that it is in the process's /proc/PID/cmdline on the node.
    kube.apply(_pod("sleeper", kube.image, ["python3", "-c", script, marker]))
    _wait_running(kube, "sleeper")
    logs = kube.wait_for(
        "the pod's 'ready' line", lambda: "ready agentfast.runner" in kube.run("logs", "sleeper", check=False).stdout, timeout=60
    )
    assert logs
    pids = kube.wait_for("the container's process on this machine", lambda: _pids_with_marker(marker), timeout=30)
    assert pids, "the pod runs but no process with its marker is visible on this machine"
    # It runs as the image's non-root user.
    status = Path(f"/proc/{pids[0]}/status").read_text()
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1] != "0", f"container process runs as root: {uid_line}"

    kube.run("delete", "pod", "sleeper", "--wait=true", timeout=120)
    assert kube.get("pod", "sleeper") is None
    # The API object is gone; the process must be gone too (the kubelet killed the container).
    remaining = kube.wait_for("the container's process to end", lambda: not _pids_with_marker(marker) and [True], timeout=30)
    assert remaining
    assert not _pids_with_marker(marker)


def test_service_dns_and_in_cluster_api(kube) -> None:
    ns = kube.namespace
    kube.apply(
        _pod(
            "web",
            kube.image,
            ["python3", "-m", "http.server", "8080", "--directory", "/opt/agentfast"],
            labels={"app": "smoke-web"},
        )
    )
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "smoke-web"},
            "spec": {"selector": {"app": "smoke-web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        }
    )
    _wait_running(kube, "web")

    client = f"""
import json, ssl, time, urllib.error, urllib.request
# A Service name, resolved by the cluster DNS, connected through kube-proxy's rules.
url = "http://smoke-web.{ns}.svc.cluster.local/"
for attempt in range(60):
    try:
        body = urllib.request.urlopen(url, timeout=3).read().decode()
        break
    except OSError as e:
        err = e
        time.sleep(1)
else:
    raise SystemExit(f"service unreachable: {{err!r}}")
assert "pyvenv.cfg" in body, body[:200]
print("service-ok")
# The API server through the `kubernetes` Service, authenticated by the pod's ServiceAccount token.
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(sa + "/token").read()
ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
req = urllib.request.Request("https://kubernetes.default.svc/api/v1/namespaces/{ns}/pods",
                             headers={{"Authorization": "Bearer " + token}})
try:
    urllib.request.urlopen(req, context=ctx, timeout=10)
    raise SystemExit("the default ServiceAccount should not be allowed to list pods")
except urllib.error.HTTPError as e:
    body = json.loads(e.read())
    assert e.code == 403, (e.code, body)
    assert "system:serviceaccount:{ns}:default" in body["message"], body
print("api-ok")
"""
    kube.apply(_pod("client", kube.image, ["python3", "-c", client]))
    kube.wait_for("pod client to finish", lambda: kube.pod_phase("client") in ("Succeeded", "Failed"), timeout=180)
    logs = kube.run("logs", "client", check=False)
    assert kube.pod_phase("client") == "Succeeded", logs.stdout + logs.stderr + kube.describe("pod", "client")
    assert "service-ok" in logs.stdout and "api-ok" in logs.stdout, logs.stdout
