"""The operator's pure parts: the runner pod it builds, when it builds the next one, and the status it computes."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from agentfast.operator.lifecycle import RunnerPod, backoff_s, next_step
from agentfast.operator.status import status_from_store
from agentfast.operator.workload import TOOL_ENV_DIR, RunnerConfig, build_pod, pod_name, runner_name
from agentfast.runner.snapshot import AwaitedCall, PendingToolCall, RunContext, RunStatus, Session, ToolCall

from .helpers import count_rows, wait_until

BODY = {
    "apiVersion": "agentfast.dev/v1alpha1",
    "kind": "AgentRun",
    "metadata": {"name": "refund-demo", "namespace": "team-a", "uid": "u1"},
    "spec": {"model": {"name": "m", "config": "llm"}, "input": "hi"},
}
#: The ModelConfig ``llm`` of team-a, as the API server returns it (an admin's).
MODELCONFIG = {
    "apiVersion": "agentfast.dev/v1alpha1",
    "kind": "ModelConfig",
    "metadata": {"name": "llm", "namespace": "team-a", "uid": "mc-uid", "resourceVersion": "7", "generation": 2},
    "spec": {
        "baseURL": "http://vllm.models.svc:8000/v1",
        "apiKeySecretRef": {"name": "s", "key": "k"},
        "models": ["m"],
        "timeoutSeconds": 30,
        "maxRetries": 2,
        "maxTokensPerRequest": 512,
        "prices": {"promptPerMillionTokens": 0.5, "completionPerMillionTokens": 1.5},
    },
}
KEY = {"name": "s", "key": "k"}


def test_the_runner_pod_runs_the_runner_without_credentials_as_non_root() -> None:
    manifest = build_pod(
        BODY, RunnerConfig(image="agentfast:test", restart_limit=3), attempt=4, counted_failures=2, model_key=KEY
    )
    pod = manifest["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["agentfast", "resume", "team-a/refund-demo"]
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e for e in c["env"]}
    assert env["AGENTFAST_DSN"]["valueFrom"]["secretKeyRef"] == {
        "name": "agentfast-runner",
        "key": "dsn",
    }  # the namespace's own credential
    assert env["AGENTFAST_MODEL_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s", "key": "k"}
    assert env["AGENTFAST_SUSPEND_AFTER_SECONDS"]["value"] == "60"  # the chart's default; spec.suspendAfter wins
    # started while its predecessor may still be stopping: waits for it past its grace period and a stale heartbeat
    assert env["AGENTFAST_WAIT_FOR_HOLDER_SECONDS"]["value"] == "35"
    # large payloads: the chart's defaults, 1 MiB out of line and 64 MiB at most (runner/payloads.py reads them)
    assert (env["AGENTFAST_PAYLOAD_THRESHOLD_BYTES"]["value"], env["AGENTFAST_PAYLOAD_MAX_BYTES"]["value"]) == (
        "1048576",
        "67108864",
    )
    long_grace = build_pod(BODY, RunnerConfig(termination_grace_s=120))["spec"]["containers"][0]["env"]
    assert {e["name"]: e.get("value") for e in long_grace}["AGENTFAST_WAIT_FOR_HOLDER_SECONDS"] == "125"
    meta = manifest["metadata"]
    assert meta["name"] == "agentrun-refund-demo-4" and meta["labels"]["agentfast.dev/run-uid"] == "u1"
    assert meta["annotations"]["agentfast.dev/attempt"] == "4" and meta["annotations"]["agentfast.dev/counted-failures"] == "2"
    # a lost node's pod is evicted after 20 s, not the default 300 s
    assert {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"]} == {
        "node.kubernetes.io/not-ready": 20,
        "node.kubernetes.io/unreachable": 20,
    }
    waits = build_pod({**BODY, "spec": {**BODY["spec"], "suspendAfter": 0}}, RunnerConfig())["spec"]["containers"][0]["env"]
    assert {e["name"]: e.get("value") for e in waits}["AGENTFAST_SUSPEND_AFTER_SECONDS"] == "0"


def test_runner_names_are_deterministic_and_valid() -> None:
    assert runner_name("refund-demo") == "agentrun-refund-demo" and pod_name("refund-demo", 2) == "agentrun-refund-demo-2"
    long = "x" * 80
    assert runner_name(long) == runner_name(long) and len(runner_name(long)) <= 63
    assert runner_name(long) != runner_name("x" * 79)


def ctx(phase: str, message: str = "") -> RunContext:
    c = RunContext(session=Session(run_uid="u"), status=RunStatus(phase=phase, reason="R", message=message))
    c.counters.iterations, c.usage.total_tokens, c.counters.resumes = 2, 562, 1
    return c


def test_a_paused_runs_iteration_is_its_awaited_calls() -> None:
    """Paused on call-2-0 with one iteration committed: status.iteration says 2, as the call's id;
    once the run ended it is the committed count again."""
    paused = ctx("WaitingForApproval")
    paused.counters.iterations = 1
    pending = PendingToolCall(
        call_id="call-2-0",
        iteration=2,
        position=0,
        tool_call=ToolCall(id="c", name="issue_refund", arguments="{}"),
        idempotency_key="k",
    )
    assert status_from_store(paused, pending, generation=1, old=None)["iteration"] == 2
    ended = ctx("Succeeded")
    ended.counters.iterations = 3
    assert status_from_store(ended, None, generation=1, old=None)["iteration"] == 3


def test_status_while_waiting_lists_the_call() -> None:
    pending = PendingToolCall(
        call_id="call-2-0",
        iteration=2,
        position=0,
        tool_call=ToolCall(id="c", name="issue_refund", arguments="{}" + " " * 600),
        idempotency_key="k",
    )
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
    done = status_from_store(ctx("Succeeded", "refunded"), None, generation=1, old=old, summary=True)
    ready = next(c for c in done["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    assert done["result"] == "refunded" and done["awaiting"] == ""


def test_status_stays_small() -> None:
    s = status_from_store(ctx("Succeeded", "x" * 100_000), None, generation=1, old=None)
    assert len(s["result"]) <= 1024 and len(s["message"]) <= 1024  # G9: nothing large in the resource


def test_status_lists_every_undecided_awaited_call() -> None:
    calls = [
        AwaitedCall(
            call_id=cid,
            iteration=1,
            position=p,
            tool_call=ToolCall(id="c", name=n, arguments="{}"),
            idempotency_key=f"k{p}",
            reason="in_flight_not_idempotent" if "rerun" in cid else "requires_approval",
        )
        for p, (cid, n) in enumerate(
            [("call-1-0", "freeze_card"), ("call-1-1-rerun1", "send_mail"), ("call-1-3", "refund_charge")]
        )
    ]
    pending = PendingToolCall.of(calls, [])
    s = status_from_store(ctx("WaitingForApproval"), pending, generation=1, old=None)
    assert s["awaiting"] == "call-1-0,call-1-1-rerun1,call-1-3"
    assert [(p["callId"], p["tool"], p["reason"]) for p in s["pendingApprovals"]] == [
        ("call-1-0", "freeze_card", "requires_approval"),
        ("call-1-1-rerun1", "send_mail", "in_flight_not_idempotent"),
        ("call-1-3", "refund_charge", "requires_approval"),
    ]
    # A decided call is no longer listed: the others still are, in the model's order.
    s = status_from_store(ctx("WaitingForApproval"), pending, generation=1, old=s, decided={"call-1-1-rerun1"})
    assert s["awaiting"] == "call-1-0,call-1-3" and [p["callId"] for p in s["pendingApprovals"]] == ["call-1-0", "call-1-3"]
    s = status_from_store(
        ctx("WaitingForApproval"), pending, generation=1, old=s, decided={"call-1-0", "call-1-1-rerun1", "call-1-3"}
    )
    assert s["awaiting"] == "" and s["pendingApprovals"] == []


def test_runner_alive_condition_tells_the_same_story_as_the_cli() -> None:
    from agentfast.runner.liveness import RunnerInfo

    alive = RunnerInfo(alive=True, state="alive", heartbeat_age_s=0.4, runner_id="r1", pid=1, host="pod-a", backend_pid=5)
    s = status_from_store(ctx("Running"), None, generation=2, old=None, runner=alive)
    cond = next(c for c in s["conditions"] if c["type"] == "RunnerAlive")
    assert cond["status"] == "True" and cond["reason"] == "RunnerAlive" and "pod-a" in cond["message"]
    assert "heartbeat" not in cond["message"]  # no age: the condition changes only with liveness

    gone = RunnerInfo(alive=False, state="none")
    cond = next(
        c
        for c in status_from_store(ctx("Running"), None, generation=2, old=s, runner=gone)["conditions"]
        if c["type"] == "RunnerAlive"
    )
    assert cond["status"] == "False" and cond["reason"] == "RunnerInterrupted" and "no runner" in cond["message"]

    pending = PendingToolCall(
        call_id="call-1-0", iteration=1, position=0, tool_call=ToolCall(id="c", name="t"), idempotency_key="k"
    )
    waiting = status_from_store(ctx("WaitingForApproval"), pending, generation=2, old=None, runner=gone)
    assert next(c for c in waiting["conditions"] if c["type"] == "RunnerAlive")["reason"] == "WaitingForDecision"
    decided = status_from_store(
        ctx("WaitingForApproval"), pending, generation=2, old=None, runner=gone, decided={"call-1-0": "approve"}
    )
    assert next(c for c in decided["conditions"] if c["type"] == "RunnerAlive")["reason"] == "DecidedResumeNeeded"
    assert all(c["type"] != "RunnerAlive" for c in status_from_store(ctx("Running"), None, generation=1, old=None)["conditions"])


# -- issue 12: trust boundaries ---------------------------------------------------------------------


def test_long_agentrun_names_fit_pod_names_and_labels() -> None:
    from agentfast.operator.workload import ANNOTATION_RUN, LABEL_RUN, run_label

    name = "a" * 120 + "." + "b" * 132  # 253 characters: the longest AgentRun name
    body = {**BODY, "metadata": {**BODY["metadata"], "name": name}}
    meta = build_pod(body, RunnerConfig(), attempt=12)["metadata"]
    label = meta["labels"][LABEL_RUN]
    assert len(label) <= 63 and label[0].isalnum() and label[-1].isalnum() and label == run_label(name)
    assert meta["annotations"][ANNOTATION_RUN] == name  # how the operator finds the run from its pod
    assert len(meta["name"]) <= 63 + 3 and run_label(name) != run_label(name[:-1] + "c")
    assert run_label("refund-demo") == "refund-demo"  # short names stay readable (and selectable)


def test_the_runner_gets_the_allow_list_and_our_variables_come_first() -> None:
    runner_pod = build_pod(BODY, RunnerConfig(), allowed_modules=("agentfast.runner.examples", "acme.tools"), model_key=KEY)
    env = runner_pod["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert {e["name"]: e.get("value") for e in env}["AGENTFAST_ALLOWED_MODULES"] == "agentfast.runner.examples,acme.tools"
    assert names[-1] == "AGENTFAST_MODEL_API_KEY" and len(names) == len(set(names))


def _secret_refs(runner_pod: dict) -> list[tuple[str, dict]]:
    [c] = runner_pod["spec"]["containers"]
    refs = [(e["name"], e["valueFrom"]["secretKeyRef"]) for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert not c.get("envFrom")
    # the one Secret volume: the tools' own settings, for the tool host (never a Postgres credential)
    assert [v["secret"] for v in runner_pod["spec"]["volumes"] if v.get("secret")] == [
        {"secretName": "agentfast-tools", "optional": True}
    ]
    return refs


def test_the_tools_settings_are_mounted_for_the_tool_host_and_never_a_credential() -> None:
    # G11: the namespace's agentfast-tools Secret, read-only, optional, at the dir the tool host reads.
    [c] = build_pod(BODY, RunnerConfig())["spec"]["containers"]
    assert {"name": "tool-env", "mountPath": TOOL_ENV_DIR, "readOnly": True} in c["volumeMounts"]
    assert {e["name"]: e.get("value") for e in c["env"]}["AGENTFAST_TOOL_ENV_DIR"] == TOOL_ENV_DIR
    runner_pod = build_pod(BODY, RunnerConfig(tool_secret=""))  # runner.toolSecret: "": none
    assert not any(v.get("secret") for v in runner_pod["spec"]["volumes"])
    assert "AGENTFAST_TOOL_ENV_DIR" not in str(runner_pod)
    for name in ("agentfast-runner", "agentfast-postgres"):
        with pytest.raises(ValueError, match="Postgres credential"):
            RunnerConfig.from_env({"AGENTFAST_RUNNER_TOOL_SECRET": name})
    assert RunnerConfig.from_env({"AGENTFAST_RUNNER_TOOL_SECRET": "team-tools"}).tool_secret == "team-tools"


def test_build_job_mounts_only_the_model_configs_secret_key_under_our_name() -> None:
    # Issue 12 item 4: the DSN and the ModelConfig's one key; nothing the AgentRun's spec says
    # reaches the environment, even a spec carrying the fields an AgentRun had before.
    sneaky = {
        **BODY,
        "spec": {
            **BODY["spec"],
            "model": {
                **BODY["spec"]["model"],
                "apiKeyEnv": "LD_PRELOAD",
                "apiKeySecretRef": {"name": "agentfast-postgres", "key": "dsn"},
            },
        },
    }
    runner_pod = build_pod(sneaky, RunnerConfig(), model_key=KEY)
    assert _secret_refs(runner_pod) == [
        ("AGENTFAST_DSN", {"name": "agentfast-runner", "key": "dsn"}),
        ("AGENTFAST_MODEL_API_KEY", {"name": "s", "key": "k"}),
    ]
    assert "LD_PRELOAD" not in str(runner_pod)
    # the scripted model, or an endpoint without a key: the DSN only
    assert _secret_refs(build_pod(BODY, RunnerConfig())) == [("AGENTFAST_DSN", {"name": "agentfast-runner", "key": "dsn"})]
    # a ModelConfig naming the DSN's own Secret key as its API key: refused, never mounted twice
    for credential in ({"name": "agentfast-postgres", "key": "dsn"}, {"name": "agentfast-runner", "key": "dsn"}):
        with pytest.raises(ValueError, match="Postgres credential"):
            build_pod(BODY, RunnerConfig(), model_key=credential)


class _ModelConfigs:
    """The one call the operator makes for ModelConfigs (a read by name), over a dict of objects."""

    def __init__(self, objects: dict[tuple[str, str], dict]) -> None:
        self.objects, self.reads = objects, []

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        from kubernetes.client.rest import ApiException

        self.reads.append((group, version, namespace, plural, name))
        if (namespace, name) not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        return self.objects[(namespace, name)]


def _doc(body: dict) -> dict:
    meta = body["metadata"]
    return {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(meta), "spec": dict(body["spec"])}


def test_the_registered_document_holds_the_resolved_endpoint_and_no_secret(store, monkeypatch) -> None:
    from agentfast.operator import main
    from agentfast.runner.spec import parse_agentrun

    api = _ModelConfigs({("team-a", "llm"): MODELCONFIG})
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.STATE, "custom", api, raising=False)
    run = parse_agentrun(_doc(BODY), check_imports=False)
    doc = main._with_model_config(run, _doc(BODY), "team-a/refund-demo", "u1")
    assert api.reads == [("agentfast.dev", "v1alpha1", "team-a", "modelconfigs", "llm")]
    record = store.create_run("team-a/refund-demo", "u1", doc)
    mc = record.spec["modelConfig"]
    assert mc == {
        "name": "llm",
        "uid": "mc-uid",
        "resourceVersion": "7",
        "generation": 2,
        "baseURL": "http://vllm.models.svc:8000/v1",
        "apiKeySecretRef": {"name": "s", "key": "k"},
        "models": ["m"],
        "timeoutSeconds": 30.0,
        "maxRetries": 2,
        "maxTokensPerRequest": 512,
        "prices": {"promptPerMillionTokens": 0.5, "completionPerMillionTokens": 1.5, "currency": "USD"},
    }
    assert parse_agentrun(record.spec, check_imports=False).modelConfig.baseURL == "http://vllm.models.svc:8000/v1"
    # Registered: the run keeps that endpoint; a changed (or deleted) ModelConfig is not read again.
    api.objects.clear()
    again = main._with_model_config(run, _doc(BODY), "team-a/refund-demo", "u1")
    assert again["modelConfig"]["baseURL"] == "http://vllm.models.svc:8000/v1" and len(api.reads) == 1
    # A new AgentRun of the same name (another uid) resolves afresh: here, its ModelConfig is gone.
    with pytest.raises(main.ModelConfigNotFound, match="ModelConfig 'llm', which does not exist in namespace 'team-a'"):
        main._with_model_config(run, _doc(BODY), "team-a/refund-demo", "u2")


def test_a_model_the_config_does_not_allow_or_the_dsn_as_key_is_refused(store, monkeypatch) -> None:
    from agentfast.operator import main
    from agentfast.runner.spec import SpecError, parse_agentrun

    dsn_key = {**MODELCONFIG, "spec": {**MODELCONFIG["spec"], "apiKeySecretRef": {"name": "agentfast-postgres", "key": "dsn"}}}
    api = _ModelConfigs(
        {("team-a", "llm"): MODELCONFIG, ("team-a", "dsn"): {**dsn_key, "metadata": {"name": "dsn", "namespace": "team-a"}}}
    )
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.STATE, "custom", api, raising=False)
    other = {**BODY, "spec": {**BODY["spec"], "model": {"name": "gpt-5", "config": "llm"}}}
    with pytest.raises(SpecError) as err:
        main._with_model_config(parse_agentrun(_doc(other), check_imports=False), _doc(other), "team-a/x", "u3")
    assert str(err.value) == "spec.model.name: model 'gpt-5' is not one ModelConfig 'llm' allows (its spec.models: m)"
    dsn_run = {**BODY, "spec": {**BODY["spec"], "model": {"name": "m", "config": "dsn"}}}
    with pytest.raises(SpecError, match="Postgres DSN"):
        main._with_model_config(parse_agentrun(_doc(dsn_run), check_imports=False), _doc(dsn_run), "team-a/y", "u4")
    assert store.list_runs() == []  # nothing registered for a refused run
    scripted = {**BODY, "spec": {**BODY["spec"], "model": {"name": "m", "script": "refund"}}}
    assert main._with_model_config(parse_agentrun(_doc(scripted), check_imports=False), _doc(scripted), "team-a/z", "u5") == _doc(
        scripted
    )
    assert len(api.reads) == 2  # a scripted run reads no ModelConfig


def test_the_runner_network_policy_allows_dns_postgres_and_the_model_only() -> None:
    import json

    from agentfast.operator.workload import LABEL_RUN, EgressPolicy, build_network_policy

    assert EgressPolicy.from_env({}) is None and EgressPolicy.from_env({"AGENTFAST_NETWORK_POLICY": " "}) is None
    pg = {
        "to": [
            {
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "postgresql"}},
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "agentfast"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 5432}],
    }
    model = {"to": [{"ipBlock": {"cidr": "10.1.2.0/24"}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    policy = EgressPolicy.from_env({"AGENTFAST_NETWORK_POLICY": json.dumps({"dns": [], "postgres": [pg], "model": [model]})})
    runner_pod = build_pod(BODY, RunnerConfig(), model_key=KEY)
    np = build_network_policy(BODY, policy)
    assert np["kind"] == "NetworkPolicy" and np["metadata"]["namespace"] == "team-a"
    # it selects exactly the runner pods of this run (their labels)
    pod_labels = runner_pod["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in np["spec"]["podSelector"]["matchLabels"].items())
    assert np["spec"]["podSelector"]["matchLabels"][LABEL_RUN] == "refund-demo"
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"] and np["spec"]["ingress"] == []
    dns, *rest = np["spec"]["egress"]
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}]
    assert sorted(p["protocol"] for p in dns["ports"]) == ["TCP", "UDP"] and {p["port"] for p in dns["ports"]} == {53}
    assert rest == [pg, model]
    long = {**BODY, "metadata": {**BODY["metadata"], "name": "x" * 253}}
    assert len(build_network_policy(long, policy)["metadata"]["name"]) <= 63


@pytest.mark.parametrize(
    "value, problem",
    [
        ("{not json", "not JSON"),
        ('{"model": []}', "no postgres rule"),
        ('{"postgres": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}], "extra": 1}', "keys dns, postgres, model"),
        ('{"postgres": [{"from": []}]}', "only 'to' and 'ports'"),
        ('{"postgres": [{"to": [{"host": "db.example"}]}]}', "a peer has ipBlock"),
    ],
)
def test_a_malformed_network_policy_setting_is_refused(value: str, problem: str) -> None:
    from agentfast.operator.workload import EgressPolicy

    with pytest.raises(ValueError, match=problem):
        EgressPolicy.from_env({"AGENTFAST_NETWORK_POLICY": value})


def test_status_carries_no_foreign_text_unless_opted_in() -> None:
    leaked = "model call to http://169.254.169.254 failed: HTTP 401: ami-id\ninstance-id\nSECRET-TOKEN"
    c = ctx("Failed", leaked)
    c.status.reason = "ModelError"
    s = status_from_store(c, None, generation=1, old=None, run_id="team-a/r")
    text = str(s)
    assert "SECRET-TOKEN" not in text and "169.254" not in text
    assert "refused the request" in s["message"] and "team-a/r" in s["message"] and s["result"] == s["message"]
    answer = ctx("Succeeded", "the root password is hunter2")
    s = status_from_store(answer, None, generation=1, old=None, run_id="team-a/r")
    assert "hunter2" not in str(s) and "2 iterations and 562 tokens" in s["message"]
    assert "hunter2" in status_from_store(answer, None, generation=1, old=None, summary=True)["result"]
    budget = ctx("Failed", "max_iterations reached: 10 of 10")
    budget.status.reason = "BudgetExceeded"  # our own sentence: copied
    assert status_from_store(budget, None, generation=1, old=None)["message"] == "max_iterations reached: 10 of 10"
    pending = PendingToolCall(
        call_id="call-2-0",
        iteration=2,
        position=0,
        tool_call=ToolCall(id="c", name="issue_refund", arguments='{"x": "IGNORE PREVIOUS"}'),
        idempotency_key="k",
    )
    w = ctx("WaitingForApproval", 'call-2-0: issue_refund({"x": "IGNORE PREVIOUS"})')
    w.status.reason = "AwaitingApproval"
    s = status_from_store(w, pending, generation=1, old=None)
    assert s["message"] == "1 call(s) await a decision: call-2-0 issue_refund"


def test_warnings_are_posted_once_per_run_and_key(monkeypatch) -> None:
    from agentfast.operator import main

    posted = []
    monkeypatch.setattr(main, "_event", lambda body, kind, reason, message: posted.append((reason, message)))
    monkeypatch.setattr(main, "_warned", set())
    body = {"metadata": {"name": "r", "namespace": "n", "uid": "u-1"}}
    for _ in range(3):  # three reconciles, the reason changing between them
        for reason in ("NotAwaitingDecision", "DecisionConflict"):
            main._warn_once(body, "call-9-9", reason, "x")
    main._warn_once(body, "call-9-8", "NotAwaitingDecision", "x")
    # a new run of that name
    main._warn_once({"metadata": {**body["metadata"], "uid": "u-2"}}, "call-9-9", "NotAwaitingDecision", "x")
    assert len(posted) == 3


def test_the_operator_never_imports_or_reads_what_a_spec_names(tmp_path, monkeypatch) -> None:
    import sys
    from pathlib import Path

    import pytest

    from agentfast.runner.spec import SpecError, check_cluster_policy, parse_agentrun
    from agentfast.testing.scripted import bundled_scripts

    (tmp_path / "evil_at_import.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = {
        **BODY,
        "spec": {
            "model": {"name": "m", "script": "refund"},
            "input": "hi",
            "tools": [{"name": "t", "ref": "evil_at_import:tool"}],
            "budget": {"classifier": "evil_at_import:c"},
        },
    }
    run = parse_agentrun(doc, check_imports=False)
    check_cluster_policy(run, ("evil_at_import",), bundled_scripts())  # allowed: accepted, still not imported
    with pytest.raises(SpecError) as err:
        check_cluster_policy(run, ("agentfast.runner.examples",), bundled_scripts())
    assert "spec.tools[0].ref" in str(err.value) and "spec.budget.classifier" in str(err.value)
    assert "evil_at_import" not in sys.modules
    for path in ("/dev/zero", "/etc/passwd", "../../etc/passwd", "refund.yaml", "nosuch"):
        bad = parse_agentrun(
            {**doc, "spec": {**doc["spec"], "tools": [], "budget": {}, "model": {"name": "m", "script": path}}},
            check_imports=False,
        )
        with pytest.raises(SpecError) as err:
            check_cluster_policy(bad, ("agentfast.runner.examples",), bundled_scripts())
        assert "not a bundled script" in str(err.value) and "root:" not in str(err.value)
    # The operator's module has no path to user code: no import, preflight, script loading.
    source = (Path(__file__).resolve().parent.parent / "operator" / "main.py").read_text()
    for name in ("preflight", "import_refs", "resolve_ref", "load_script", "check_imports=True", "importlib"):
        assert name not in source, name


# -- issue 14: replacing a lost runner pod ---------------------------------------------------------

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def rp(
    attempt: int = 1,
    *,
    phase: str = "Failed",
    code: int | None = 75,
    reason: str | None = "Error",
    ran_s: float = 60.0,
    deleting: bool = False,
    disrupted: str | None = None,
    counted: int = 0,
    finished_ago_s: float = 0.0,
    waiting: str | None = None,
) -> RunnerPod:
    finished = T0 - timedelta(seconds=finished_ago_s)
    return RunnerPod(
        name=f"agentrun-r-{attempt}",
        attempt=attempt,
        counted=counted,
        phase=phase,
        created_at=finished - timedelta(seconds=ran_s + 1),
        deletion_due=(T0 + timedelta(seconds=30)) if deleting else None,
        disrupted=disrupted,
        started_at=finished - timedelta(seconds=ran_s),
        exit_code=code,
        exit_reason=reason if code is not None else None,
        finished_at=finished if code is not None else None,
        waiting_reason=waiting,
    )


def step(
    pods: list[RunnerPod],
    phase: str | None = "Running",
    *,
    all_decided: bool = False,
    alive: bool = False,
    limit: int = 6,
    now: datetime = T0,
):
    return next_step(pods, now, phase=phase, all_decided=all_decided, runner_alive=alive, restart_limit=limit)


def test_a_lost_runner_is_replaced_at_once_however_often_it_is_lost() -> None:
    # Deleted (SIGTERM: 75), evicted, killed (137), or "retry me": the next attempt at once, uncounted,
    # on the fifth loss as on the first (no growing backoff: nothing was lost, G1/G2).
    for lost in (
        rp(5, code=75, deleting=True),
        rp(5, code=143, disrupted="EvictionByEvictionAPI"),
        rp(5, code=137),
        rp(5, code=75),
        rp(5, code=None, phase="Running", deleting=True, disrupted="DeletionByTaintManager"),
    ):
        now = T0 + timedelta(seconds=60) if lost.exit_code is None else T0  # a lost node: past its deletion deadline
        s = step([rp(4, code=75), lost], now=now)
        assert (s.action, s.attempt, s.counted, s.lost) == ("create", 6, 0, lost), lost
    assert step([]).attempt == 1 and step([]).action == "create"  # the first runner (or every pod gone)


def running(attempt: int, **kw) -> RunnerPod:
    return rp(attempt, code=None, phase="Running", **kw)


def test_a_leaving_pod_is_replaced_at_its_deletion_not_at_its_runners_exit() -> None:
    # Deleted (deletionTimestamp), evicted (DisruptionTarget before the deletion lands), taken off a
    # lost node: its runner still runs (SIGTERM, grace period), and the next pod is created now,
    # uncounted and without backoff even after failures that counted (a deletion says nothing of them).
    for leaving in (
        running(3, deleting=True),
        running(3, disrupted="EvictionByEvictionAPI"),
        running(3, deleting=True, disrupted="DeletionByTaintManager", counted=4),
        rp(3, code=None, phase="Pending", deleting=True, waiting="ContainerCreating"),
    ):
        s = step([rp(2, code=137, reason="OOMKilled", counted=3), leaving])
        assert (s.action, s.attempt, s.counted, s.lost, s.delay_s) == ("create", 4, 0, leaving, 0.0), leaving
    assert step([running(1, deleting=True)], "WaitingForApproval", all_decided=False).action == "create"  # its runner waits in it
    assert running(1, deleting=True).loss() == "deleted" and running(1, disrupted="PreemptionByScheduler").loss() == "preempted"
    assert running(1, deleting=True, disrupted="DeletionByTaintManager").loss() == "evicted from a lost node"


def test_no_second_replacement_when_the_leaving_pod_finally_stops() -> None:
    # The replacement exists (starting or running): the old pod still stopping, then stopped, then
    # gone, each changes nothing; nor does a node that never confirms (past the deletion deadline).
    for old in (
        running(1, deleting=True),
        rp(1, code=75, deleting=True),
        rp(1, code=137, disrupted="EvictionByEvictionAPI"),
        running(1, deleting=True, disrupted="DeletionByTaintManager"),
    ):
        for new in (rp(2, code=None, phase="Pending"), running(2)):
            for now in (T0, T0 + timedelta(seconds=120)):
                assert step([old, new], now=now).action == "none", (old, new, now)
    assert step([running(2)]).action == "none"
    # A replacement that cannot start is reported, its leaving predecessor beside it or not.
    s = step([running(1, deleting=True), rp(2, code=None, phase="Pending", waiting="CreateContainerConfigError")])
    assert s.action == "none" and s.blocked[0] == "CreateContainerConfigError" and "agentrun-r-2" in s.blocked[1]
    # A pod that is not leaving is never replaced while it runs or starts.
    assert step([rp(1, code=None, phase="Pending")]).action == "none" and step([running(1)]).action == "none"


def test_a_replacement_that_found_the_run_held_waits_for_the_old_runner() -> None:
    # The replacement gave up waiting (exit 76) while the leaving pod's runner still holds the run:
    # look again later, never a third pod at once (no retry loop); once no runner is alive, go on.
    old, owned = running(1, deleting=True), rp(2, code=76, ran_s=40.0)
    s = step([old, owned], alive=True)
    assert (s.action, s.reason) == ("later", "RunnerElsewhere")
    s = step([old, owned], alive=False)
    assert (s.action, s.attempt) == ("create", 3)
    assert step([rp(1, code=75, deleting=True), owned], alive=False).attempt == 3
    # A replacement that exits on its own beside a leaving pod is judged as before: its own exit code.
    assert step([old, rp(2, code=2)]).reason == "RunnerFailed"
    assert step([old, rp(2, code=137, reason="OOMKilled")]).reason == "BackingOff"


def test_failures_that_would_repeat_back_off_and_end_at_the_restart_limit() -> None:
    oom = rp(3, code=137, reason="OOMKilled", counted=1)
    s = step([oom])  # the second OOM kill in a row: 10 s
    assert (s.action, s.reason) == ("later", "BackingOff") and s.delay_s == pytest.approx(10.0) and "OOM-killed" in s.message
    s = step([rp(3, code=137, reason="OOMKilled", counted=1, finished_ago_s=11)])
    assert (s.action, s.attempt, s.counted) == ("create", 4, 2)
    crash = rp(7, code=3, ran_s=0.8, counted=6, finished_ago_s=999)  # dies at start (e.g. exit 3: no Postgres), 7th time
    s = step([crash], limit=6)
    assert (s.action, s.reason) == ("fail", "RestartLimit") and "7 times in a row" in s.message
    assert step([rp(2, code=3, ran_s=120.0, counted=5)]).counted == 0  # it ran a while: not a crash loop
    assert [backoff_s(n) for n in range(1, 9)] == [5, 10, 20, 40, 80, 160, 300, 300]


def test_the_runs_own_ending_and_another_live_runner_are_not_retried() -> None:
    s = step([rp(1, code=2)])
    assert (s.action, s.reason) == ("fail", "RunnerFailed")
    assert step([rp(1, code=1)], phase="Failed").action == "none"  # the runner committed the ending
    assert step([rp(1, code=76)], alive=True).action == "later"  # another runner holds it: wait, never a retry loop
    assert step([rp(1, code=76)], alive=False).action == "create"  # it let go


def test_a_suspended_run_gets_a_runner_only_once_decided() -> None:
    released = rp(2, code=0, reason="Completed")
    s = step([released], "WaitingForApproval", all_decided=False)
    assert (s.action, s.suspended) == ("none", True)
    s = step([released], "WaitingForApproval", all_decided=True)
    assert (s.action, s.attempt, s.lost) == ("create", 3, None)


def test_a_pod_that_cannot_start_says_why() -> None:
    s = step([rp(1, phase="Pending", code=None, waiting="CreateContainerConfigError")])
    assert s.action == "none" and s.blocked[0] == "CreateContainerConfigError" and "agentrun-r-1" in s.blocked[1]


def test_status_shows_the_reason_suspension_and_a_blocked_pod() -> None:
    pending = PendingToolCall(
        call_id="call-1-0", iteration=1, position=0, tool_call=ToolCall(id="c", name="t"), idempotency_key="k"
    )
    s = status_from_store(ctx("WaitingForApproval"), pending, generation=2, old=None, suspended=True)
    conds = {c["type"]: c for c in s["conditions"]}
    assert s["reason"] == "R" and conds["Suspended"]["status"] == "True" and conds["RunnerPodReady"]["status"] == "True"
    s = status_from_store(
        None, None, generation=1, old=None, blocked=("CreateContainerConfigError", "runner pod x cannot start: secret")
    )
    assert (s["phase"], s["reason"]) == ("Pending", "CreateContainerConfigError") and "cannot start" in s["message"]
    assert {c["type"]: c["status"] for c in s["conditions"]}["RunnerPodReady"] == "False"


# -- issue 14 item 7: runner pods configurable from the chart and per run ---------------------------


def _with_runner(runner: dict, body: dict = BODY) -> dict:
    return {**body, "spec": {**body["spec"], "runner": runner}}


CHART_ENV = {
    "AGENTFAST_RUNNER_IMAGE": "reg.example.com/agentfast:1.4",
    "AGENTFAST_RUNNER_RESOURCES": '{"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi", "nvidia.com/gpu": 1}}',
    "AGENTFAST_RUNNER_NODE_SELECTOR": '{"pool": "agents", "kubernetes.io/arch": "amd64"}',
    "AGENTFAST_RUNNER_TOLERATIONS": '[{"key": "dedicated", "operator": "Equal", "value": "agents", "effect": "NoSchedule"}]',
    "AGENTFAST_RUNNER_AFFINITY": '{"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "podAffinityTerm":'
    ' {"labelSelector": {"matchLabels": {"app.kubernetes.io/component": "runner"}}, "topologyKey": "kubernetes.io/hostname"}}]}}',
    "AGENTFAST_RUNNER_PRIORITY_CLASS": "agents",
    "AGENTFAST_RUNNER_ALLOWED_IMAGES": '["reg.example.com/team-a/", "reg.example.com/shared/agent", "ghcr.io/acme/tools:2.0"]',
    "AGENTFAST_RUNNER_SERVICE_ACCOUNT_CREATE": "true",
    "AGENTFAST_RUNNER_SERVICE_ACCOUNT_ANNOTATIONS": '{"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/runner"}',
    "AGENTFAST_OPERATOR_SERVICE_ACCOUNT": "agentfast-operator",
}


def test_the_charts_runner_settings_reach_every_runner_pod() -> None:
    cfg = RunnerConfig.from_env(CHART_ENV)
    assert cfg.service_account == "agentfast-runner" and cfg.service_account_create and not cfg.automount_token
    pod = build_pod(BODY, cfg)["spec"]
    [c] = pod["containers"]
    assert c["image"] == "reg.example.com/agentfast:1.4"
    # runner.resources is applied (it used to change nothing); numbers from helm's toJson become strings
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi", "nvidia.com/gpu": "1"}}
    assert pod["nodeSelector"] == {"pool": "agents", "kubernetes.io/arch": "amd64"} and pod["priorityClassName"] == "agents"
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 50
    keys = [t["key"] for t in pod["tolerations"]]
    assert keys == ["node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable", "dedicated"]  # the operator's own first
    assert pod["serviceAccountName"] == "agentfast-runner" and pod["automountServiceAccountToken"] is False
    # nothing set: the pod as before, with the chart's default resources
    plain = build_pod(BODY, RunnerConfig.from_env({}))["spec"]
    assert plain["containers"][0]["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    assert not {"nodeSelector", "affinity", "priorityClassName", "serviceAccountName"} & set(plain)
    assert plain["automountServiceAccountToken"] is False
    opted_in = RunnerConfig.from_env({**CHART_ENV, "AGENTFAST_RUNNER_AUTOMOUNT_TOKEN": "true"})
    assert build_pod(BODY, opted_in)["spec"]["automountServiceAccountToken"] is True


def test_a_runs_spec_runner_replaces_the_charts_values_per_key() -> None:
    cfg = RunnerConfig.from_env(CHART_ENV)
    run = _with_runner(
        {
            "image": "reg.example.com/team-a/tools:3.1",
            "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "4", "memory": "2Gi"}},
            "nodeSelector": {"pool": "big", "kubernetes.io/os": "linux"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eu-1a", "eu-1b"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "batch-high",
        }
    )
    pod = build_pod(run, cfg)["spec"]
    [c] = pod["containers"]
    assert c["image"] == "reg.example.com/team-a/tools:3.1"
    assert c["resources"] == {
        "requests": {"cpu": "2", "memory": "256Mi"},
        "limits": {"memory": "2Gi", "nvidia.com/gpu": "1", "cpu": "4"},
    }
    assert pod["nodeSelector"] == {"pool": "big", "kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux"}
    assert [t["key"] for t in pod["tolerations"]][2:] == ["dedicated", "gpu"]  # added to the chart's
    assert list(pod["affinity"]) == ["nodeAffinity"]  # replaced as a whole: the chart's anti-affinity is gone
    expr = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ][0]
    assert expr == {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eu-1a", "eu-1b"]}
    assert pod["priorityClassName"] == "batch-high"
    # everything else of the pod is the operator's, whatever the run says
    base = build_pod(BODY, cfg)["spec"]
    for key in (
        "securityContext",
        "volumes",
        "serviceAccountName",
        "automountServiceAccountToken",
        "enableServiceLinks",
        "restartPolicy",
    ):
        assert pod[key] == base[key], key
    for key in ("command", "env", "securityContext", "volumeMounts", "imagePullPolicy"):
        assert c[key] == base["containers"][0][key], key


def test_a_request_above_its_merged_limit_is_refused_naming_the_field() -> None:
    from agentfast.operator.workload import parse_quantity, runner_settings
    from agentfast.runner.spec import SpecError

    assert parse_quantity("500m") == parse_quantity("0.5") and parse_quantity("1Gi") == 1024**3 and parse_quantity("1e3") is None
    cfg = RunnerConfig()  # limits.memory 512Mi
    with pytest.raises(
        SpecError, match=r"spec.runner.resources: requests.memory 1Gi is above limits.memory 512Mi .*give limits.memory too"
    ):
        runner_settings(_with_runner({"resources": {"requests": {"memory": "1Gi"}}}), cfg)
    ok = runner_settings(_with_runner({"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}}}), cfg)
    assert ok["resources"]["requests"]["memory"] == ok["resources"]["limits"]["memory"] == "1Gi"
    with pytest.raises(SpecError, match="requests.cpu 2 is above limits.cpu 500m"):
        runner_settings(_with_runner({"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "500m"}}}), cfg)


@pytest.mark.parametrize(
    "image, allowed",
    [
        ("agentfast:dev", True),  # the chart's own image, always
        ("reg.example.com/team-a/tools:1", True),  # under a prefix
        ("reg.example.com/team-a/sub/tools@sha256:" + "a" * 64, True),
        ("reg.example.com/shared/agent:9", True),  # a repository: any tag
        ("reg.example.com/shared/agent@sha256:" + "b" * 64, True),
        ("ghcr.io/acme/tools:2.0", True),  # exactly
        ("ghcr.io/acme/tools:2.1", False),  # an entry with a tag allows that tag only
        ("reg.example.com/team-ab/tools:1", False),  # a prefix ends at a /
        ("reg.example.com/shared/agent-evil:1", False),  # a repository is not a prefix
        ("reg.example.com/shared/agent/sub:1", False),
        ("agentfast:evil", False),  # the own image exactly, not its repository
        ("docker.io/library/agentfast:dev", False),  # compared as written, never resolved
        ("reg.example.com/team-a/../evil/x:1", False),  # not a reference at all
        ("reg.example.com/team-a/Tools:1", False),
        ("reg.example.com:443/team-a/tools:1", False),
        ("evil.example.com/reg.example.com/team-a/tools:1", False),
    ],
)
def test_only_allowed_images_run_compared_by_name(image: str, allowed: bool) -> None:
    from agentfast.runner.spec import image_allowed

    entries = ("reg.example.com/team-a/", "reg.example.com/shared/agent", "ghcr.io/acme/tools:2.0")
    assert image_allowed(image, entries, "agentfast:dev") is allowed


def test_an_image_outside_the_allow_list_is_refused_before_any_pod_naming_the_field() -> None:
    from agentfast.runner.spec import SpecError

    cfg = RunnerConfig()  # default: allowedImages [] - only the chart's own image
    for image in ("evil.example.com/miner:latest", "agentfast:latest", "reg.example.com/team-a/tools:1"):
        with pytest.raises(SpecError) as err:
            build_pod(_with_runner({"image": image}), cfg)
        assert str(err.value).startswith(
            f"spec.runner.image: '{image}' is not an image this cluster allows"
        ) and "agentfast:dev" in str(err.value)
    assert build_pod(_with_runner({"image": "agentfast:dev"}), cfg)["spec"]["containers"][0]["image"] == "agentfast:dev"


@pytest.mark.parametrize(
    "runner, problem",
    [
        # nothing of a pod's security or identity can be said through spec.runner: unknown keys are refused
        ({"securityContext": {"privileged": True}}, "securityContext"),
        ({"privileged": True}, "privileged"),
        ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "volumes"),
        ({"hostPID": True}, "hostPID"),
        ({"hostNetwork": True}, "hostNetwork"),
        ({"serviceAccountName": "kube-system/admin"}, "serviceAccountName"),
        ({"serviceAccount": "default"}, "serviceAccount"),
        ({"automountServiceAccountToken": True}, "automountServiceAccountToken"),
        ({"env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}, "env"),
        ({"command": ["sh", "-c", "id"]}, "command"),
        ({"imagePullSecrets": [{"name": "agentfast-postgres"}]}, "imagePullSecrets"),
        ({"resources": {"requests": {"cpu": "1", "hugepages-2Mi": "1Gi"}}}, "hugepages-2Mi"),
        ({"resources": {"claims": [{"name": "gpu"}]}}, "claims"),
        ({"resources": {"limits": {"memory": "-1Gi"}}}, "limits.memory"),
        ({"tolerations": [{"operator": "Exists"}]}, "names a key"),  # tolerate every taint: an admin's only
        (
            {"tolerations": [{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}]},
            "operator's own",
        ),
        ({"priorityClassName": "system-node-critical"}, "system- priority classes"),
        ({"nodeSelector": {"a" * 400: "x"}}, "label key"),
        ({"nodeSelector": {f"k{i}": "v" for i in range(33)}}, "nodeSelector"),
        ({"tolerations": [{"key": f"k{i}", "operator": "Exists"} for i in range(33)]}, "tolerations"),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "In", "values": ["v"] * 33}]}]
                        }
                    }
                }
            },
            "values",
        ),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "In"}]}]
                        }
                    }
                }
            },
            "needs values",
        ),
        (
            {
                "affinity": {
                    "podAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "labelSelector": {"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["1"]}]},
                                "topologyKey": "zone",
                            }
                        ]
                    }
                }
            },
            "operator",
        ),
        ({"image": "x" * 600}, "image"),
    ],
)
def test_spec_runner_cannot_reach_anything_but_image_resources_and_placement(runner: dict, problem: str) -> None:
    from agentfast.runner.spec import SpecError, parse_agentrun

    with pytest.raises(SpecError) as err:
        build_pod(_with_runner(runner), RunnerConfig.from_env(CHART_ENV))
    assert err.value.args[0].startswith("spec.runner") and problem in str(err.value)
    with pytest.raises(SpecError) as err:  # and the operator's reconcile refuses the same spec: Failed, InvalidSpec
        parse_agentrun(
            _with_runner(runner, {**BODY, "spec": {**BODY["spec"], "model": {"name": "m", "script": "refund"}}}),
            check_imports=False,
        )
    assert "spec.runner" in str(err.value)


def test_the_pods_identity_and_security_are_built_from_the_chart_alone() -> None:
    # By construction: build_pod reads spec.runner only through runner_settings, whose model has
    # these fields and no other (extra="forbid"); a spec.runner carrying more is refused before
    # anything is built (the parametrized attacks above).
    from agentfast.runner.spec import RunnerSpec

    assert set(RunnerSpec.model_fields) == {"image", "resources", "nodeSelector", "tolerations", "affinity", "priorityClassName"}
    assert RunnerSpec.model_config["extra"] == "forbid"
    cfg = RunnerConfig.from_env(CHART_ENV)
    pod = build_pod(_with_runner({"nodeSelector": {"kubernetes.io/os": "linux"}}), cfg)
    assert pod["spec"]["serviceAccountName"] == cfg.service_account  # the chart's, never the run's


@pytest.mark.parametrize(
    "env, problem",
    [
        ({"AGENTFAST_RUNNER_RESOURCES": "{nope"}, "AGENTFAST_RUNNER_RESOURCES is not JSON"),
        ({"AGENTFAST_RUNNER_RESOURCES": '{"request": {}}'}, "requests and limits"),
        ({"AGENTFAST_RUNNER_RESOURCES": '{"limits": {"memory": true}}'}, "AGENTFAST_RUNNER_RESOURCES.limits"),
        ({"AGENTFAST_RUNNER_NODE_SELECTOR": '["pool"]'}, "AGENTFAST_RUNNER_NODE_SELECTOR"),
        ({"AGENTFAST_RUNNER_TOLERATIONS": '{"key": "x"}'}, "AGENTFAST_RUNNER_TOLERATIONS: expected a list"),
        ({"AGENTFAST_RUNNER_TOLERATIONS": '[{"key": "x", "operator": "Maybe"}]'}, "AGENTFAST_RUNNER_TOLERATIONS: [0].operator"),
        ({"AGENTFAST_RUNNER_AFFINITY": '{"nodeAfinity": {}}'}, "AGENTFAST_RUNNER_AFFINITY: nodeAfinity"),
        ({"AGENTFAST_RUNNER_PRIORITY_CLASS": "Not A Name"}, "AGENTFAST_RUNNER_PRIORITY_CLASS"),
        ({"AGENTFAST_RUNNER_ALLOWED_IMAGES": '"reg.io/team/"'}, "AGENTFAST_RUNNER_ALLOWED_IMAGES: expected a list"),
        ({"AGENTFAST_RUNNER_ALLOWED_IMAGES": '["reg.io/team-a"]'}, None),  # a repository: fine
        ({"AGENTFAST_RUNNER_ALLOWED_IMAGES": '["reg.io/team/../x/"]'}, "AGENTFAST_RUNNER_ALLOWED_IMAGES[0]"),
        ({"AGENTFAST_RUNNER_ALLOWED_IMAGES": '["*"]'}, "AGENTFAST_RUNNER_ALLOWED_IMAGES[0]"),
        (
            {
                "AGENTFAST_RUNNER_SERVICE_ACCOUNT": "agentfast-operator",
                "AGENTFAST_OPERATOR_SERVICE_ACCOUNT": "agentfast-operator",
            },
            "operator's own",
        ),
        (
            {"AGENTFAST_RUNNER_SERVICE_ACCOUNT": "default", "AGENTFAST_RUNNER_SERVICE_ACCOUNT_CREATE": "true"},
            "default ServiceAccount",
        ),
        ({"AGENTFAST_RUNNER_SERVICE_ACCOUNT": "team-a/admin"}, "not a ServiceAccount name"),
        ({"AGENTFAST_RUNNER_SERVICE_ACCOUNT_ANNOTATIONS": '{"a": "b"}'}, "only with AGENTFAST_RUNNER_SERVICE_ACCOUNT_CREATE"),
        ({"AGENTFAST_RUNNER_SERVICE_ACCOUNT_CREATE": "yes"}, "expected true or false"),
    ],
)
def test_malformed_runner_settings_are_refused_naming_the_variable(env: dict, problem: str | None) -> None:
    if problem is None:
        RunnerConfig.from_env(env)
        return
    with pytest.raises(ValueError) as err:
        RunnerConfig.from_env(env)
    assert problem in str(err.value)


class _ServiceAccounts:
    """The three ServiceAccount calls operator/identity.py makes, over a dict (like _ModelConfigs)."""

    def __init__(self, objects: dict) -> None:
        self.objects, self.calls = objects, []

    def read_namespaced_service_account(self, name, namespace, **_):
        from types import SimpleNamespace

        from kubernetes.client.rest import ApiException

        self.calls.append(("read", namespace, name))
        if (namespace, name) not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        meta = self.objects[(namespace, name)]["metadata"]
        return SimpleNamespace(metadata=SimpleNamespace(labels=meta.get("labels"), annotations=meta.get("annotations")))

    def create_namespaced_service_account(self, namespace, body, **_):
        self.calls.append(("create", namespace, body["metadata"]["name"]))
        self.objects[(namespace, body["metadata"]["name"])] = body

    def patch_namespaced_service_account(self, name, namespace, patch, **_):
        self.calls.append(("patch", namespace, name))
        self.objects[(namespace, name)]["metadata"].setdefault("annotations", {}).update(patch["metadata"]["annotations"])


def test_the_operator_makes_the_runner_service_account_with_the_charts_annotations_and_leaves_others_alone() -> None:
    from agentfast.operator import identity

    identity.forget()
    api = _ServiceAccounts(
        {("team-b", "agentfast-runner"): {"metadata": {"labels": {"team": "b"}, "annotations": {"x": "team-b's"}}}}
    )
    assert identity.ensure_runner_service_account("team-a", api, RunnerConfig()) == "off"
    assert RunnerConfig(service_account_create=True).service_account == "agentfast-runner"  # what it makes is what pods name
    cfg = RunnerConfig.from_env(CHART_ENV)
    assert identity.ensure_runner_service_account("team-a", api, cfg) == "created"
    made = api.objects[("team-a", "agentfast-runner")]
    assert made["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/runner"}
    assert (
        made["automountServiceAccountToken"] is False
        and made["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "agentfast"
    )
    assert identity.ensure_runner_service_account("team-a", api, cfg) == "cached"
    # the chart's annotation changed: the next check (after forget, or RECHECK_S) sets it
    identity.forget("team-a")
    moved = RunnerConfig.from_env(
        {**CHART_ENV, "AGENTFAST_RUNNER_SERVICE_ACCOUNT_ANNOTATIONS": '{"eks.amazonaws.com/role-arn": "arn:new"}'}
    )
    assert identity.ensure_runner_service_account("team-a", api, moved) == "updated"
    assert api.objects[("team-a", "agentfast-runner")]["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == "arn:new"
    # one of that name the operator did not make: never patched
    assert identity.ensure_runner_service_account("team-b", api, cfg) == "foreign"
    assert api.objects[("team-b", "agentfast-runner")]["metadata"]["annotations"] == {"x": "team-b's"}
    assert not any(c[0] in ("create", "patch") and c[1] == "team-b" for c in api.calls)
    identity.forget()


def test_reconcile_fails_a_run_naming_a_foreign_image_before_registering_it(store, monkeypatch) -> None:
    from agentfast.operator import main

    published = []
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main, "publish_status", lambda body, ctx, pending, **kw: published.append(kw.get("override")))
    monkeypatch.setattr(main.SETTINGS, "runner", RunnerConfig())
    scripted = {**BODY, "spec": {"model": {"name": "m", "script": "refund"}, "input": "hi"}}
    main.reconcile(_with_runner({"image": "evil.example.com/miner:1"}, scripted))
    [(phase, reason, message)] = published
    assert (phase, reason) == ("Failed", "InvalidSpec") and message.startswith(
        "spec.runner.image: 'evil.example.com/miner:1' is not"
    )
    published.clear()
    main.reconcile(_with_runner({"resources": {"requests": {"memory": "4Gi"}}}, scripted))
    assert published[0][:2] == ("Failed", "InvalidSpec") and "spec.runner.resources" in published[0][2]
    assert store.list_runs() == []  # nothing registered, no pod asked for


# -- the operator's verdict from the pods is the run's ending ---------------------------------------


def api_pod(p: RunnerPod):
    """``p`` as the kubernetes client returns it (the attributes RunnerPod.from_api reads)."""
    from types import SimpleNamespace as NS

    from agentfast.operator.workload import ANNOTATION_ATTEMPT, ANNOTATION_COUNTED

    terminated = (
        NS(exit_code=p.exit_code, reason=p.exit_reason, started_at=p.started_at, finished_at=p.finished_at)
        if p.exit_code is not None
        else None
    )
    waiting = NS(reason=p.waiting_reason, message='secret "k" not found') if p.waiting_reason else None
    running = NS(started_at=p.started_at) if terminated is None and waiting is None else None
    return NS(
        metadata=NS(
            name=p.name,
            annotations={ANNOTATION_ATTEMPT: str(p.attempt), ANNOTATION_COUNTED: str(p.counted)},
            creation_timestamp=p.created_at,
            deletion_timestamp=p.deletion_due,
        ),
        status=NS(
            phase=p.phase,
            conditions=[],
            container_statuses=[NS(name="runner", state=NS(terminated=terminated, waiting=waiting, running=running))],
        ),
    )


class _Pods:
    """The pod calls of the operator (list by the run's uid label, create, delete), over a list."""

    def __init__(self, pods: list[RunnerPod]) -> None:
        self.pods, self.calls = list(pods), []

    def list_namespaced_pod(self, namespace, label_selector, **_):
        from types import SimpleNamespace

        self.calls.append(("list", namespace, label_selector))
        return SimpleNamespace(items=[api_pod(p) for p in self.pods])

    def delete_namespaced_pod(self, name, namespace, **_):
        self.calls.append(("delete", namespace, name))
        self.pods = [p for p in self.pods if p.name != name]

    def create_namespaced_pod(self, namespace, body, **_):
        self.calls.append(("create", namespace, body["metadata"]["name"]))


SCRIPTED = {
    **BODY,
    "metadata": {**BODY["metadata"], "generation": 1},
    "spec": {"model": {"name": "m", "script": "refund"}, "input": "hi"},
}


def _ended_status(phase: str, ago_s: float, **extra) -> dict:
    ctype = {"Succeeded": "Ready", "Failed": "Failed", "Cancelled": "Cancelled"}[phase]
    at = (datetime.now(UTC) - timedelta(seconds=ago_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "phase": phase,
        "observedGeneration": 1,
        "runnerPod": "agentrun-refund-demo-2",
        "conditions": [{"type": ctype, "status": "True", "lastTransitionTime": at}],
        **extra,
    }


@pytest.fixture
def operator_on(store, monkeypatch):
    """The operator's module wired to ``store``, fake pods, no NetworkPolicies; publish_status and
    _look_again recorded, not done."""
    from agentfast.operator import main

    seen = {"published": [], "later": []}
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.SETTINGS, "egress", None)
    monkeypatch.setattr(main, "publish_status", lambda body, ctx, pending, **kw: seen["published"].append(kw))
    monkeypatch.setattr(main, "_look_again", lambda ns, name, delay: seen["later"].append((ns, name, delay)))
    monkeypatch.setattr(main, "ensure_runner_secret", lambda *a, **kw: None)
    monkeypatch.setattr(main, "ensure_runner_service_account", lambda *a, **kw: None)
    monkeypatch.setattr(main, "_event", lambda *a, **kw: None)

    def wire(pods: list[RunnerPod], ttl: int | None = None) -> _Pods:
        api = _Pods(pods)
        monkeypatch.setattr(main.STATE, "core", api, raising=False)
        monkeypatch.setattr(main.SETTINGS, "runner", RunnerConfig(pod_ttl_s=ttl))
        return api

    seen["wire"] = wire
    return main, seen


def test_a_run_the_operator_failed_stays_failed_when_its_pods_are_gone(store, operator_on) -> None:
    # RestartLimit is decided from the pods; it is committed as the run's ending, so once the pods
    # are deleted (here by their TTL, 0) the run does not read as "no pod yet" and start again.
    main, seen = operator_on
    store.create_run("team-a/refund-demo", "u1", _doc(SCRIPTED))
    crash = rp(7, code=3, ran_s=0.8, counted=6, finished_ago_s=5)  # the 7th crash at start in a row
    crash = RunnerPod(
        **{
            **crash.__dict__,
            "name": "agentrun-refund-demo-7",
            "finished_at": datetime.now(UTC) - timedelta(seconds=5),
            "started_at": datetime.now(UTC) - timedelta(seconds=5.8),
        }
    )
    api = seen["wire"]([crash], 0)
    main.reconcile({**SCRIPTED, "status": {"phase": "Pending", "observedGeneration": 1}})
    override = seen["published"][-1]["override"]
    assert override[:2] == ("Failed", "RestartLimit") and "7 times in a row" in override[2]
    context, _ = store.load_context("team-a/refund-demo")
    assert (context.status.phase, context.status.reason) == (
        "Failed",
        "RestartLimit",
    ) and "7 times in a row" in context.status.message
    assert ("delete", "team-a", "agentrun-refund-demo-7") in api.calls  # TTL 0: at once
    assert not any(c[0] == "create" for c in api.calls)
    # The next reconcile finds no pod at all: the run stays Failed, nothing is started.
    main.reconcile({**SCRIPTED, "status": _ended_status("Failed", 1)})
    assert not any(c[0] == "create" for c in api.calls)
    published = seen["published"][-1]
    assert published.get("override") is None and (published.get("pod") or {}).get("deleted_at")
    # status says the operator's own sentence, not a pointer to Postgres
    s = status_from_store(context, None, generation=1, old=None, run_id="team-a/refund-demo")
    assert s["reason"] == "RestartLimit" and "7 times in a row" in s["message"]


# -- issue 14 item 3: an ended run's runner pods are deleted after runner.podTTLSecondsAfterFinished --


def test_an_ended_runs_pods_are_due_ttl_after_the_end_or_after_they_stopped() -> None:
    from agentfast.operator.lifecycle import ended_at, expired_pods

    ended = T0 - timedelta(seconds=100)
    stopped_before = rp(1, code=0, reason="Completed", finished_ago_s=400)  # released its pod long before the run ended
    stopped_after = rp(2, code=0, reason="Completed", finished_ago_s=40)  # exited just after committing the end
    blocked = rp(3, phase="Pending", code=None, waiting="CreateContainerConfigError")  # never started, never stops
    going = rp(4, code=0, reason="Completed", finished_ago_s=999, deleting=True)
    due, wait = expired_pods([stopped_before, stopped_after, blocked, going], T0, ended=ended, ttl_s=90)
    assert due == [stopped_before, blocked] and wait == pytest.approx(50.0)  # stopped_after: 90 s from its own stop
    due, wait = expired_pods([stopped_before, stopped_after], T0, ended=ended, ttl_s=3600)
    assert due == [] and wait == pytest.approx(3500.0)
    assert expired_pods([stopped_after], T0, ended=T0, ttl_s=0) == ([stopped_after], None)  # 0: at once
    assert expired_pods([going], T0, ended=ended, ttl_s=0) == ([], None)  # being deleted already: nothing to wait for
    assert expired_pods([], T0, ended=ended, ttl_s=0) == ([], None)
    # The end is the status' own record (an operator restart does not reset the clock) ...
    for phase, ctype in (("Succeeded", "Ready"), ("Failed", "Failed"), ("Cancelled", "Cancelled")):
        st = {
            "phase": phase,
            "conditions": [
                {"type": "Ready", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"},
                {"type": ctype, "status": "True", "lastTransitionTime": "2026-11-30T08:00:00Z"},
            ],
        }
        assert ended_at(st, T0) == datetime(2026, 11, 30, 8, 0, tzinfo=UTC), phase
    # ... and now when status does not show the end yet (this reconcile publishes it)
    assert (
        ended_at(
            {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2020-01-01T00:00:00Z"}],
            },
            T0,
        )
        == T0
    )
    assert ended_at({}, T0) == T0
    assert (
        ended_at({"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "soon"}]}, T0)
        == T0
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, 3600),
        ("0", 0),
        ("86400", 86400),
        ("-1", None),
        ("", None),
        ("null", None),
        ("-2", "AGENTFAST_RUNNER_POD_TTL_SECONDS"),
        ("1h", "AGENTFAST_RUNNER_POD_TTL_SECONDS"),
        ("31536001", "AGENTFAST_RUNNER_POD_TTL_SECONDS"),
    ],
)
def test_the_pod_ttl_setting(value: str | None, expected) -> None:
    env = {} if value is None else {"AGENTFAST_RUNNER_POD_TTL_SECONDS": value}
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            RunnerConfig.from_env(env)
    else:
        assert RunnerConfig.from_env(env).pod_ttl_s == expected


def test_an_ended_runs_pods_are_deleted_once_their_ttl_has_passed(store, operator_on) -> None:
    main, seen = operator_on
    store.create_run("team-a/refund-demo", "u1", _doc(SCRIPTED))
    store.cancel_run("team-a/refund-demo", "cancelled by a test", reason="Cancelled")
    now = datetime.now(UTC)
    released = RunnerPod(
        name="agentrun-refund-demo-2",
        attempt=2,
        counted=0,
        phase="Succeeded",
        created_at=now - timedelta(hours=3),
        started_at=now - timedelta(hours=3),
        exit_code=0,
        exit_reason="Completed",
        finished_at=now - timedelta(hours=2),
    )
    # Ended 10 minutes ago, an hour to live: kept, and looked at again when it is due (not at every resync).
    api = seen["wire"]([released], 3600)
    main.reconcile({**SCRIPTED, "status": _ended_status("Cancelled", 600)})
    assert [c[0] for c in api.calls] == ["list"] and api.calls[0][2] == "agentfast.dev/run-uid=u1"
    [(ns, name, delay)] = seen["later"]
    assert (ns, name) == ("team-a", "refund-demo") and 2990 <= delay <= 3001, delay
    assert not (seen["published"][-1].get("pod") or {}).get("deleted_at")
    # Ended two hours ago (the operator was down, say): deleted now, and status records it.
    seen["later"].clear()
    main.reconcile({**SCRIPTED, "status": _ended_status("Cancelled", 7200)})
    assert ("delete", "team-a", "agentrun-refund-demo-2") in api.calls and api.pods == [] and seen["later"] == []
    pod = seen["published"][-1]["pod"]
    assert pod["deleted_at"] and pod["name"] == "agentrun-refund-demo-2"
    # Once recorded, a reconcile (kopf's resume pass after a restart, a late pod event) asks the API nothing.
    api = seen["wire"]([released], 3600)
    main.reconcile({**SCRIPTED, "status": _ended_status("Cancelled", 7200, runnerPodsDeletedAt=pod["deleted_at"])})
    assert api.calls == [] and seen["later"] == []
    # -1 (null in the chart): kept, as before.
    api = seen["wire"]([released], None)
    main.reconcile({**SCRIPTED, "status": _ended_status("Cancelled", 7200)})
    assert api.calls == [] and seen["later"] == []
    # 0: at once, at the reconcile that first sees the end (status does not show it yet).
    api = seen["wire"]([released], 0)
    main.reconcile({**SCRIPTED, "status": {"phase": "Running", "observedGeneration": 1}})
    assert ("delete", "team-a", "agentrun-refund-demo-2") in api.calls and seen["published"][-1]["pod"]["deleted_at"]


def test_publish_status_records_when_the_pods_were_deleted(monkeypatch) -> None:
    from agentfast.operator import main

    patches = []

    class _Custom:
        def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, **_):
            patches.append(body["status"])

    monkeypatch.setattr(main.STATE, "custom", _Custom(), raising=False)
    monkeypatch.setattr(main, "_event", lambda *a, **kw: None)
    body = {**SCRIPTED, "metadata": {**SCRIPTED["metadata"], "uid": "u-published"}}
    main.publish_status(
        body, ctx("Succeeded"), None, pod={"name": "agentrun-refund-demo-1", "deleted_at": "2026-12-01T12:00:00Z"}
    )
    assert patches[-1]["runnerPodsDeletedAt"] == "2026-12-01T12:00:00Z" and patches[-1]["runnerPod"] == "agentrun-refund-demo-1"
    main.publish_status({**body, "status": patches[-1]}, ctx("Succeeded"), None)
    assert len(patches) == 1  # nothing changed: no patch (and a later one would not name, so not remove, the field)


def test_a_status_read_before_the_run_ended_never_takes_it_back(monkeypatch) -> None:
    """Two paths publish from their own reads of the store: once the run's status says Cancelled,
    a publish from an older read (WaitingForApproval, no decision usable: a cancel was asked for)
    patches nothing; a later terminal status still does."""
    from agentfast.operator import main
    from agentfast.runner.names import format_run_id

    patches = []

    class _Custom:
        def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, **_):
            patches.append(body["status"])

    monkeypatch.setattr(main.STATE, "custom", _Custom(), raising=False)
    monkeypatch.setattr(main, "_event", lambda *a, **kw: None)
    body = {**SCRIPTED, "metadata": {**SCRIPTED["metadata"], "uid": "u-stale"}}
    key = format_run_id(body["metadata"]["namespace"], body["metadata"]["name"])
    main.publish_status(body, ctx("Cancelled"), None)
    assert patches[-1]["phase"] == "Cancelled"
    monkeypatch.setitem(main._BODIES, key, {**body, "status": patches[-1]})  # as the patch's answer leaves it
    stale = ("Cancelled", "a cancel was asked for by kubernetes: the run starts no call any more")
    main.publish_status(body, ctx("WaitingForApproval"), None, closed=stale)
    assert [p["phase"] for p in patches] == ["Cancelled"]
    main.publish_status(body, ctx("Failed", "ended otherwise"), None)  # terminal over terminal: published
    assert [p["phase"] for p in patches] == ["Cancelled", "Failed"]
    # Another run of the same name (another uid) is not held back by the old one's end.
    other = {**body, "metadata": {**body["metadata"], "uid": "u-new"}}
    main.publish_status(other, ctx("WaitingForApproval"), None)
    assert patches[-1]["phase"] == "WaitingForApproval"


