"""The operator's pure parts: the runner Job it builds and the status it computes."""

from __future__ import annotations

from agentfast.operator.status import status_from_store
from agentfast.operator.workload import RunnerConfig, build_job, job_name
from agentfast.runner.snapshot import AwaitedCall, PendingToolCall, RunContext, RunStatus, Session, ToolCall

BODY = {
    "apiVersion": "agentfast.dev/v1alpha1",
    "kind": "AgentRun",
    "metadata": {"name": "refund-demo", "namespace": "team-a", "uid": "u1"},
    "spec": {"model": {"name": "m", "baseURL": "http://x/v1", "apiKeyEnv": "KEY", "apiKeySecretRef": {"name": "s", "key": "k"}}, "input": "hi"},
}


def test_job_runs_the_runner_without_credentials_as_non_root() -> None:
    job = build_job(BODY, RunnerConfig(image="agentfast:test", restart_limit=3))
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["agentfast", "resume", "team-a/refund-demo"]
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e for e in c["env"]}
    assert env["AGENTFAST_DSN"]["valueFrom"]["secretKeyRef"]["name"] == "agentfast-postgres"
    assert env["KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s", "key": "k"}
    assert job["spec"]["backoffLimit"] == 3
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [1, 2]


def test_job_names_are_deterministic_and_valid() -> None:
    assert job_name("refund-demo") == "agentrun-refund-demo"
    long = "x" * 80
    assert job_name(long) == job_name(long) and len(job_name(long)) <= 63
    assert job_name(long) != job_name("x" * 79)


def ctx(phase: str, message: str = "") -> RunContext:
    c = RunContext(session=Session(run_uid="u"), status=RunStatus(phase=phase, reason="R", message=message))
    c.counters.iterations, c.usage.total_tokens, c.counters.resumes = 2, 562, 1
    return c


def test_status_while_waiting_lists_the_call() -> None:
    pending = PendingToolCall(call_id="call-2-0", iteration=2, position=0, tool_call=ToolCall(id="c", name="issue_refund", arguments="{}" + " " * 600), idempotency_key="k")
    s = status_from_store(ctx("WaitingForApproval"), pending, generation=3, old=None)
    assert s["phase"] == "WaitingForApproval" and s["awaiting"] == "call-2-0"
    assert s["pendingApprovals"][0]["tool"] == "issue_refund" and len(s["pendingApprovals"][0]["arguments"]) == 512
    assert (s["iteration"], s["tokensUsed"], s["restarts"]) == (2, 562, 1)
    conds = {c["type"]: c for c in s["conditions"]}
    assert conds["AwaitingApproval"]["status"] == "True" and conds["Ready"]["status"] == "False"
    assert all(c["observedGeneration"] == 3 and c["reason"] for c in s["conditions"])


def test_condition_transition_time_changes_only_with_status() -> None:
    first = status_from_store(ctx("Running"), None, generation=1, old=None)
    old = {**first, "conditions": [{**c, "lastTransitionTime": "2020-01-01T00:00:00Z"} for c in first["conditions"]]}
    again = status_from_store(ctx("Running"), None, generation=1, old=old)
    assert all(c["lastTransitionTime"] == "2020-01-01T00:00:00Z" for c in again["conditions"])
    done = status_from_store(ctx("Succeeded", "refunded"), None, generation=1, old=old)
    ready = next(c for c in done["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    assert done["result"] == "refunded" and done["awaiting"] == ""


def test_status_stays_small() -> None:
    s = status_from_store(ctx("Succeeded", "x" * 100_000), None, generation=1, old=None)
    assert len(s["result"]) <= 1024 and len(s["message"]) <= 1024  # G9: nothing large in the resource


def test_status_lists_every_undecided_awaited_call() -> None:
    calls = [
        AwaitedCall(call_id=cid, iteration=1, position=p, tool_call=ToolCall(id="c", name=n, arguments="{}"), idempotency_key=f"k{p}",
                    reason="in_flight_not_idempotent" if "rerun" in cid else "requires_approval")
        for p, (cid, n) in enumerate([("call-1-0", "freeze_card"), ("call-1-1-rerun1", "send_mail"), ("call-1-3", "refund_charge")])
    ]
    pending = PendingToolCall.of(calls, [])
    s = status_from_store(ctx("WaitingForApproval"), pending, generation=1, old=None)
    assert s["awaiting"] == "call-1-0,call-1-1-rerun1,call-1-3"
    assert [(p["callId"], p["tool"], p["reason"]) for p in s["pendingApprovals"]] == [
        ("call-1-0", "freeze_card", "requires_approval"), ("call-1-1-rerun1", "send_mail", "in_flight_not_idempotent"),
        ("call-1-3", "refund_charge", "requires_approval")]
    # A decided call is no longer listed: the others still are, in the model's order.
    s = status_from_store(ctx("WaitingForApproval"), pending, generation=1, old=s, decided={"call-1-1-rerun1"})
    assert s["awaiting"] == "call-1-0,call-1-3" and [p["callId"] for p in s["pendingApprovals"]] == ["call-1-0", "call-1-3"]
    s = status_from_store(ctx("WaitingForApproval"), pending, generation=1, old=s, decided={"call-1-0", "call-1-1-rerun1", "call-1-3"})
    assert s["awaiting"] == "" and s["pendingApprovals"] == []


def test_exit_76_is_counted_so_the_job_never_retries_it_for_ever() -> None:
    rules = build_job(BODY, RunnerConfig())["spec"]["podFailurePolicy"]["rules"]
    by_code = {code: r["action"] for r in rules if "onExitCodes" in r for code in r["onExitCodes"]["values"]}
    assert by_code[76] == "Count"  # bounded by backoffLimit, unlike Ignore
    assert all(r["action"] != "Ignore" for r in rules if "onExitCodes" in r)


def test_runner_alive_condition_tells_the_same_story_as_the_cli() -> None:
    from agentfast.runner.liveness import RunnerInfo

    alive = RunnerInfo(alive=True, state="alive", heartbeat_age_s=0.4, runner_id="r1", pid=1, host="pod-a", backend_pid=5)
    s = status_from_store(ctx("Running"), None, generation=2, old=None, runner=alive)
    cond = next(c for c in s["conditions"] if c["type"] == "RunnerAlive")
    assert cond["status"] == "True" and cond["reason"] == "RunnerAlive" and "pod-a" in cond["message"]
    assert "heartbeat" not in cond["message"]  # no age: the condition changes only with liveness

    gone = RunnerInfo(alive=False, state="none")
    cond = next(c for c in status_from_store(ctx("Running"), None, generation=2, old=s, runner=gone)["conditions"] if c["type"] == "RunnerAlive")
    assert cond["status"] == "False" and cond["reason"] == "RunnerInterrupted" and "no runner" in cond["message"]

    pending = PendingToolCall(call_id="call-1-0", iteration=1, position=0, tool_call=ToolCall(id="c", name="t"), idempotency_key="k")
    waiting = status_from_store(ctx("WaitingForApproval"), pending, generation=2, old=None, runner=gone)
    assert next(c for c in waiting["conditions"] if c["type"] == "RunnerAlive")["reason"] == "WaitingForDecision"
    decided = status_from_store(ctx("WaitingForApproval"), pending, generation=2, old=None, runner=gone, decided={"call-1-0": "approve"})
    assert next(c for c in decided["conditions"] if c["type"] == "RunnerAlive")["reason"] == "DecidedResumeNeeded"
    assert all(c["type"] != "RunnerAlive" for c in status_from_store(ctx("Running"), None, generation=1, old=None)["conditions"])
