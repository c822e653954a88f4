"""How the vanilla runner behaves when things go wrong: bad model output, failing tools, budgets,
denials, signals, a lost or restarted Postgres, and a zombie runner.

In-process cases drive :class:`VanillaRunner` with the scripted model over real HTTP (what the
model was sent is read from the server's request log). Process cases run the real CLI against the
real Postgres and send real signals.
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from agentfast.runner.adapters.vanilla import VanillaRunner
from agentfast.runner.budget import _FLOOR, check_budget, heuristic_classifier
from agentfast.runner.loop import Outcome, run_id_of
from agentfast.runner.model import model_from_spec
from agentfast.runner.names import ExitCode
from agentfast.runner.snapshot import Budget, RunContext, Session
from agentfast.runner.spec import AgentRun, parse_agentrun
from agentfast.runner.store import Store
from agentfast.runner.tools import ToolRegistry

from .helpers import EXAMPLES, agentrun_file, count_rows, fenced_rows, freeze, phase_of, run_cli, spawn_cli, thaw, wait_until

RUN_ID = "default/refund-demo"
ECHO = {"name": "echo", "ref": "agentfast.testing.tools:echo"}
EXPLODE = {"name": "explode", "ref": "agentfast.testing.tools:explode"}
LOOKUP = {"name": "lookup_order", "ref": "agentfast.runner.examples.refund:lookup_order"}


# -- helpers -----------------------------------------------------------------------------------------


def agentrun(
    name: str, script: str, tools: list[dict], *, budget: dict | None = None, input: str = "Help me with order A-1042."
) -> AgentRun:
    doc = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "uid": str(uuid.uuid4())},
        "spec": {
            "model": {"name": f"scripted-{script}", "script": script},
            "input": input,
            "tools": tools,
            "budget": budget or {},
        },
    }
    return parse_agentrun(doc)


def refund_agentrun(classifier: str | None = None) -> AgentRun:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"]["uid"] = str(uuid.uuid4())
    if classifier is not None:
        doc["spec"]["budget"]["classifier"] = classifier
    return parse_agentrun(doc)


class Observed:
    """A real model with a hook run before each call (to look at the store at that moment)."""

    def __init__(self, inner: Any, before_call):
        self.inner, self.before_call = inner, before_call

    def complete(self, messages, tools):
        self.before_call()
        return self.inner.complete(messages, tools)

    def close(self) -> None:
        self.inner.close()


def drive(store: Store, run: AgentRun, *, before_call=None) -> tuple[Outcome, list[dict]]:
    """Register (once) and drive the run in-process until it ends or pauses; return the outcome
    and the request bodies the scripted model received over HTTP."""
    store.create_run(run_id_of(run), run.metadata.uid, run.model_dump(mode="json", exclude_none=True))
    model = model_from_spec(run.spec.model)
    server = model.server
    if before_call is not None:
        model = Observed(model, before_call)
    try:
        outcome = VanillaRunner(store, run, model, ToolRegistry.from_agentrun(run), wait_for_approval=False).run()
    finally:
        model.close()
    return outcome, list(server.requests)


def tool_messages(request: dict) -> list[dict]:
    return [m for m in request["messages"] if m["role"] == "tool"]


def refunds(dsn: str) -> int:
    return count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger")


def invocations(dsn: str, tool: str) -> int:
    return count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_tool_invocations WHERE tool = %s", tool)


def listeners(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = 'LISTEN agentfast_approval'"
        ).fetchone()[0]


def epochs_by_table(dsn: str) -> dict[str, dict[int, int]]:
    out = {}
    with psycopg.connect(dsn) as conn:
        for table in ("agentfast_messages", "agentfast_checkpoints", "agentfast_turns", "agentfast_tool_calls"):
            rows = conn.execute(f"SELECT epoch, count(*) FROM {table} GROUP BY epoch").fetchall()
            out[table] = dict(rows)
    return out


def wait_for_approval(store: Store, dsn: str, n_listeners: int = 1) -> str:
    wait_until(lambda: phase_of(store, RUN_ID) == "WaitingForApproval", what="the run to wait for approval")
    wait_until(lambda: listeners(dsn) >= n_listeners, timeout=15, what=f"{n_listeners} runner(s) listening for a decision")
    return store.load_context(RUN_ID)[1].call_id


# -- the model's mistakes and the tools' failures -------------------------------------------------------


def test_malformed_json_arguments_go_back_to_the_model(store: Store, dsn: str) -> None:
    run = agentrun("malformed", "malformed", [LOOKUP])
    outcome, requests = drive(store, run)
    assert (outcome.phase, outcome.exit_code) == ("Succeeded", ExitCode.OK), outcome
    snap = store.load_snapshot(run_id_of(run))
    c = snap.context.counters
    assert (c.iterations, c.model_calls) == (3, 3)
    assert c.malformed_tool_calls == 1 and c.tool_calls == 1 and c.tool_errors == 0
    # The model's second request carries the error as the result of its broken call.
    [err] = tool_messages(requests[1])
    assert err["tool_call_id"] == "call_1"
    assert err["content"].startswith("error: arguments are not valid JSON") and "lookup_order" in err["content"]
    # The broken call never ran; the corrected one ran once.
    assert invocations(dsn, "lookup_order") == 1
    first = store.journal(run_id_of(run), 1)[0]
    assert first.state == "done" and first.attempts == 0 and first.result.error_kind == "malformed"


def test_a_tool_that_raises_is_an_error_result_and_the_run_goes_on(store: Store) -> None:
    run = agentrun("raises", "tool_raises", [EXPLODE, ECHO])
    outcome, requests = drive(store, run)
    assert outcome.phase == "Succeeded", outcome
    c = store.load_snapshot(run_id_of(run)).context.counters
    assert c.tool_errors == 1 and c.tool_calls == 2 and c.malformed_tool_calls == 0
    boom, echoed = tool_messages(requests[1])
    assert boom["tool_call_id"] == "call_a" and "RuntimeError" in boom["content"] and "disk full" in boom["content"]
    assert echoed["tool_call_id"] == "call_b" and "still here" in echoed["content"]  # the sibling still ran
    [e0, e1] = store.journal(run_id_of(run), 1)
    assert e0.result.error_kind == "tool_raised" and e0.result.is_error and e1.result.error_kind is None


def test_an_unknown_tool_is_a_counted_error(store: Store) -> None:
    run = agentrun("unknown", "unknown_tool", [ECHO])
    outcome, requests = drive(store, run)
    assert outcome.phase == "Succeeded", outcome
    c = store.load_snapshot(run_id_of(run)).context.counters
    assert c.malformed_tool_calls == 1 and c.tool_calls == 0 and c.tool_errors == 0
    [err] = tool_messages(requests[1])
    assert "unknown tool 'send_email'" in err["content"] and "echo" in err["content"]


# -- budgets (G7) --------------------------------------------------------------------------------------


def test_max_iterations_ends_the_run_failed_with_a_reason(store: Store) -> None:
    run = agentrun("iter-budget", "endless", [ECHO], budget={"max_iterations": 3, "classifier": "none"})
    outcome, requests = drive(store, run)
    assert (outcome.phase, outcome.exit_code) == ("Failed", ExitCode.FAILED)
    st = store.load_snapshot(run_id_of(run)).context
    assert st.status.phase == "Failed" and st.status.reason == "BudgetExceeded"
    assert "max_iterations is 3" in st.status.message and st.status.message.startswith("budget exceeded")
    assert outcome.message == st.status.message
    assert st.counters.iterations == 3 and st.counters.model_calls == 3
    assert len(requests) == 3, "no model call past the budget"
    assert st.budget.max_iterations == 3 and st.classification.classifier == "none"


def test_max_tokens_ends_the_run_failed_with_a_reason(store: Store) -> None:
    run = agentrun("token-budget", "endless", [ECHO], budget={"max_tokens": 2500, "classifier": "none"})
    outcome, requests = drive(store, run)
    assert (outcome.phase, outcome.exit_code) == ("Failed", ExitCode.FAILED)
    st = store.load_snapshot(run_id_of(run)).context
    assert st.status.reason == "BudgetExceeded"
    assert "max_tokens is 2500" in st.status.message and "3000 tokens" in st.status.message
    assert st.usage.total_tokens == 3000 and st.counters.model_calls == 3 and len(requests) == 3


def test_a_run_started_before_prices_were_kept_gets_them_at_its_next_takeover(store: Store, dsn: str) -> None:
    """A checkpoint of a release before issue 17 has no ``prices``: the run's cost is not known
    until a runner takes it over, which copies them from the run's document; from then on the
    cost of all its tokens (those counted before too) is known: it is computed, not accumulated."""
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"]["uid"] = str(uuid.uuid4())
    doc["spec"]["model"]["prices"] = {"promptPerMillionTokens": 4, "completionPerMillionTokens": 16}
    run = parse_agentrun(doc)
    outcome, _ = drive(store, run)
    assert outcome.phase == "WaitingForApproval"
    assert store.load_context(RUN_ID)[0].prices is not None
    with psycopg.connect(dsn) as conn, conn.transaction():  # as the older release wrote it, through the fence
        conn.execute(
            "SELECT set_config('agentfast.epoch', epoch::text, true), set_config('agentfast.run_uid', run_uid, true)"
            " FROM agentfast_runs WHERE run_id = %s",
            (RUN_ID,),
        )
        conn.execute(
            "UPDATE agentfast_checkpoints SET context = context - 'prices' WHERE run_id = %s AND checkpoint_id ="
            " (SELECT max(checkpoint_id) FROM agentfast_checkpoints WHERE run_id = %s)",
            (RUN_ID, RUN_ID),
        )
    ctx = store.load_context(RUN_ID)[0]
    assert ctx.prices is None and ctx.cost() is None and ctx.usage.total_tokens > 0
    store.decide(RUN_ID, "call-2-0", "approve", decided_by="test")
    outcome, _ = drive(store, run)
    assert outcome.phase == "Succeeded"
    ctx = store.load_context(RUN_ID)[0]
    assert ctx.prices is not None and ctx.prices.promptPerMillionTokens == 4
    u = ctx.usage
    assert ctx.cost() == pytest.approx((u.prompt_tokens * 4 + u.completion_tokens * 16) / 1_000_000)


def test_the_declared_budget_is_the_one_that_applies_by_default(store: Store) -> None:
    """Issue 31 item 3: lowering a budget is opt-in; without ``classifier`` a short request keeps
    all of its declared limits (the heuristic would have cut this one's to 6 iterations)."""
    run = agentrun("as-declared", "endless", [ECHO], budget={"max_iterations": 7, "max_tokens": 100_000})
    assert run.spec.budget.classifier == "none"
    outcome, requests = drive(store, run)
    st = store.load_snapshot(run_id_of(run)).context
    assert st.budget == run.spec.budget.limits() and st.classification.applied == st.classification.declared
    assert outcome.phase == "Failed" and len(requests) == 7 and st.counters.iterations == 7
    assert st.status.message == "budget exceeded: max_iterations is 7 and the run has made 7 iterations without finishing"


@pytest.mark.parametrize(
    ("declared", "said"),
    [
        ({"max_iterations": 12}, "max_iterations is 6 (lowered from the declared 12 by the heuristic classifier;"),
        ({"max_tokens": 40_000}, "max_tokens is 10000 (lowered from the declared 40000 by the heuristic classifier;"),
    ],
)
def test_a_failure_on_a_lowered_limit_names_the_declared_one_and_how_to_keep_it(store: Store, declared: dict, said: str) -> None:
    """Issue 31 item 3: when the opted-in classifier lowered the limit the run fails on, the
    reason says which value was declared, which applied, and how to keep one's own."""
    run = agentrun("lowered", "endless", [ECHO], budget={**declared, "classifier": "heuristic"})
    outcome, _ = drive(store, run)
    st = store.load_snapshot(run_id_of(run)).context
    assert (outcome.phase, st.status.reason) == ("Failed", "BudgetExceeded")
    assert st.status.message.startswith(f"budget exceeded: {said}"), st.status.message
    assert "set spec.budget.classifier: none to keep yours)" in st.status.message


def test_a_finished_failed_run_is_not_restarted_by_resume(store: Store) -> None:
    run = agentrun("iter-budget-2", "endless", [ECHO], budget={"max_iterations": 2, "classifier": "none"})
    drive(store, run)
    outcome, requests = drive(store, run)
    assert outcome.phase == "Failed" and requests == []


def test_heuristic_classifier_records_its_decision_before_the_first_model_call(store: Store) -> None:
    run = refund_agentrun("heuristic")  # opt-in: the default keeps the declared budget
    seen: list[RunContext | None] = []
    outcome, _ = drive(store, run, before_call=lambda: seen.append(store.load_context(RUN_ID)[0]))
    assert outcome.phase == "WaitingForApproval"
    first = seen[0]  # the committed state when the model was first asked
    cl = first.classification
    assert cl is not None and cl.classifier == "heuristic" and cl.label == "simple"
    assert cl.declared == Budget(max_iterations=10, max_tokens=20_000, max_duration_ms=120_000)
    assert first.budget == cl.applied
    for field in ("max_iterations", "max_tokens", "max_duration_ms"):
        assert getattr(cl.applied, field) <= getattr(cl.declared, field)
    assert first.counters.model_calls == 0
    # decided once: later checkpoints carry the same decision
    assert store.load_context(RUN_ID)[0].classification == cl


@pytest.mark.parametrize("words", [3, 30, 100, 200])
@pytest.mark.parametrize("n_tools", [0, 3, 9])
@pytest.mark.parametrize("declared", [(1, 1, 1), (2, 500, 1000), (6, 8000, 60000), (10, 20000, 120000), (400, 10**7, 10**8)])
def test_heuristic_classifier_never_raises_a_limit(words: int, n_tools: int, declared: tuple[int, int, int]) -> None:
    it, tok, ms = declared
    run = agentrun(
        "cls",
        "endless",
        [{"name": f"t{i}", "ref": ECHO["ref"]} for i in range(n_tools)],
        budget={"max_iterations": it, "max_tokens": tok, "max_duration_ms": ms},
        input=" ".join(["order"] * words),
    )
    cl = heuristic_classifier(run.spec)
    assert cl.declared == Budget(max_iterations=it, max_tokens=tok, max_duration_ms=ms)
    for field in ("max_iterations", "max_tokens", "max_duration_ms"):
        applied, limit = getattr(cl.applied, field), getattr(cl.declared, field)
        assert 0 < applied <= limit, (field, cl)
        assert applied >= min(limit, getattr(_FLOOR, field)), (field, cl)  # the floor, where the declared allows it
    if cl.label == "complex":
        assert cl.applied == cl.declared


def test_complex_wording_keeps_the_declared_budget() -> None:
    run = agentrun("cls", "endless", [ECHO], input="Please research and compare refund policies", budget={"max_iterations": 40})
    cl = heuristic_classifier(run.spec)
    assert cl.label == "complex" and cl.applied.max_iterations == 40


def test_check_budget_reads_duration_too() -> None:
    ctx = RunContext(session=Session(run_uid="u"), budget=Budget(max_duration_ms=1000))
    assert check_budget(ctx) is None
    ctx.usage.duration_ms = 1000
    assert "max_duration_ms is 1000" in check_budget(ctx)


# -- approvals -----------------------------------------------------------------------------------------


def test_deny_with_a_reason_reaches_the_model(store: Store, dsn: str) -> None:
    run = refund_agentrun()
    outcome, _ = drive(store, run)
    assert outcome.phase == "WaitingForApproval" and outcome.pending.call_id == "call-2-0"
    classification = store.load_context(RUN_ID)[0].classification
    reason = "refunds over $40 need a second reviewer — ticket #88"
    store.decide(RUN_ID, "call-2-0", "deny", reason=reason, decided_by="test")

    outcome, requests = drive(store, run)
    assert outcome.phase == "Succeeded", outcome
    assert len(requests) == 1, "the resumed run asks only for the turn after the decision"
    denied = [m for m in tool_messages(requests[0]) if m["content"].startswith("denied:")]
    assert len(denied) == 1 and reason in denied[0]["content"]
    assert refunds(dsn) == 0 and invocations(dsn, "issue_refund") == 0
    ctx = store.load_context(RUN_ID)[0]
    assert ctx.classification == classification  # not re-classified on resume
    assert ctx.counters.tool_calls == 2  # lookup + note; a denied call is not a tool execution


def test_a_reused_provider_id_still_gives_distinct_call_ids_and_keys(store: Store, dsn: str) -> None:
    run = refund_agentrun()
    drive(store, run)
    store.decide(RUN_ID, "call-2-0", "approve", decided_by="test")
    outcome, _ = drive(store, run)
    assert outcome.phase == "Succeeded", outcome
    journal = store.journal(RUN_ID)
    uid = run.metadata.uid
    # the provider reused call_1 across turns: the second is renamed (item 9), so the ids sent back stay unique
    assert [(e.call_id, e.tool_call.id) for e in journal] == [
        ("call-1-0", "call_1"),
        ("call-2-0", "call_1_2_0"),
        ("call-2-1", "call_2"),
    ]
    assert [e.idempotency_key for e in journal] == [f"{uid}:1:0", f"{uid}:2:0", f"{uid}:2:1"]
    # the refund was made under its own call's key, not under the earlier call with the same provider id
    assert (
        count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key = %s", f"{uid}:2:0")
        == 1
    )
    assert refunds(dsn) == 1


# -- processes: signals, Postgres outages, zombies ---------------------------------------------------------


@pytest.mark.process
def test_sigterm_while_waiting_for_approval_exits_75_and_resume_continues(tmp_path: Path, dsn: str, store: Store) -> None:
    path = agentrun_file(tmp_path)
    proc = spawn_cli("run", str(path), dsn=dsn)
    call = wait_for_approval(store, dsn)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=10)
    elapsed = time.monotonic() - t0
    assert proc.returncode == ExitCode.RETRY, out
    assert elapsed < 5, f"took {elapsed:.1f}s to stop"
    assert "resume" in out and "Traceback" not in out
    assert phase_of(store, RUN_ID) == "WaitingForApproval"

    store.decide(RUN_ID, call, "approve", decided_by="test")
    resumed = run_cli("resume", "refund-demo", dsn=dsn)
    assert resumed.returncode == 0, resumed.stdout
    snap = store.load_snapshot(RUN_ID)
    assert snap.context.status.phase == "Succeeded" and snap.context.counters.resumes == 1
    assert refunds(dsn) == 1 and invocations(dsn, "add_case_note") == 1 and invocations(dsn, "lookup_order") == 1