class _NetworkPolicies:
    def __init__(self, owner_uid: str | None) -> None:
        self.owner_uid, self.calls = owner_uid, []

    def read_namespaced_network_policy(self, name, namespace, **_):
        from types import SimpleNamespace as NS

        from kubernetes.client.rest import ApiException

        self.calls.append(("read", namespace, name))
        if self.owner_uid is None:
            raise ApiException(status=404, reason="Not Found")
        return NS(metadata=NS(uid="np-uid", owner_references=[NS(uid=self.owner_uid, kind="AgentRun")]))

    def delete_namespaced_network_policy(self, name, namespace, body=None, **_):
        self.calls.append(("delete", namespace, name, body.preconditions.uid))


@pytest.mark.parametrize("owner, deleted", [("u1", True), ("someone-else", False), (None, False)])
def test_the_runs_own_network_policy_goes_with_its_pods(store, operator_on, monkeypatch, owner, deleted) -> None:
    from agentfast.operator.workload import EgressPolicy

    main, seen = operator_on
    monkeypatch.setattr(main.SETTINGS, "egress", EgressPolicy(postgres=({"to": [{"podSelector": {}}]},)))
    policies = _NetworkPolicies(owner)
    monkeypatch.setattr(main.STATE, "networking", policies, raising=False)
    store.create_run("team-a/refund-demo", "u1", _doc(SCRIPTED))
    store.cancel_run("team-a/refund-demo", "cancelled by a test", reason="Cancelled")
    seen["wire"]([], 0)
    main.reconcile({**SCRIPTED, "status": _ended_status("Cancelled", 5)})
    assert policies.calls[0] == ("read", "team-a", "agentrun-refund-demo")
    assert (("delete", "team-a", "agentrun-refund-demo", "np-uid") in policies.calls) is deleted  # with a uid precondition
    assert seen["published"][-1]["pod"]["deleted_at"]  # a foreign one (or none) does not hold the run's pods up


