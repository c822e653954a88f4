"""Bring your own tools (issue 17 item 1), on a real cluster.

A team's package, exactly as ``agentfast init`` writes it, is built into an image FROM the
production image with the Dockerfile ``init`` writes (hack/lib.sh, ``build_team_tools_image``,
run by hack/cluster/images.sh and hack/kind-e2e.sh: ``init`` itself runs in the production
image), and the chart allows that image and the package's module (``runner.allowedImages``,
``runner.allowedModules``). Then the AgentRun ``init`` wrote, given a ModelConfig and
``spec.runner.image``, runs in that image:

- the model is the scripted model playing the package's own ``script.yaml``, served in the
  cluster as a remote model would be (tests/e2e/test_model_config.py, ``serve_scripted_model``);
- the run pauses on the gated ``apply_credit`` after its sibling ``send_notice`` (not idempotent,
  with a recovery check) ran; its runner pod is deleted while it waits; the approval starts a new
  pod, which applies the credit and ends the run ``Succeeded``;
- every runner pod ran the team's image, and the journal holds each call done once, on its first
  attempt: the pod's loss re-ran nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers import Kube
from .test_model_config import modelconfig, serve_scripted_model
from .test_operator import E2E_LABEL, approve, release, runner_pods, running_runner, sql, status  # noqa: F401 (release is a fixture)


@pytest.fixture
def team_image() -> str:
    image = os.environ.get("AGENTFAST_TEAM_IMAGE")
    if not image:  # never a silent skip: the scripts that run this suite build it and set it
        pytest.fail("AGENTFAST_TEAM_IMAGE is not set (hack/cluster/e2e.sh and hack/kind-e2e.sh set it)")
    return image


def test_a_teams_own_tools_run_in_its_own_image(release: Kube, team_image: str, tmp_path: Path) -> None:
    k = release
    # The files the image was built from: init writes the same ones wherever it runs.
    subprocess.run([sys.executable, "-m", "agentfast.runner", "init", str(tmp_path / "team-tools")], check=True)
    scaffold = tmp_path / "team-tools"
    doc = yaml.safe_load((scaffold / "agentrun.yaml").read_text())
    model = doc["spec"]["model"]["name"]
    with serve_scripted_model(k, (scaffold / "script.yaml").read_text()) as server:
        config = f"team-{server['tag']}"
        k.apply(modelconfig(k, server, config, models=[model]))
        name = f"team-tools-{server['tag']}"
        doc["metadata"] = {
            "name": name,
            "namespace": k.namespace,
            "labels": {E2E_LABEL: "true", "agentfast.dev/e2e-model": server["tag"]},
        }
        doc["spec"]["model"] = {"name": model, "config": config}
        doc["spec"]["runner"] = {"image": team_image}
        doc["spec"]["suspendAfter"] = 0  # the pod waits with the run, so the test can delete it
        k.apply(doc)
        k.wait_for(
            "the credit to wait for approval",
            lambda: status(k, name).get("phase") in ("WaitingForApproval", "Failed", "Succeeded"),
            timeout=240,
        )
        st = status(k, name)
        assert st["phase"] == "WaitingForApproval" and st["awaiting"] == "call-1-0", st
        first = running_runner(k, name)
        assert first is not None
        k.run("delete", "pod", first, "--wait=true", timeout=120)
        approve(k, name, "call-1-0")
        k.wait_for(f"{name} to end", lambda: status(k, name).get("phase") in ("Succeeded", "Failed"), timeout=240)
        st = status(k, name)
        assert st["phase"] == "Succeeded", st

        images = {c["image"] for p in runner_pods(k, name) for c in p["spec"]["containers"]}
        assert images == {team_image}, images
        calls = sql(
            k,
            "SELECT call_id, tool_name, state, attempts FROM agentfast_tool_calls WHERE run_id = %s ORDER BY call_id",
            f"{k.namespace}/{name}",
        )
        assert calls == [["call-1-0", "apply_credit", "done", 1], ["call-1-1", "send_notice", "done", 1]], calls
