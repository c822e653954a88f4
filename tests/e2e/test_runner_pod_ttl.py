"""An ended run's runner pods are deleted after ``runner.podTTLSecondsAfterFinished`` (issue 14 item 3).

Like a Job's ``ttlSecondsAfterFinished``: the last runner pod of a run that ended stays for
``kubectl logs`` that long, then the operator deletes it; the AgentRun, its status and the run's
rows in Postgres stay. The e2e install sets a short TTL (``hack/lib.sh`` ``e2e_helm_install``: 30 s,
the chart's default is an hour); the tests read the value from the operator's Deployment.

- A refund run approved to ``Succeeded`` keeps its pod (its log readable) for about the TTL, then
  has no runner pod left, ``status.runnerPodsDeletedAt`` says when, and no pod is started for it
  again (a resync later).
- The same when the operator is killed between the run's end and the pod's deletion: the clock is
  the end recorded in status, and the new leader's resume pass reschedules the deletion.
"""

from __future__ import annotations

import json
import time

import pytest

from .helpers import Kube
from .test_operator import apply_refund, approve, release, runner_pods, sql, status, wait_awaiting  # noqa: F401 (release is a fixture)

#: The longest TTL these tests wait for; an install with a longer one (the chart's hour) fails them at once.
MAX_TTL_S = 120


def pod_ttl(k: Kube) -> int:
    """The installed operator's runner.podTTLSecondsAfterFinished, s (its AGENTFAST_RUNNER_POD_TTL_SECONDS)."""
    deploys = json.loads(k.run("get", "deploy", "-l", "app.kubernetes.io/component=operator", "-o", "json").stdout)["items"]
    env = {e["name"]: e.get("value") for d in deploys for e in d["spec"]["template"]["spec"]["containers"][0].get("env") or []}
    raw = env.get("AGENTFAST_RUNNER_POD_TTL_SECONDS")
    if raw is None or not raw.isdigit() or int(raw) > MAX_TTL_S:
        pytest.fail(
            f"the operator's runner pod TTL is {raw!r}: these tests need at most {MAX_TTL_S} s; install the chart as"
            " hack/lib.sh e2e_helm_install does (--set runner.podTTLSecondsAfterFinished=30)",
            pytrace=False,
        )
    return int(raw)


def succeed(k: Kube) -> tuple[str, str, float]:
    """A refund run approved and seen Succeeded; (name, uid, time.monotonic() when status showed it)."""
    name, uid = apply_refund(k)
    call = wait_awaiting(k, name)
    approve(k, name, call)
    k.wait_for(f"{name} to end", lambda: status(k, name).get("phase") in ("Succeeded", "Failed"), timeout=180, interval=0.2)
    ended = time.monotonic()
    assert status(k, name)["phase"] == "Succeeded", status(k, name)
    return name, uid, ended


def assert_collected(k: Kube, name: str, uid: str) -> None:
    """The run's pods are gone for good; the AgentRun, its status and its rows are kept."""
    st = status(k, name)
    assert st["phase"] == "Succeeded" and st["iteration"] == 3, st
    assert st.get("runnerPodsDeletedAt"), st
    assert sql(k, "SELECT count(*) > 0 FROM agentfast_messages WHERE run_id = %s", f"{k.namespace}/{name}") == [[True]]
    time.sleep(35)  # a resync (30 s) and any pod event later: nothing starts the ended run again
    assert runner_pods(k, name) == [], [p["metadata"]["name"] for p in runner_pods(k, name)]
    assert status(k, name)["phase"] == "Succeeded"


def test_a_finished_runs_runner_pod_is_deleted_after_its_ttl(release: Kube) -> None:
    k = release
    ttl = pod_ttl(k)
    name, uid, ended = succeed(k)
    # Kept meanwhile, for kubectl logs.
    pods = runner_pods(k, name)
    assert pods and not status(k, name).get("runnerPodsDeletedAt"), status(k, name)
    last = max(pods, key=lambda p: int(p["metadata"]["annotations"]["agentfast.dev/attempt"]))["metadata"]["name"]
    assert k.logs(last).strip()
    k.wait_for("the ended run's runner pods to be deleted", lambda: not runner_pods(k, name), timeout=ttl + 45, interval=0.5)
    kept = time.monotonic() - ended
    # Deleted once its TTL had passed since the end (status records the end to the second), not at once.
    assert kept >= ttl - 3, f"the runner pod went {kept:.1f} s after the run ended; its TTL is {ttl} s"
    print(f"runner pod deleted {kept:.1f} s after Succeeded (TTL {ttl} s)")
    assert_collected(k, name, uid)


def test_the_pod_ttl_holds_across_an_operator_restart(release: Kube) -> None:
    # The pending deletion is not only a timer in the operator's memory: the end is in status, and
    # the next leader's resume pass reconciles every AgentRun, which schedules it again.
    k = release
    ttl = pod_ttl(k)
    name, uid, ended = succeed(k)
    assert runner_pods(k, name)
    k.run("delete", "pod", "-l", "app.kubernetes.io/component=operator", "--wait=false")
    try:
        # the operator's start and the Lease takeover (about 11 s) come on top of the TTL
        k.wait_for(
            "the ended run's runner pods to be deleted by the next operator",
            lambda: not runner_pods(k, name),
            timeout=ttl + 150,
            interval=1,
        )
        assert time.monotonic() - ended >= ttl - 3
        assert_collected(k, name, uid)
    finally:
        k.wait_for(
            "the operator to be back",
            lambda: all(
                d["status"].get("availableReplicas") == d["spec"]["replicas"]
                for d in json.loads(k.run("get", "deploy", "-l", "app.kubernetes.io/component=operator", "-o", "json").stdout)[
                    "items"
                ]
            ),
            timeout=180,
            interval=2,
        )