def test_the_resync_leaves_ended_runs_alone(store, monkeypatch) -> None:
    from agentfast.operator import main

    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main, "_RESYNCED", {})
    reconciled = []
    settled = {**SCRIPTED, "status": _ended_status("Succeeded", 5)}  # pods maybe not deleted yet: its own timer does that
    moving = {
        **SCRIPTED,
        "metadata": {**SCRIPTED["metadata"], "name": "moving", "uid": "u2"},
        "status": {"phase": "Running", "observedGeneration": 1},
    }
    monkeypatch.setattr(main, "_list_agentruns", lambda: [settled, moving])
    monkeypatch.setattr(main, "reconcile", lambda body: reconciled.append(body["metadata"]["name"]))
    monkeypatch.setattr(main, "_retain", lambda live: None)
    monkeypatch.setattr(main, "revoke_unused", lambda *a: [])
    monkeypatch.setattr(main.STATE, "core", None, raising=False)
    main._resync()
    assert reconciled == ["moving"]


# -- delayed reconciles -------------------------------------------------------------------------------


def test_delayed_reconciles_share_one_thread_and_the_earliest_wins(monkeypatch) -> None:
    import threading
    import time

    from agentfast.operator import main

    fired: list[tuple[str, float]] = []
    done = threading.Event()
    monkeypatch.setattr(main, "_get_agentrun", lambda ns, name: {"metadata": {"namespace": ns, "name": name}})
    monkeypatch.setattr(main, "reconcile", lambda body: (fired.append((body["metadata"]["name"], time.monotonic())), done.set()))
    later = main._Later()
    start = time.monotonic()
    later.add("team-a/a", 3600)
    later.add("team-a/a", 0.5)  # earlier: replaces the hour
    later.add("team-a/b", 3600)
    later.add("team-a/b", 7200)  # later: the hour stands
    assert done.wait(10), "the delayed reconcile never ran"
    assert [n for n, _ in fired] == ["a"] and 0.4 <= fired[0][1] - start < 5
    pending = later.pending()
    assert list(pending) == ["team-a/b"] and 3500 < pending["team-a/b"] <= 3600
    threads = [t for t in threading.enumerate() if t.name == "agentfast-later"]
    assert len(threads) == 1  # one thread however many runs wait