@pytest.mark.process
def test_postgres_unreachable_at_start_exits_3(tmp_path: Path) -> None:
    path = agentrun_file(tmp_path)
    bad = f"host=/nonexistent/agentfast-{uuid.uuid4().hex[:8]} dbname=agentfast user=agentfast"
    t0 = time.monotonic()
    res = run_cli("run", str(path), dsn=bad, timeout=60)
    assert res.returncode == 3, res.stdout
    assert "cannot connect to Postgres" in res.stdout and "--dsn" in res.stdout, res.stdout
    assert "Traceback" not in res.stdout
    assert time.monotonic() - t0 < 30


@pytest.mark.process
def test_postgres_restart_while_waiting_loses_nothing(tmp_path: Path, dsn: str, store: Store, pg_server) -> None:
    path = agentrun_file(tmp_path)
    proc = spawn_cli("run", str(path), dsn=dsn)
    call = wait_for_approval(store, dsn)
    before = count_rows(dsn, "SELECT pg_postmaster_start_time()")
    pg_server.pg_ctl("-w", "restart")  # shared by the session: restarted, never left stopped
    assert count_rows(dsn, "SELECT pg_postmaster_start_time()") > before, "the server did not restart"
    store.decide(RUN_ID, call, "approve", decided_by="test")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode in (ExitCode.OK, ExitCode.RETRY), out
    if proc.returncode == ExitCode.RETRY:
        resumed = run_cli("resume", "refund-demo", dsn=dsn)
        assert resumed.returncode == 0, resumed.stdout
        out += resumed.stdout
    snap = store.load_snapshot(RUN_ID)
    assert snap.context.status.phase == "Succeeded", (snap.context.status, out)
    assert snap.context.counters.iterations == 3
    assert refunds(dsn) == 1
    assert (
        count_rows(
            dsn,
            "SELECT count(DISTINCT idempotency_key) FROM agentfast_examples.demo_tool_invocations WHERE tool = 'issue_refund'",
        )
        == 1
    )
    assert invocations(dsn, "add_case_note") == 1


