"""Runner pods as users configure them (issue 14 item 7), on a real cluster.

A run's ``spec.runner`` sizes and places its runner pod, and the run still completes; an image
outside the admin's allow-list (the chart's ``runner.allowedImages``; by default only the chart's
own image) is refused by the operator, ``Failed``/``InvalidSpec`` naming the field, before any
runner pod exists and without anything being pulled. The chart is installed with its defaults.
"""

from __future__ import annotations

import json
import time
import uuid

from .helpers import Kube
from .test_operator import (  # noqa: F401 (release is a fixture)
    approve,
    assert_succeeded_once,
    refund_manifest,
    release,
    runner_pods,
    running_runner,
    status,
    wait_awaiting,
)

RESOURCES = {"requests": {"cpu": "100m", "memory": "192Mi"}, "limits": {"cpu": "1", "memory": "640Mi"}}


def test_spec_runner_sizes_and_places_the_pod_and_the_run_completes(release: Kube) -> None:
    k = release
    name = f"placed-{uuid.uuid4().hex[:6]}"
    doc = refund_manifest(k, name)
    doc["spec"]["runner"] = {"resources": RESOURCES, "nodeSelector": {"kubernetes.io/os": "linux"}}
    k.apply(doc)
    uid = k.get("agentrun", name)["metadata"]["uid"]
    assert k.get("agentrun", name)["spec"]["runner"] == doc["spec"]["runner"]  # nothing pruned
    call = wait_awaiting(k, name)
    pod_name = k.wait_for("a running runner pod", lambda: running_runner(k, name))
    [pod] = [p for p in runner_pods(k, name) if p["metadata"]["name"] == pod_name]
    spec = pod["spec"]
    [c] = spec["containers"]
    assert c["resources"] == RESOURCES, c["resources"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    # the operator's own node-loss tolerations are still there, and nothing else changed
    assert {t["key"]: t.get("tolerationSeconds") for t in spec["tolerations"] if t.get("tolerationSeconds") == 20} == {
        "node.kubernetes.io/not-ready": 20,
        "node.kubernetes.io/unreachable": 20,
    }
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["securityContext"]["allowPrivilegeEscalation"] is False
    # spec.runner is immutable, like the rest of spec
    changed = k.run(
        "patch",
        "agentrun",
        name,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"runner": {"nodeSelector": {"pool": "x"}}}}),
        check=False,
    )
    assert changed.returncode != 0 and "spec is immutable after creation" in changed.stderr
    approve(k, name, call)
    assert_succeeded_once(k, name, uid, min_restarts=0)


def test_an_image_outside_the_allow_list_is_refused_without_a_runner_pod(release: Kube) -> None:
    k = release
    name = f"foreign-image-{uuid.uuid4().hex[:6]}"
    doc = refund_manifest(k, name)
    doc["spec"]["runner"] = {"image": "registry.invalid/someone-else/miner:latest"}
    k.apply(doc)
    k.wait_for("Failed", lambda: status(k, name).get("phase") == "Failed", timeout=60)
    st = status(k, name)
    assert {c["type"]: c for c in st["conditions"]}["Failed"]["reason"] == "InvalidSpec", st
    assert (
        "spec.runner.image: 'registry.invalid/someone-else/miner:latest' is not an image this cluster allows" in st["message"]
    ), st
    time.sleep(3)
    assert runner_pods(k, name) == []
    # nothing was pulled: no pod anywhere names the image
    pods = json.loads(k.run("get", "pods", "-A", "-o", "json", namespaced=False).stdout)["items"]
    assert not any(c.get("image", "").startswith("registry.invalid/") for p in pods for c in p["spec"]["containers"])