def _scripted(name: str, **spec) -> dict:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}", "generation": 1},
        "spec": {"model": {"name": "m", "script": "refund"}, "input": "hi", **spec},
    }


def test_the_resync_reconciles_only_runs_whose_state_changed(store, monkeypatch) -> None:
    """Issue 14 item 4: a resync pass costs what changed, not every run. Real store marks."""
    from agentfast.operator import main
    from agentfast.runner.snapshot import RunContext, RunStatus, Session, StateSnapshot

    runs = {n: _scripted(n) for n in ("a", "b", "c")}
    runs["d"] = _scripted("d", activeDeadlineSeconds=600)  # a deadline passes without any event
    runs["e"] = _scripted("e")  # never registered (a missing ModelConfig keeps a run out of the store)
    for n in "abcd":
        store.create_run(f"team-a/{n}", f"uid-{n}", {"spec": {}})
    reconciled: list[str] = []
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.STATE, "listening", (1, True))
    monkeypatch.setattr(main, "_list_agentruns", lambda: list(runs.values()))
    monkeypatch.setattr(main, "reconcile", lambda body: reconciled.append(body["metadata"]["name"]))
    monkeypatch.setattr(main, "_retain", lambda live: None)
    monkeypatch.setattr(main, "revoke_unused", lambda *a: [])
    monkeypatch.setattr(main.STATE, "core", None, raising=False)
    monkeypatch.setattr(main, "FULL_EVERY", 10**9)  # no full turn in this test (checked last)
    monkeypatch.setattr(main, "_RESYNCED", {})
    monkeypatch.setattr(main, "_RECONCILED_AT", {})
    monkeypatch.setattr(main, "_resync_state", {"passes": 1, "listener": None})

    def resync() -> list[str]:
        reconciled.clear()
        main._resync()
        return sorted(reconciled)

    main._RECONCILED_AT["uid-c"] = __import__("time").monotonic()  # an event reconciled c just now (a new run)
    assert resync() == ["a", "b", "d", "e"]  # the first pass: everything, but what an event just did
    assert resync() == ["d", "e"]  # nothing changed
    # a's runner commits: the listener published it, as long as its session lasted
    lease = store.acquire_lease("team-a/a")
    assert resync() == ["a", "d", "e"]  # the takeover (epoch) is a control change
    ctx = RunContext(session=Session(run_uid="uid-a"), status=RunStatus(phase="Running"))
    store.commit_checkpoint(lease, StateSnapshot(run_id="team-a/a", context=ctx, messages=[], saved_at=1), stored_messages=0)
    assert resync() == ["d", "e"]
    store.commit_checkpoint(lease, StateSnapshot(run_id="team-a/a", context=ctx, messages=[], saved_at=2), stored_messages=0)
    monkeypatch.setattr(main.STATE, "listening", (2, True))  # the listener reconnected: commits may have been missed
    assert resync() == ["a", "d", "e"]
    store.request_cancel("team-a/b", "cli:alice")  # a cancel from the CLI: no AgentRun event
    store.void_decision("team-a/c", "call-1-0", "test")
    runs["a"] = {**runs["a"], "metadata": {**runs["a"]["metadata"], "generation": 2}}  # spec.approvals patched
    assert resync() == ["a", "b", "c", "d", "e"]
    assert resync() == ["d", "e"]
    from agentfast.runner.liveness import RunnerClaim

    claim = RunnerClaim.acquire(store, "team-a/c")  # a runner outside any pod takes c ...
    assert resync() == ["c", "d", "e"]
    pid = claim._conn.info.backend_pid
    claim._conn.close()  # ... and dies (SIGKILL): no event, no checkpoint, but its lock is gone
    claim._stop.set()
    # The server drops the lock when that backend has exited, just after the close: wait for that
    # (under load it can take longer than the next line), then the resync must see it.
    wait_until(
        lambda: count_rows(store.dsn, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", pid) == 0,
        what="the dead runner's backend to exit",
    )
    assert resync() == ["c", "d", "e"]
    assert resync() == ["d", "e"]
    main._UNPUBLISHED.add("team-a/b")  # its progress publish failed
    assert resync() == ["b", "d", "e"] and "team-a/b" not in main._UNPUBLISHED
    # every run gets a full reconcile in its turn
    monkeypatch.setattr(main, "FULL_EVERY", 1)
    assert resync() == ["a", "b", "c", "d", "e"]


def test_a_run_is_validated_and_registered_once_per_generation(store, monkeypatch) -> None:
    from agentfast.operator import main
    from agentfast.runner import spec as spec_module

    parsed = []
    real_parse = spec_module.parse_agentrun
    monkeypatch.setattr(main, "parse_agentrun", lambda doc, **kw: parsed.append(1) or real_parse(doc, **kw))
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.SETTINGS, "runner", RunnerConfig())
    monkeypatch.setattr(main, "publish_status", lambda *a, **kw: None)
    monkeypatch.setattr(main, "ensure_runner_secret", lambda *a, **kw: False)
    monkeypatch.setattr(main, "ensure_runner_service_account", lambda *a, **kw: None)
    monkeypatch.setattr(main, "_drive_runner", lambda *a, **kw: (None, {}))
    monkeypatch.setattr(main, "_ADMITTED", {})
    monkeypatch.setattr(main.STATE, "core", None, raising=False)
    body = _scripted("once")
    for _ in range(3):
        main.reconcile(body)
    assert len(parsed) == 1 and [r.run_id for r, _ in store.list_runs()] == ["team-a/once"]
    main.reconcile({**body, "metadata": {**body["metadata"], "generation": 2}})  # spec.approvals or spec.cancel patched
    assert len(parsed) == 2
    main._forget_run("uid-once")  # the AgentRun was deleted
    assert not main._ADMITTED