@pytest.mark.process
def test_a_zombie_runner_cannot_act_after_a_takeover(tmp_path: Path, dsn: str, store: Store) -> None:
    path = agentrun_file(tmp_path)
    zombie = spawn_cli("run", str(path), dsn=dsn)
    call = wait_for_approval(store, dsn)
    old_epoch = store.get_run(RUN_ID).epoch

    successor = spawn_cli("resume", "refund-demo", "--force", dsn=dsn)  # takes the lease while the first still waits
    wait_until(lambda: store.get_run(RUN_ID).epoch == old_epoch + 1, what="the takeover")
    wait_until(lambda: listeners(dsn) >= 2, timeout=15, what="both runners waiting")
    before = epochs_by_table(dsn)
    # Before the decision: the first runner's rows, and the successor's takeover checkpoint.
    assert set().union(*(b.keys() for b in before.values())) == {old_epoch, old_epoch + 1}
    assert set(before["agentfast_checkpoints"]) == {old_epoch, old_epoch + 1}

    store.decide(RUN_ID, call, "approve", decided_by="test")  # both wake up
    out_s, _ = successor.communicate(timeout=60)
    out_z, _ = zombie.communicate(timeout=60)
    assert successor.returncode == 0, out_s
    assert zombie.returncode in (ExitCode.LEASE_LOST, ExitCode.OK), out_z
    if zombie.returncode == ExitCode.LEASE_LOST:
        assert "another runner" in out_z

    assert phase_of(store, RUN_ID) == "Succeeded"
    assert refunds(dsn) == 1 and invocations(dsn, "issue_refund") == 1
    [refund] = [e for e in store.journal(RUN_ID, 2) if e.position == 0]
    assert refund.attempts == 1 and refund.state == "done"
    after = epochs_by_table(dsn)
    for table in after:
        # rows carrying the stale epoch are exactly those written before the takeover, or fewer
        # (a row the successor updated now carries its epoch); none was added by the zombie
        assert after[table].get(old_epoch, 0) <= before[table].get(old_epoch, 0), (table, before, after)
    assert after["agentfast_checkpoints"].get(old_epoch + 1, 0) >= 1
    with psycopg.connect(dsn) as conn:
        refund_epoch = conn.execute(
            "SELECT epoch FROM agentfast_tool_calls WHERE run_id = %s AND iteration = 2 AND position = 0", (RUN_ID,)
        ).fetchone()[0]
    assert refund_epoch == old_epoch + 1


