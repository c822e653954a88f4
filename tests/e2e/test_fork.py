"""Fork a run from one of its iterations with ``spec.forkFrom`` (issue 17 item 4, docs/fork.md),
on a real cluster with the chart installed.

The refund example runs to the end (its refund approved). A second AgentRun in the same namespace
names it in ``spec.forkFrom`` at iteration 1: the operator registers it as a copy of the source's
state there (transcript, journal, budget state), and its runner pod goes on from iteration 2 with
its own model. Checked: the fork pauses for its own refund, is approved and succeeds; the lookup
of iteration 1 was not run again (the examples' invocation log has one row, under the source's
key); the fork's refund has a key of the fork's own uid; the source is untouched. A fork naming a
run of another namespace ends ``Failed``/``InvalidSpec`` without a runner pod.
"""

from __future__ import annotations

from .helpers import Kube
from .test_model_config import _condition
from .test_operator import apply_refund, approve, refund_manifest, release, runner_pods, sql, status, wait_awaiting  # noqa: F401 (release is a fixture)


def _count(k: Kube, table: str, where: str, *params: str) -> int:
    """Rows of the example tools' ``table`` matching ``where``."""
    [[n]] = sql(k, f"SELECT count(*) FROM agentfast_examples.{table} WHERE {where}", *params)
    return int(n)


def test_a_fork_goes_on_from_its_sources_iteration_and_reruns_nothing(release: Kube) -> None:
    k = release
    source, source_uid = apply_refund(k)
    wait_awaiting(k, source)
    approve(k, source, "call-2-0")
    k.wait_for(f"{source} to succeed", lambda: status(k, source).get("phase") in ("Succeeded", "Failed"), timeout=180)
    assert status(k, source)["phase"] == "Succeeded", status(k, source)
    lookups = "tool = 'lookup_order' AND idempotency_key LIKE %s"
    assert _count(k, "demo_tool_invocations", lookups, f"{source_uid}:%") == 1

    doc = refund_manifest(k)
    fork = doc["metadata"]["name"]
    doc["spec"]["forkFrom"] = {"run": source, "iteration": 1}
    k.apply(doc)
    fork_uid = k.get("agentrun", fork)["metadata"]["uid"]
    wait_awaiting(k, fork)  # its own model's second turn: the refund, gated again on the fork
    st = status(k, fork)
    assert st["iteration"] == 2 and st["awaiting"] == "call-2-0", st  # paused in iteration 2, as its call's id says
    approve(k, fork, "call-2-0")
    k.wait_for(f"{fork} to succeed", lambda: status(k, fork).get("phase") in ("Succeeded", "Failed"), timeout=180)
    assert status(k, fork)["phase"] == "Succeeded", status(k, fork)

    # Iteration 1's lookup was reused, not run again; the fork's own calls carry its own uid.
    assert _count(k, "demo_tool_invocations", lookups, f"{source_uid}:%") == 1
    assert _count(k, "demo_tool_invocations", lookups, f"{fork_uid}:%") == 0
    assert _count(k, "demo_refund_ledger", "idempotency_key LIKE %s", f"{fork_uid}:2:%") == 1
    assert _count(k, "demo_refund_ledger", "idempotency_key LIKE %s", f"{source_uid}:%") == 1
    assert status(k, source)["phase"] == "Succeeded" and status(k, source)["iteration"] == 3


def test_a_fork_of_another_namespaces_run_is_refused(release: Kube) -> None:
    k = release
    doc = refund_manifest(k)
    name = doc["metadata"]["name"]
    doc["spec"]["forkFrom"] = {"run": "someone-else/their-run", "iteration": 1}
    k.apply(doc)
    k.wait_for("Failed", lambda: status(k, name).get("phase") == "Failed", timeout=60)
    st = status(k, name)
    assert _condition(k, name, "Failed").get("reason") == "InvalidSpec", st
    assert "another namespace" in st["message"], st
    assert runner_pods(k, name) == []