def test_a_runner_secret_gone_with_its_namespace_is_made_again_when_a_pod_misses_it(store, monkeypatch) -> None:
    """A namespace deleted and made again within credentials.RECHECK_S: the operator still trusts
    the Secret it saw; the first runner pod that misses it makes it come back at once."""
    from kubernetes import client as k8s
    from kubernetes.client.rest import ApiException

    from agentfast.operator import credentials, main

    class Core:
        def __init__(self) -> None:
            self.created: list[str] = []

        def list_namespaced_pod(self, namespace, **kw):
            waiting = k8s.V1ContainerStateWaiting(
                reason="CreateContainerConfigError", message='secret "agentfast-runner" not found'
            )
            pod = k8s.V1Pod(
                metadata=k8s.V1ObjectMeta(name="agentrun-once-1", annotations={"agentfast.dev/attempt": "1"}),
                status=k8s.V1PodStatus(
                    phase="Pending",
                    container_statuses=[
                        k8s.V1ContainerStatus(
                            name="runner",
                            image="i",
                            image_id="",
                            ready=False,
                            restart_count=0,
                            state=k8s.V1ContainerState(waiting=waiting),
                        )
                    ],
                ),
            )
            return k8s.V1PodList(items=[pod])

        def read_namespaced_secret(self, name, namespace, **kw):
            raise ApiException(status=404)

        def create_namespaced_secret(self, namespace, body, **kw):
            self.created.append(f"{namespace}/{body['metadata']['name']}")

    core = Core()
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.STATE, "core", core, raising=False)
    monkeypatch.setattr(main.SETTINGS, "dsn", store.dsn)
    credentials.forget()
    credentials.ensure_runner_secret("team-a", store, core, store.dsn)
    assert core.created == ["team-a/agentfast-runner"]  # made; now trusted for RECHECK_S
    assert credentials.ensure_runner_secret("team-a", store, core, store.dsn) is False
    body = _scripted("once")
    record = store.create_run("team-a/once", "uid-once", {"spec": {}})
    _, info = main._drive_runner(body, record, None, None, {})
    assert info["blocked"][0] == "CreateContainerConfigError"
    assert core.created == ["team-a/agentfast-runner"] * 2
    credentials.forget()