@pytest.mark.process
def test_a_zombie_of_a_deleted_run_cannot_act_in_a_new_run_of_the_same_name(tmp_path: Path, dsn: str, store: Store) -> None:
    """G6 across runs of one name: a runner frozen while its AgentRun is deleted and created again
    (same run_id, a new uid, epochs from 0 again) thaws holding the new run's current epoch, and
    still commits nothing and starts no tool: the lease names the run's uid too."""
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    zombie = spawn_cli("run", str(agentrun_file(tmp_path / "old", uid="00000000-0000-4000-8000-00000000000a")), dsn=dsn)
    successor = None
    try:
        call = wait_for_approval(store, dsn)
        old_epoch = store.get_run(RUN_ID).epoch
        freeze(zombie.pid)

        assert store.delete_run(RUN_ID)  # what the operator does with a deleted AgentRun's rows
        new_uid = "00000000-0000-4000-8000-00000000000b"
        successor = spawn_cli("run", str(agentrun_file(tmp_path / "new", uid=new_uid)), "--force", dsn=dsn)
        assert wait_for_approval(store, dsn, n_listeners=2) == call  # the same call id, in the new run
        run = store.get_run(RUN_ID)
        assert (run.run_uid, run.epoch) == (new_uid, old_epoch)  # the zombie's epoch came round
        freeze(successor.pid)  # so the zombie alone sees the decision below and acts on it, if it can
        before = fenced_rows(dsn, RUN_ID)

        store.decide(RUN_ID, call, "approve", decided_by="test")
        thaw(zombie.pid)
        out_z, _ = zombie.communicate(timeout=60)
        assert zombie.returncode == ExitCode.LEASE_LOST, out_z
        assert "another runner" in out_z and "Traceback" not in out_z, out_z
        assert fenced_rows(dsn, RUN_ID) == before
        assert refunds(dsn) == 0 and invocations(dsn, "issue_refund") == 0

        thaw(successor.pid)
        out_s, _ = successor.communicate(timeout=60)
        assert successor.returncode == 0, out_s
    finally:
        for proc in (zombie, successor):
            if proc is not None and proc.poll() is None:
                thaw(proc.pid)
                proc.kill()
                proc.communicate()
    assert phase_of(store, RUN_ID) == "Succeeded"
    assert refunds(dsn) == 1 and invocations(dsn, "issue_refund") == 1
    [refund] = [e for e in store.journal(RUN_ID, 2) if e.position == 0]
    assert refund.attempts == 1 and refund.state == "done" and refund.idempotency_key.startswith(new_uid)


def test_a_tool_output_with_nul_characters_is_stored_not_a_crash(store: Store) -> None:
    # The endless script calls "echo"; here that name is bound to a tool that returns NUL characters.
    run = agentrun(
        "nul-output",
        "endless",
        [{"name": "echo", "ref": "agentfast.testing.tools:nul_output"}],
        budget={"max_iterations": 2, "classifier": "none"},
    )
    outcome, requests = drive(store, run)
    assert outcome.phase == "Failed" and "max_iterations" in outcome.message, outcome  # ran to its budget
    [first] = store.journal(run_id_of(run), 1)
    assert first.state == "done" and first.attempts == 1
    assert first.result.content == "before\ufffd1\ufffdafter"
    assert tool_messages(requests[1])[0]["content"] == "before\ufffd1\ufffdafter"
