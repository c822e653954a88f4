"""The two images of the one Dockerfile (issue 16 item 6), on a real cluster.

The chart in this suite runs the Dockerfile's ``testing`` target (the production image plus
``agentfast.testing``: the scripted model, fault points, test tools), because the suite's runs use
the scripted model. The production image, the default target, leaves test support out; the
chart's ``runner.allowedImages`` lets a run name it (hack/lib.sh, ``e2e_helm_install``). Here:

- the production image holds no ``agentfast.testing``, and its runtime and operator import;
- a run on the production image, on a ModelConfig endpoint (the scripted model served by the
  testing image, as a remote model would be), goes through its approval to ``Succeeded``;
- a run on the production image naming ``spec.model.script`` fails ``InvalidSpec``, and its pod's
  log says why (no scripted model in that image) and what to use instead.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from .helpers import Kube, python_in_pod
from .test_model_config import _condition, _finish, agentrun, model_server, modelconfig  # noqa: F401 (model_server is a fixture)
from .test_operator import refund_manifest, release, runner_pods, status  # noqa: F401 (release is a fixture)

_PROBE = """
import importlib.util, json
import agentfast.runner.cli, agentfast.runner.loop, agentfast.operator.main
print(json.dumps({"testing": importlib.util.find_spec("agentfast.testing") is not None}))
"""


@pytest.fixture
def production_image() -> str:
    image = os.environ.get("AGENTFAST_PRODUCTION_IMAGE")
    if not image:  # never a silent skip: the scripts that run this suite set it
        pytest.fail("AGENTFAST_PRODUCTION_IMAGE is not set (hack/cluster/e2e.sh and hack/kind-e2e.sh set it)")
    return image


def test_the_production_image_holds_no_test_support(release: Kube, production_image: str) -> None:
    k = release
    found = {}
    for image in (production_image, k.image):  # the testing image: the probe can tell them apart
        out = python_in_pod(k, f"image-probe-{uuid.uuid4().hex[:6]}", _PROBE, image=image)
        found[image] = json.loads(out.strip().splitlines()[-1])["testing"]
    assert found == {production_image: False, k.image: True}, found


_OTEL_PROBE = """
import importlib.util, json
mods = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
print(json.dumps({m: importlib.util.find_spec(m) is not None for m in mods}))
"""


def test_the_production_image_can_trace_runs(release: Kube, production_image: str) -> None:
    """The image installs the otel extra: runner.otlpEndpoint needs nothing more (docs/observability.md)."""
    out = python_in_pod(release, f"otel-probe-{uuid.uuid4().hex[:6]}", _OTEL_PROBE, image=production_image)
    found = json.loads(out.strip().splitlines()[-1])
    assert found and all(found.values()), out


def test_the_production_image_runs_a_run_on_a_model_config(
    release: Kube, model_server: dict[str, str], production_image: str
) -> None:
    k, server = release, model_server
    config = f"prod-{server['tag']}"
    k.apply(modelconfig(k, server, config))
    name = f"prod-run-{server['tag']}"
    doc = agentrun(k, server, name, config)
    doc["spec"]["runner"] = {"image": production_image}
    k.apply(doc)
    _finish(k, name)
    images = {c["image"] for p in runner_pods(k, name) for c in p["spec"]["containers"]}
    assert images == {production_image}, images


def test_a_scripted_run_on_the_production_image_fails_saying_why(release: Kube, production_image: str) -> None:
    k = release
    doc = refund_manifest(k)  # spec.model.script: refund, which the operator (testing image) knows
    name = doc["metadata"]["name"]
    doc["spec"]["runner"] = {"image": production_image}
    k.apply(doc)
    k.wait_for("Failed", lambda: status(k, name).get("phase") in ("Failed", "Succeeded"), timeout=180)
    st = status(k, name)
    assert st["phase"] == "Failed" and _condition(k, name, "Failed").get("reason") == "InvalidSpec", st
    [pod] = runner_pods(k, name)  # a bad spec is not retried
    log = k.logs(pod["metadata"]["name"])
    assert "this install has no scripted model" in log and "spec.model.config" in log, log