def test_status_shows_usage_and_the_cost_from_the_checkpoint() -> None:
    """status.usage always; status.cost (amount, currency, maxCost) when the checkpoint keeps prices:
    the same RunContext.cost the budget check and `agentfast status` use (issue 17 item 5)."""
    from agentfast.runner.snapshot import Budget, Prices

    c = ctx("Running")
    c.usage.prompt_tokens, c.usage.completion_tokens = 462, 100
    s = status_from_store(c, None, generation=1, old=None)
    assert s["usage"] == {"promptTokens": 462, "completionTokens": 100, "totalTokens": 562}
    assert "cost" not in s  # no prices: the cost is not known, and status says nothing of it
    c.prices = Prices(promptPerMillionTokens=2.5, completionPerMillionTokens=10, currency="EUR")
    assert status_from_store(c, None, generation=1, old=None)["cost"] == {"amount": 0.002155, "currency": "EUR"}
    c.budget = Budget(max_cost=0.5)
    assert status_from_store(c, None, generation=1, old=None)["cost"] == {"amount": 0.002155, "currency": "EUR", "maxCost": 0.5}
    # an operator-only ending (no checkpoint) carries neither
    assert not {"usage", "cost"} & set(status_from_store(None, None, generation=1, old=None))


def test_a_cost_limit_without_prices_is_refused_as_invalid_spec_reading_nothing(store, monkeypatch) -> None:
    """max_cost needs prices: a ModelConfig without spec.prices, or the scripted model without
    spec.model.prices, is refused by the operator's own checks (SpecError: Failed/InvalidSpec),
    importing and reading nothing the spec names (G12) and registering nothing."""
    from agentfast.operator import main
    from agentfast.runner.spec import SpecError, parse_agentrun

    no_prices = {**MODELCONFIG, "spec": {k: v for k, v in MODELCONFIG["spec"].items() if k != "prices"}}
    api = _ModelConfigs({("team-a", "llm"): no_prices})
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.STATE, "custom", api, raising=False)
    capped = {**BODY, "spec": {**BODY["spec"], "budget": {"max_cost": 2}}}
    run = parse_agentrun(_doc(capped), check_imports=False)
    with pytest.raises(SpecError, match=r"^spec\.budget\.max_cost: ModelConfig 'llm' has no prices"):
        main._with_model_config(run, _doc(capped), "team-a/capped", "u6")
    scripted = {**capped, "spec": {**capped["spec"], "model": {"name": "m", "script": "refund"}}}
    with pytest.raises(SpecError, match=r"^spec\.budget\.max_cost: the scripted model has no prices"):
        parse_agentrun(_doc(scripted), check_imports=False)
    assert store.list_runs() == []
    # with the ModelConfig's prices the run registers, and its document carries them
    api.objects[("team-a", "llm")] = MODELCONFIG
    doc = main._with_model_config(run, _doc(capped), "team-a/capped", "u6")
    assert parse_agentrun(doc, check_imports=False).prices().promptPerMillionTokens == 0.5


