"""Issue 14 item 3 on real parts: cancel (``agentfast cancel``, a cancel request in the store, what
``spec.cancel`` becomes) and ``spec.activeDeadlineSeconds``.

Runners are real OS processes (``agentfast run``) against a real PostgreSQL server; tools run in
the real tool host; the model is the scripted one over real HTTP. A cancel stops a run at its next
safe point: a tool call in flight finishes and is kept, no new one starts, a call awaiting a
decision never runs; the run ends ``Cancelled`` and the process exits 0. A deadline ends a run
``Failed``/``DeadlineExceeded`` (exit 1), while it works and while it waits for a human.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.names import ExitCode
from agentfast.runner.store import Store, StoreUnavailable, UnknownCall

from .helpers import EXAMPLES, agentrun_file, count_rows, examples_dsn_for, phase_of, run_cli, spawn_cli, wait_until
from .test_runner_behaviour import invocations, listeners, refunds

CHAOS_READ = {"name": "chaos_read", "ref": "agentfast.testing.chaos_tools:chaos_read"}


def slow_run_file(tmp_path: Path, *, work_ms: int, iterations: int, batch: int = 1, **spec: object) -> Path:
    """An AgentRun ``slow`` whose scripted model asks, ``iterations`` times, for a batch of
    ``batch`` chaos_read calls, each taking ``work_ms`` ms, then answers."""
    turns = [
        {
            "tool_calls": [
                {"id": f"c{i}-{p}", "name": "chaos_read", "arguments": {"item": f"item-{i}-{p}", "work_ms": work_ms}}
                for p in range(batch)
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        }
        for i in range(iterations)
    ] + [{"content": "all read", "usage": {"prompt_tokens": 10, "completion_tokens": 5}}]
    script = tmp_path / "slow-script.yaml"
    script.write_text(yaml.safe_dump({"model": "scripted-slow", "turns": turns}))
    doc = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": "slow", "uid": str(uuid.uuid4())},
        "spec": {
            "model": {"name": "scripted-slow", "script": str(script)},
            "input": "Read the stock.",
            "tools": [CHAOS_READ],
            "budget": {"max_iterations": 50, "max_duration_ms": 600000, "classifier": "none"},
            **spec,
        },
    }
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def chaos_reads(dsn: str, call_id: str | None = None) -> int:
    """Executions of chaos_read started (a row is written as the tool body begins)."""
    if call_id is None:
        return count_rows(examples_dsn_for(dsn), "SELECT count(*) FROM agentfast_examples.chaos_invocations")
    return count_rows(
        examples_dsn_for(dsn), "SELECT count(*) FROM agentfast_examples.chaos_invocations WHERE call_id = %s", call_id
    )


def status(store: Store, run_id: str):
    return store.load_context(run_id)[0].status


# -- cancel -------------------------------------------------------------------------------------------


@pytest.mark.process
def test_cancel_during_a_slow_tool_call_keeps_it_and_starts_nothing_more(tmp_path: Path, dsn: str, store: Store) -> None:
    path = slow_run_file(tmp_path, work_ms=3000, iterations=3, batch=2)
    proc = spawn_cli("run", str(path), dsn=dsn)
    try:
        wait_until(lambda: chaos_reads(dsn, "call-1-0") == 1, timeout=30, what="the first slow call to start")
        asked = run_cli("cancel", "slow", dsn=dsn)
        assert asked.returncode == 0, asked.stdout
        assert "requested" in asked.stdout and "next safe point" in asked.stdout
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.OK, out
    assert "Traceback" not in out and "Cancelled" in out
    st = status(store, "default/slow")
    assert (st.phase, st.reason) == ("Cancelled", "Cancelled")
    assert "cancelled by cli:" in st.message
    journal = {e.call_id: e for e in store.journal("default/slow")}
    # The call in flight finished and its result is kept; its sibling never started; no next turn.
    assert journal["call-1-0"].state == "done" and '"item": "item-0-0"' in journal["call-1-0"].result.content
    assert journal["call-1-1"].state == "planned" and journal["call-1-1"].attempts == 0
    assert chaos_reads(dsn) == 1 and set(journal) == {"call-1-0", "call-1-1"}
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_turns WHERE run_id = 'default/slow'") == 1
    # Ended for good: a resume runs nothing and says so, exit 0; another cancel is refused.
    again = run_cli("resume", "slow", dsn=dsn)
    assert again.returncode == ExitCode.OK and "Cancelled" in again.stdout, again.stdout
    assert chaos_reads(dsn) == 1
    late = run_cli("cancel", "slow", dsn=dsn)
    assert late.returncode == 2 and "already ended (Cancelled" in late.stdout, late.stdout


@pytest.mark.process
@pytest.mark.parametrize("example,run_name", [("refund.yaml", "refund-demo"), ("refund-langgraph.yaml", "refund-langgraph")])
def test_cancel_while_waiting_for_approval_wakes_the_runner_at_once(
    tmp_path: Path, dsn: str, store: Store, example: str, run_name: str
) -> None:
    run_id = f"default/{run_name}"
    proc = spawn_cli("run", str(agentrun_file(tmp_path, example)), dsn=dsn)
    try:
        wait_until(lambda: phase_of(store, run_id) == "WaitingForApproval", what="the run to wait for approval")
        wait_until(lambda: listeners(dsn) >= 1, timeout=15, what="the runner listening for a decision")
        [awaited] = store.awaiting(run_id)
        asked = run_cli("cancel", run_name, dsn=dsn)
        t0 = time.monotonic()
        assert asked.returncode == 0 and "requested" in asked.stdout, asked.stdout
        wait_until(
            lambda: phase_of(store, run_id) == "Cancelled", timeout=5, what="the waiting runner to cancel the run", interval=0.02
        )
        woke = time.monotonic() - t0
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert woke < 1.5, f"the waiting runner took {woke:.2f}s to carry out the cancel"
    assert proc.returncode == ExitCode.OK, out
    snap = store.load_snapshot(run_id)
    assert snap.context.status.reason == "Cancelled" and "cli:" in snap.context.status.message
    # The gated call stays as it was, undecided, and can no longer be decided; it never ran.
    assert snap.pending is not None and snap.pending.call_ids == [awaited.call_id]
    assert store.get_decision(run_id, awaited.call_id) is None
    with pytest.raises(UnknownCall):
        store.decide(run_id, awaited.call_id, "approve", decided_by="late")
    assert refunds(dsn) == 0 and invocations(dsn, "issue_refund") == 0
    assert invocations(dsn, "lookup_order") == 1 and invocations(dsn, "add_case_note") == 1  # the work done is kept


@pytest.mark.process
def test_cancel_with_no_runner_ends_the_run_at_once(tmp_path: Path, dsn: str, store: Store) -> None:
    paused = run_cli("run", str(agentrun_file(tmp_path)), "--no-wait", dsn=dsn)
    assert paused.returncode == 0 and phase_of(store, "default/refund-demo") == "WaitingForApproval", paused.stdout
    done = run_cli("cancel", "refund-demo", dsn=dsn)
    assert done.returncode == 0, done.stdout
    assert "Cancelled (no runner held it)" in done.stdout
    st = status(store, "default/refund-demo")
    assert (st.phase, st.reason) == ("Cancelled", "Cancelled") and "cancelled by cli:" in st.message
    request = store.cancel_request("default/refund-demo")
    assert request is not None and request.requested_by.startswith("cli:")
    # Nothing starts it again: resume ends at once (exit 0), the refund never runs.
    again = run_cli("resume", "refund-demo", dsn=dsn)
    assert again.returncode == ExitCode.OK and "Cancelled" in again.stdout, again.stdout
    assert refunds(dsn) == 0 and invocations(dsn, "issue_refund") == 0
    assert run_cli("cancel", "refund-demo", dsn=dsn).returncode == 2
    missing = run_cli("cancel", "no-such-run", dsn=dsn)
    assert missing.returncode == 2 and "no run named 'no-such-run'" in missing.stdout


def test_a_cancel_request_is_recorded_once_and_needs_a_run(store: Store) -> None:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    store.create_run("default/refund-demo", "u-1", doc)
    first, made = store.request_cancel("default/refund-demo", "cli:alice")
    second, made_again = store.request_cancel("default/refund-demo", "cli:bob")
    assert made and not made_again and second == first and first.requested_by == "cli:alice"
    with pytest.raises(KeyError):
        store.request_cancel("default/nope", "cli:alice")
    # A run registered but never started is ended with a first checkpoint, so nothing starts it.
    assert store.cancel_run("default/refund-demo", "cancelled by cli:alice", reason="Cancelled")
    snap = store.load_snapshot("default/refund-demo")
    assert snap.context.status.phase == "Cancelled" and snap.context.session.run_uid == "u-1" and snap.messages == []
    assert not store.cancel_run("default/refund-demo", "again", reason="Cancelled")
    assert store.end_requests("default/nope") is None


def test_a_runner_role_can_read_a_cancel_request_but_never_write_one(dsn: str, store: Store) -> None:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    for run_id in ("team-a/mine", "team-b/theirs"):
        store.create_run(run_id, str(uuid.uuid4()), doc)
    store.request_cancel("team-a/mine", "kubernetes (spec.cancel)")
    store.request_cancel("team-b/theirs", "kubernetes (spec.cancel)")
    role, _ = store.set_tenant_password("team-a", "pw-a")
    as_runner = psycopg.conninfo.make_conninfo(dsn, user=role, password="pw-a")
    with psycopg.connect(as_runner, autocommit=True) as a:
        assert [r[0] for r in a.execute("SELECT run_id FROM agentfast_cancel_requests").fetchall()] == ["team-a/mine"]
        for query in (
            "DELETE FROM agentfast_cancel_requests WHERE run_id = 'team-a/mine'",
            "UPDATE agentfast_cancel_requests SET requested_by = 'me' WHERE run_id = 'team-a/mine'",
            "INSERT INTO agentfast_cancel_requests (run_id, requested_by) VALUES ('team-a/other', 'me')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                a.execute(query)
    runner = Store(as_runner, retry_for_s=2)
    try:
        ends = runner.end_requests("team-a/mine")  # what a runner reads at each safe point
        assert ends is not None and ends.cancel is not None and ends.cancel.requested_by == "kubernetes (spec.cancel)"
        assert runner.end_requests("team-b/theirs") is None  # another namespace's run: not even seen
        with pytest.raises(StoreUnavailable, match="privilege"):
            runner.request_cancel("team-a/mine", "runner")
    finally:
        runner.close()
    assert store.cancel_request("team-a/mine").requested_by == "kubernetes (spec.cancel)"


# -- deadlines ----------------------------------------------------------------------------------------


@pytest.mark.process
def test_a_deadline_ends_a_working_run_failed(tmp_path: Path, dsn: str, store: Store) -> None:
    # The first call must start within the deadline (registration + the runner's start-up, slower
    # on a loaded machine), and the second must not: 4 s and calls of 2.5 s.
    path = slow_run_file(tmp_path, work_ms=2500, iterations=8, activeDeadlineSeconds=4)
    t0 = time.monotonic()
    done = run_cli("run", str(path), dsn=dsn, timeout=60)
    took = time.monotonic() - t0
    assert done.returncode == ExitCode.FAILED, done.stdout
    st = status(store, "default/slow")
    assert (st.phase, st.reason) == ("Failed", "DeadlineExceeded"), st
    assert "spec.activeDeadlineSeconds" in st.message and "over its deadline of 4 s" in st.message
    ended_at = store.load_context("default/slow")[0].counters.iterations
    assert 1 <= ended_at < 8 and chaos_reads(dsn) < 8  # stopped at a safe point, far from the end
    assert took < 20, f"took {took:.1f}s"
    journal = store.journal("default/slow")
    assert all(e.state in ("done", "planned") for e in journal)  # no call left half-run


@pytest.mark.process
def test_a_deadline_ends_a_run_waiting_for_a_human(tmp_path: Path, dsn: str, store: Store) -> None:
    path = agentrun_file(tmp_path, activeDeadlineSeconds=4)
    t0 = time.monotonic()
    proc = spawn_cli("run", str(path), dsn=dsn)
    try:
        wait_until(lambda: phase_of(store, "default/refund-demo") == "WaitingForApproval", what="the run to wait for approval")
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    assert proc.returncode == ExitCode.FAILED, out
    st = status(store, "default/refund-demo")
    assert (st.phase, st.reason) == ("Failed", "DeadlineExceeded") and "waiting for humans included" in st.message
    assert 4 <= took < 10, f"ended after {took:.1f}s for a deadline of 4s"
    assert refunds(dsn) == 0 and store.awaiting("default/refund-demo") == []


@pytest.mark.process
def test_a_deadline_is_checked_when_a_run_resumes(tmp_path: Path, dsn: str, store: Store) -> None:
    paused = run_cli("run", str(agentrun_file(tmp_path, activeDeadlineSeconds=3600)), "--no-wait", dsn=dsn)
    assert paused.returncode == 0, paused.stdout
    call = store.awaiting("default/refund-demo")[0].call_id
    store.decide("default/refund-demo", call, "approve", decided_by="cli:test")  # in time
    with psycopg.connect(dsn, autocommit=True) as conn:  # as if an hour and a minute had gone by
        conn.execute("UPDATE agentfast_runs SET created_at = now() - interval '61 minutes' WHERE run_id = 'default/refund-demo'")
    shown = " ".join(run_cli("status", "refund-demo", dsn=dsn).stdout.split())  # the table wraps at 80 columns
    assert "the deadline has passed" in shown and "recorded in time, never used (DeadlineExceeded)" in shown, shown
    late = run_cli("resume", "refund-demo", dsn=dsn)
    assert late.returncode == ExitCode.FAILED, late.stdout
    assert status(store, "default/refund-demo").reason == "DeadlineExceeded"
    assert refunds(dsn) == 0  # approved in time, but resumed past the deadline: never run


# -- the operator's part (its function on the real store; the cluster tier runs it for real) ------------


def _body(name: str, uid: str, **spec: object) -> dict:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"] = {
        "name": name,
        "namespace": "default",
        "uid": uid,
        "managedFields": [
            {
                "manager": "kubectl-create",
                "operation": "Update",
                "time": "2026-01-01T00:00:00Z",
                "fieldsV1": {"f:spec": {"f:input": {}}},
            },
            {
                "manager": "kubectl-agentfast",
                "operation": "Update",
                "time": "2026-01-01T00:01:00Z",
                "fieldsV1": {"f:spec": {"f:cancel": {}}},
            },
        ],
    }
    doc["spec"].update(spec)
    return doc


@pytest.mark.process
def test_the_operator_ends_a_cancelled_run_no_runner_holds(tmp_path: Path, dsn: str, store: Store, monkeypatch) -> None:
    from agentfast.operator import main

    monkeypatch.setattr(main.STATE, "store", store)
    paused = run_cli("run", str(agentrun_file(tmp_path)), "--no-wait", dsn=dsn)  # waiting, no runner: a released pod
    assert paused.returncode == 0, paused.stdout
    uid = store.get_run("default/refund-demo").run_uid
    main._end_if_asked(_body("refund-demo", uid), "default/refund-demo")  # neither cancel nor deadline: nothing
    assert phase_of(store, "default/refund-demo") == "WaitingForApproval" and store.cancel_request("default/refund-demo") is None
    body = _body("refund-demo", uid, cancel=True)
    main._end_if_asked(body, "default/refund-demo")
    st = status(store, "default/refund-demo")
    assert (st.phase, st.reason) == ("Cancelled", "Cancelled")
    assert "cancelled by kubernetes (spec.cancel, field manager kubectl-agentfast)" in st.message
    before = store.list_checkpoints("default/refund-demo")[-1].checkpoint_id
    main._end_if_asked(body, "default/refund-demo")  # every resync: idempotent, nothing more written
    assert store.list_checkpoints("default/refund-demo")[-1].checkpoint_id == before
    assert refunds(dsn) == 0
    # The status it shows: phase Cancelled, a Cancelled condition, our own sentence as the message.
    from agentfast.operator.status import status_from_store

    ctx, pending = store.load_context("default/refund-demo")
    shown = status_from_store(ctx, pending, generation=2, old=None, run_id="default/refund-demo")
    cond = {c["type"]: c for c in shown["conditions"]}
    assert shown["phase"] == "Cancelled" and shown["pendingApprovals"] == [] and "kubectl-agentfast" in shown["message"]
    assert cond["Cancelled"]["status"] == "True" and cond["Cancelled"]["reason"] == "Cancelled"
    assert cond["Progressing"]["status"] == "False" and cond["Failed"]["status"] == "False"


@pytest.mark.process
def test_the_operator_leaves_a_cancel_to_a_live_runner(tmp_path: Path, dsn: str, store: Store, monkeypatch) -> None:
    from agentfast.operator import main

    monkeypatch.setattr(main.STATE, "store", store)
    proc = spawn_cli("run", str(agentrun_file(tmp_path)), dsn=dsn)
    try:
        wait_until(lambda: phase_of(store, "default/refund-demo") == "WaitingForApproval", what="the run to wait for approval")
        wait_until(lambda: listeners(dsn) >= 1, timeout=15, what="the runner listening for a decision")
        epoch = store.get_run("default/refund-demo").epoch
        main._end_if_asked(_body("refund-demo", store.get_run("default/refund-demo").run_uid, cancel=True), "default/refund-demo")
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The runner, not the operator, ended it: the lease was never taken from it, and it exited 0.
    assert proc.returncode == ExitCode.OK, out
    assert store.get_run("default/refund-demo").epoch == epoch
    assert status(store, "default/refund-demo").reason == "Cancelled"


@pytest.mark.process
def test_the_operator_fails_a_run_past_its_deadline_that_no_runner_holds(
    tmp_path: Path, dsn: str, store: Store, monkeypatch
) -> None:
    from agentfast.operator import main

    monkeypatch.setattr(main.STATE, "store", store)
    paused = run_cli("run", str(agentrun_file(tmp_path, activeDeadlineSeconds=600)), "--no-wait", dsn=dsn)
    assert paused.returncode == 0, paused.stdout
    body = _body("refund-demo", store.get_run("default/refund-demo").run_uid, activeDeadlineSeconds=600)
    main._end_if_asked(body, "default/refund-demo")
    assert phase_of(store, "default/refund-demo") == "WaitingForApproval"  # not yet
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE agentfast_runs SET created_at = now() - interval '11 minutes' WHERE run_id = 'default/refund-demo'")
    main._end_if_asked(body, "default/refund-demo")
    st = status(store, "default/refund-demo")
    assert (st.phase, st.reason) == ("Failed", "DeadlineExceeded") and "over its deadline of 600 s" in st.message
    assert store.awaiting("default/refund-demo") == [] and refunds(dsn) == 0