def test_revoking_a_credential_where_the_operator_has_no_rights_goes_on(store, monkeypatch) -> None:
    """With operator.watchNamespaces the operator has rights in the watched namespaces only
    (issue 30 item 5): a namespace no longer watched answers its Secret's delete with 403. Its
    credential is revoked all the same (the role logs in no more: a real login is tried), the
    Secret left holding a dead password, and the other namespaces are revoked in the same pass."""
    import psycopg
    from kubernetes.client.rest import ApiException

    from agentfast.operator import credentials

    class Core:
        """The API server as the chart's Roles make it: rights in team-a and team-c only."""

        def __init__(self) -> None:
            self.secrets: dict[str, dict] = {}

        def _allowed(self, namespace: str) -> None:
            if namespace == "team-b":
                raise ApiException(status=403, reason="Forbidden")

        def read_namespaced_secret(self, name, namespace, **kw):
            raise ApiException(status=404)

        def create_namespaced_secret(self, namespace, body, **kw):
            self.secrets[namespace] = body

        def delete_namespaced_secret(self, name, namespace, **kw):
            self._allowed(namespace)
            del self.secrets[namespace]

    core = Core()
    credentials.forget()
    for ns in ("team-a", "team-b", "team-c"):  # team-b was watched when its credential was made
        credentials.ensure_runner_secret(ns, store, core, store.dsn)
    dsn = {ns: base64.b64decode(core.secrets[ns]["data"][credentials.RUNNER_SECRET_KEY]).decode() for ns in core.secrets}
    psycopg.connect(dsn["team-b"]).close()  # it logs in now
    monkeypatch.setattr(credentials, "REVOKE_GRACE_S", 0.0)
    assert sorted(credentials.revoke_unused(store, core, {"team-a"}, 0)) == ["team-b", "team-c"]
    assert sorted(core.secrets) == ["team-a", "team-b"]  # team-b's could not be deleted
    assert set(store.tenants()) == {"team-a"}
    for ns in ("team-b", "team-c"):
        with pytest.raises(psycopg.OperationalError, match="not permitted to log in"):
            psycopg.connect(dsn[ns]).close()
    psycopg.connect(dsn["team-a"]).close()
    credentials.forget()


def test_serving_named_namespaces_kopf_does_not_observe_the_cluster(monkeypatch) -> None:
    """With operator.watchNamespaces the chart grants no right to list namespaces or CRDs (issue
    30 item 5): kopf's cluster observation is off, so it serves exactly the named namespaces and
    never asks (a 403 and a warning at every start); watching every namespace, it stays on."""
    import kopf

    from agentfast.operator import main

    for namespaces, disabled in ((["team-a", "team-b"], True), ([], False)):
        monkeypatch.setattr(main.SETTINGS, "namespaces", namespaces)
        settings = kopf.OperatorSettings()
        main.configure_kopf(settings)
        assert settings.scanning.disabled is disabled
        assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)


def test_spec_replies_end_entries_are_end_decisions_and_the_idle_timeout_is_due_for_questions_only() -> None:
    """Issue 31 item 1: the operator's part of ending a conversation. An ``end: true`` entry of
    spec.replies is recorded as the decision ``end`` (on the reply's path); a run suspended while
    it waits for the person gets a runner again once ``spec.conversationIdleTimeout`` passed
    (that runner ends the conversation), never while a human's approval is awaited too."""
    from agentfast.operator import main

    body = {
        "spec": {
            "conversation": True,
            "conversationIdleTimeout": 60,
            "replies": [
                {"callId": "call-1-0", "text": "A-1042", "repliedBy": "alice"},
                {"callId": "call-3-0", "end": True, "repliedBy": "alice"},
            ],
        }
    }
    assert [(f, c, d["decision"], d["result"]) for f, c, d in main._decisions_in_spec(body)] == [
        ("spec.replies", "call-1-0", "reply", "A-1042"),
        ("spec.replies", "call-3-0", "end", None),
    ]

    def awaited(call: str, reason: str, at_ms: int) -> AwaitedCall:
        tool = "ask_user" if reason == "awaiting_input" else "issue_refund"
        return AwaitedCall(
            call_id=call, iteration=3, position=int(call[-1]), tool_call=ToolCall(id=call, name=tool),
            idempotency_key=f"u:3:{call[-1]}", reason=reason, requested_at=at_ms,
        )  # fmt: skip

    question = PendingToolCall.of([awaited("call-3-0", "awaiting_input", 1_000_000)], [])
    assert not main.idle_due(body, question, now_ms=1_000_000 + 59_999)
    assert main.idle_due(body, question, now_ms=1_000_000 + 60_000)
    both = PendingToolCall.of(
        [awaited("call-3-0", "awaiting_input", 1_000_000), awaited("call-3-1", "requires_approval", 1_000_000)], []
    )
    assert not main.idle_due(body, both, now_ms=10**12)
    assert not main.idle_due({"spec": {"conversation": True}}, question, now_ms=10**12)
    assert not main.idle_due(body, None, now_ms=10**12)
