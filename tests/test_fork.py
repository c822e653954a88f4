"""Fork and replay (issue 17 item 4), on both adapters, with real runner processes and Postgres.

The source is the refund example run to its end (its gated refund approved). ``agentfast fork
SRC --at N`` makes a new run from SRC's checkpoint of iteration N; ``agentfast resume NEW`` goes
on with another scripted model. Checked from the rows runs and tools leave: the fork's transcript
up to N is the source's, no tool of iterations <= N runs again (the examples' invocation table
counts executions, by idempotency key), the fork's own calls carry keys of its own uid, the
source is unchanged, and a SIGKILL in the fork's first new iteration still ends with each of its
effects made once.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.spec import SpecError, parse_agentrun
from agentfast.runner.store import ForkRefused, Store

from .conformance import LANGGRAPH, VANILLA, Adapter, refunds, wait_for_approval_request
from .helpers import EXAMPLES, agentrun_file, count_rows, fenced_rows, run_cli, spawn_cli

pytestmark = pytest.mark.process

# The fork's model: turn 0 is never asked (the fork starts at iteration 2 or later); turn 1 adds a
# case note only (no refund); turn 2 answers.
FORK_SCRIPT = {
    "model": "scripted-fork",
    "turns": [
        {"tool_calls": [{"id": "f_1", "name": "lookup_order", "arguments": {"order_id": "A-1042"}}]},
        {
            "tool_calls": [
                {"id": "f_2", "name": "add_case_note", "arguments": {"order_id": "A-1042", "note": "forked: no refund"}}
            ],
            "usage": {"prompt_tokens": 300, "completion_tokens": 20},
        },
        {"content": "FORK: I noted your case; no refund was made.", "usage": {"prompt_tokens": 400, "completion_tokens": 10}},
    ],
}


def executions(dsn: str, tool: str, key: str | None = None) -> int:
    """How many times ``tool`` ran (with idempotency key ``key``, if given): one row per execution."""
    if key is None:
        return count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_tool_invocations WHERE tool = %s", tool)
    return count_rows(
        dsn, "SELECT count(*) FROM agentfast_examples.demo_tool_invocations WHERE tool = %s AND idempotency_key = %s", tool, key
    )


def run_source(tmp_path: Path, dsn: str, store: Store, adapter: Adapter) -> None:
    """The source: the refund run, approved, to Succeeded (3 iterations)."""
    path = agentrun_file(tmp_path, adapter.example, uid=str(uuid.uuid4()))
    proc = spawn_cli("run", str(path), dsn=dsn)
    call = wait_for_approval_request(store, adapter.run_id)
    store.decide(adapter.run_id, call, "approve", decided_by="test")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    assert store.load_context(adapter.run_id)[0].status.phase == "Succeeded"


def overrides_file(tmp_path: Path) -> Path:
    script = tmp_path / "fork-script.yaml"
    script.write_text(yaml.safe_dump(FORK_SCRIPT))
    path = tmp_path / "fork-overrides.yaml"
    path.write_text(yaml.safe_dump({"spec": {"model": {"name": "scripted-fork", "script": str(script)}}}))
    return path


@pytest.fixture(params=[VANILLA, LANGGRAPH], ids=lambda a: a.name)
def adapter(request: pytest.FixtureRequest) -> Adapter:
    return request.param


def test_fork_reuses_results_up_to_n_and_runs_anew_after(tmp_path: Path, dsn: str, store: Store, adapter: Adapter) -> None:
    run_source(tmp_path, dsn, store, adapter)
    src = store.load_snapshot(adapter.run_id)
    src_uid = src.context.session.run_uid
    before = fenced_rows(dsn, adapter.run_id)
    assert (executions(dsn, "lookup_order"), executions(dsn, "add_case_note"), refunds(dsn)) == (1, 1, 1)

    # Fork at iteration 1 (after the lookup) with another model.
    fork_id = f"default/{adapter.run_name}-other"
    got = run_cli(
        "fork", adapter.run_id, "--at", "1", "--name", f"{adapter.run_name}-other", "-f", str(overrides_file(tmp_path)), dsn=dsn
    )
    assert got.returncode == 0, got.stdout
    assert f"as {fork_id}" in got.stdout
    assert store.fork_origin(fork_id) == (adapter.run_id, 1)
    forked = store.load_snapshot(fork_id)
    fork_uid = forked.context.session.run_uid
    assert fork_uid != src_uid
    assert forked.context.status.reason == "Forked" and forked.context.counters.iterations == 1
    # Its transcript is the source's up to the fork point: system, user, assistant (lookup), tool.
    assert [m.role for m in forked.messages] == ["system", "user", "assistant", "tool"]
    assert forked.messages == src.messages[:4]

    got = run_cli("resume", fork_id, dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    done = store.load_snapshot(fork_id)
    assert done.context.status.phase == "Succeeded", done.context.status
    assert done.messages[:4] == src.messages[:4]
    assert [m.role for m in done.messages[4:]] == ["assistant", "tool", "assistant"]
    assert done.messages[-1].content.startswith("FORK:")
    assert done.context.counters.iterations == 3
    # Tokens: the source's first turn (copied) plus the fork's two.
    src_first = store.load_turn(adapter.run_id, 1)
    assert done.context.usage.total_tokens == src_first.prompt_tokens + src_first.completion_tokens + 320 + 410

    # Iteration 1's lookup was reused, never run again; the fork's note ran once, under its own key.
    assert executions(dsn, "lookup_order") == 1
    assert executions(dsn, "add_case_note") == 2
    assert executions(dsn, "add_case_note", f"{fork_uid}:2:0") == 1
    assert refunds(dsn) == 1  # the fork's model asked for no refund
    journal = {(e.iteration, e.position): e for e in store.journal(fork_id)}
    assert journal[(1, 0)].idempotency_key == f"{src_uid}:1:0" and journal[(1, 0)].state == "done"
    assert journal[(2, 0)].idempotency_key == f"{fork_uid}:2:0" and journal[(2, 0)].tool_call.name == "add_case_note"
    assert (2, 1) not in journal

    # The source is unchanged, row for row.
    assert fenced_rows(dsn, adapter.run_id) == before

    # Fork at iteration 2 (after the approved refund and the note): nothing of it runs again.
    got = run_cli("fork", adapter.run_id, "--at", "2", "-f", str(overrides_file(tmp_path)), dsn=dsn)
    assert got.returncode == 0, got.stdout
    second = f"{adapter.run_id}-fork-2"
    got = run_cli("resume", second, dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    snap = store.load_snapshot(second)
    assert snap.context.status.phase == "Succeeded"
    assert snap.messages[:7] == src.messages[:7]
    assert snap.messages[-1].content.startswith("FORK:")
    assert (executions(dsn, "lookup_order"), executions(dsn, "add_case_note"), refunds(dsn)) == (1, 2, 1)
    assert snap.context.counters.iterations == 3
    assert fenced_rows(dsn, adapter.run_id) == before

    # history shows the provenance.
    got = run_cli("history", second, dsn=dsn)
    assert got.returncode == 0 and f"forked from {adapter.run_id} at iteration 2" in got.stdout


def test_sigkill_in_the_forks_first_new_iteration_resumes_once(tmp_path: Path, dsn: str, store: Store, adapter: Adapter) -> None:
    run_source(tmp_path, dsn, store, adapter)
    fork_name = f"{adapter.run_name}-k"
    fork_id = f"default/{fork_name}"
    got = run_cli("fork", adapter.run_id, "--at", "1", "--name", fork_name, "-f", str(overrides_file(tmp_path)), dsn=dsn)
    assert got.returncode == 0, got.stdout
    fork_uid = store.load_context(fork_id)[0].session.run_uid
    # Killed after the fork's note ran and its result was persisted, before the checkpoint.
    got = run_cli("resume", fork_id, dsn=dsn, fault="tool.after_persist:add_case_note", timeout=90)
    assert got.returncode == -9, got.stdout
    assert executions(dsn, "add_case_note", f"{fork_uid}:2:0") == 1
    got = run_cli("resume", fork_id, dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    snap = store.load_snapshot(fork_id)
    assert snap.context.status.phase == "Succeeded" and snap.messages[-1].content.startswith("FORK:")
    assert executions(dsn, "add_case_note", f"{fork_uid}:2:0") == 1
    assert (executions(dsn, "lookup_order"), executions(dsn, "add_case_note"), refunds(dsn)) == (1, 2, 1)


def test_refusals_are_one_line_exit_2(tmp_path: Path, dsn: str, store: Store) -> None:
    adapter = VANILLA
    run_source(tmp_path, dsn, store, adapter)

    def refused(*args: str) -> str:
        got = run_cli("fork", *args, dsn=dsn)
        assert got.returncode == 2, got.stdout
        assert "Traceback" not in got.stdout
        return got.stdout

    assert "no run named 'nope'" in refused("nope", "--at", "1")
    assert "has no iteration 7: its last committed iteration is 3" in refused(adapter.run_id, "--at", "7")
    assert "iteration 3 of default/refund-demo ended the run" in refused(adapter.run_id, "--at", "3")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: {input: other}\n")
    assert "cannot change spec.input" in refused(adapter.run_id, "--at", "1", "-f", str(bad))
    assert "namespace" in refused(adapter.run_id, "--at", "1", "--name", "other/x")
    assert run_cli("fork", adapter.run_id, "--at", "1", "--name", "taken", dsn=dsn).returncode == 0
    assert "a run named default/taken exists" in refused(adapter.run_id, "--at", "1", "--name", "taken")
    # Retention pruned iteration 1's checkpoints (as the owner, standing in for retention_keep).
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM agentfast_checkpoints WHERE run_id = %s AND iteration <= 1", (adapter.run_id,))
    assert "iteration 1 of default/refund-demo was pruned" in refused(adapter.run_id, "--at", "1")
    with pytest.raises(ForkRefused, match="was pruned"):
        store.fork_run(adapter.run_id, 0, "default/zero", str(uuid.uuid4()), {}, prices=None)


def test_payload_references_are_copied_with_the_rows_that_name_them(tmp_path: Path, dsn: str, store: Store) -> None:
    """With a tiny payload threshold every longer string (the system prompt, the lookup's result,
    the model's arguments) is a row of ``agentfast_payloads`` the transcript, turns and journal
    refer to; payloads are per run, so the fork gets copies of the ones its rows name."""
    env = {"AGENTFAST_PAYLOAD_THRESHOLD_BYTES": "48"}
    adapter = VANILLA
    path = agentrun_file(tmp_path, adapter.example, uid=str(uuid.uuid4()))
    proc = spawn_cli("run", str(path), dsn=dsn, env=env)
    call = wait_for_approval_request(store, adapter.run_id)
    store.decide(adapter.run_id, call, "approve", decided_by="test")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    src = store.load_snapshot(adapter.run_id)
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_payloads WHERE run_id = %s", adapter.run_id) > 3
    got = run_cli("fork", adapter.run_id, "--at", "1", "--name", "p", "-f", str(overrides_file(tmp_path)), dsn=dsn, env=env)
    assert got.returncode == 0, got.stdout
    copied = count_rows(dsn, "SELECT count(*) FROM agentfast_payloads WHERE run_id = 'default/p'")
    assert 0 < copied < count_rows(dsn, "SELECT count(*) FROM agentfast_payloads WHERE run_id = %s", adapter.run_id)
    forked = store.load_snapshot("default/p")  # every reference resolves
    assert forked.messages == src.messages[:4]
    assert [e.result for e in store.journal("default/p")] == [e.result for e in store.journal(adapter.run_id, 1)]
    got = run_cli("resume", "default/p", dsn=dsn, env=env, timeout=90)
    assert got.returncode == 0, got.stdout
    snap = store.load_snapshot("default/p")
    assert snap.context.status.phase == "Succeeded" and snap.messages[:4] == src.messages[:4]
    assert executions(dsn, "lookup_order") == 1


def test_a_source_waiting_for_approval_forks_only_at_a_finished_iteration(
    tmp_path: Path, dsn: str, store: Store, adapter: Adapter
) -> None:
    """Paused on the gated refund of iteration 2: iteration 1 forks; 2 does not (the vanilla loop
    has not committed it; LangGraph committed its model superstep, whose calls have no result)."""
    path = agentrun_file(tmp_path, adapter.example, uid=str(uuid.uuid4()))
    got = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
    assert got.returncode == 0 and store.load_context(adapter.run_id)[0].status.phase == "WaitingForApproval", got.stdout
    got = run_cli("fork", adapter.run_id, "--at", "2", dsn=dsn)
    assert got.returncode == 2 and "Traceback" not in got.stdout, got.stdout
    if adapter is VANILLA:
        assert "has no iteration 2: its last committed iteration is 1" in got.stdout
    else:
        assert "iteration 2 of default/refund-langgraph is not finished" in got.stdout
    got = run_cli("fork", adapter.run_id, "--at", "1", "-f", str(overrides_file(tmp_path)), dsn=dsn)
    assert got.returncode == 0, got.stdout
    got = run_cli("resume", f"{adapter.run_id}-fork-1", dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    assert store.load_context(f"{adapter.run_id}-fork-1")[0].status.phase == "Succeeded"
    assert store.load_context(adapter.run_id)[0].status.phase == "WaitingForApproval"  # the source still waits
    assert refunds(dsn) == 0 and executions(dsn, "lookup_order") == 1


def test_spec_fork_from_registers_a_fork_with_agentfast_run(tmp_path: Path, dsn: str, store: Store, adapter: Adapter) -> None:
    """``spec.forkFrom: {run, iteration}`` in an AgentRun file: ``agentfast run FILE`` registers the
    run as a fork of its source (once) and runs it from the next iteration."""
    run_source(tmp_path, dsn, store, adapter)
    script = tmp_path / "fork-script.yaml"
    script.write_text(yaml.safe_dump(FORK_SCRIPT))
    doc = yaml.safe_load((EXAMPLES / adapter.example).read_text())
    doc["metadata"] = {"name": "from-file"}
    doc["spec"]["model"] = {"name": "scripted-fork", "script": str(script)}
    doc["spec"]["forkFrom"] = {"run": adapter.run_name, "iteration": 1}
    path = tmp_path / "from-file.yaml"
    path.write_text(yaml.safe_dump(doc))
    got = run_cli("run", str(path), dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    snap = store.load_snapshot("default/from-file")
    assert snap.context.status.phase == "Succeeded" and snap.messages[-1].content.startswith("FORK:")
    assert snap.messages[:4] == store.load_snapshot(adapter.run_id).messages[:4]
    assert store.fork_origin("default/from-file") == (adapter.run_id, 1)
    assert (executions(dsn, "lookup_order"), executions(dsn, "add_case_note"), refunds(dsn)) == (1, 2, 1)
    # Again: the run exists (a fork registered once), finished: nothing runs.
    got = run_cli("run", str(path), dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    assert (executions(dsn, "lookup_order"), executions(dsn, "add_case_note"), refunds(dsn)) == (1, 2, 1)


def test_spec_fork_from_refusals(tmp_path: Path, dsn: str, store: Store) -> None:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"] = {"name": "x", "namespace": "team-a"}
    doc["spec"]["forkFrom"] = {"run": "team-b/src", "iteration": 1}
    with pytest.raises(SpecError, match="spec.forkFrom.run: 'team-b/src' is in another namespace"):
        parse_agentrun(doc, check_imports=False)
    doc["spec"]["forkFrom"] = {"run": "team-a/src", "iteration": 1}
    assert parse_agentrun(doc, check_imports=False).fork_source() == "team-a/src"
    doc["metadata"] = {"name": "x"}
    doc["spec"]["forkFrom"] = {"run": "missing", "iteration": 1}
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(doc))
    got = run_cli("run", str(path), dsn=dsn)
    assert got.returncode == 2 and "spec.forkFrom: no run default/missing to fork" in got.stdout, got.stdout
    assert store.get_run("default/x") is None


def test_the_operator_registers_spec_fork_from_once(
    tmp_path: Path, dsn: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's registration (``operator/main.py`` ``_register``) makes the fork from its
    source's rows, once; a fork with no such iteration is refused (reconcile: Failed/InvalidSpec)."""
    from agentfast.operator import main

    adapter = LANGGRAPH
    run_source(tmp_path, dsn, store, adapter)
    monkeypatch.setattr(main.STATE, "store", store)
    doc = yaml.safe_load((EXAMPLES / adapter.example).read_text())
    doc["metadata"] = {"name": "in-cluster", "namespace": "default", "uid": "uid-in-cluster"}
    doc["spec"]["forkFrom"] = {"run": f"default/{adapter.run_name}", "iteration": 2}
    body = {"metadata": doc["metadata"]}
    record = main._register(body, "default/in-cluster", doc)
    assert record.run_uid == "uid-in-cluster" and store.fork_origin("default/in-cluster") == (adapter.run_id, 2)
    assert main._register(body, "default/in-cluster", doc) == record  # a resync registers nothing again
    snap = store.load_snapshot("default/in-cluster")
    assert snap.messages == store.load_snapshot(adapter.run_id).messages[:7]
    assert snap.context.session.run_uid == "uid-in-cluster" and snap.sdk_state
    got = run_cli("resume", "default/in-cluster", dsn=dsn, timeout=90)  # what its runner pod runs
    assert got.returncode == 0, got.stdout
    assert store.load_context("default/in-cluster")[0].status.phase == "Succeeded"
    assert (executions(dsn, "lookup_order"), executions(dsn, "add_case_note"), refunds(dsn)) == (1, 1, 1)
    doc["metadata"] = {"name": "too-far", "namespace": "default", "uid": "uid-too-far"}
    doc["spec"]["forkFrom"]["iteration"] = 9
    with pytest.raises(ForkRefused, match="has no iteration 9"):
        main._register({"metadata": doc["metadata"]}, "default/too-far", doc)
    assert store.get_run("default/too-far") is None


def test_a_fork_is_a_new_run_whose_first_start_is_not_a_resume_and_forks_again(
    tmp_path: Path, dsn: str, store: Store, adapter: Adapter
) -> None:
    """Issue 31 item 6: a fork has its own resume count (its first start is not a resume, the
    source's count is not its own), and every iteration its history shows forks again: those
    copied from the source (0 and 1 here) and its own fork point (2) and its own iterations."""
    # The source paused, was decided, and resumed: one resume of its own.
    path = agentrun_file(tmp_path, adapter.example, uid=str(uuid.uuid4()))
    assert run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90).returncode == 0
    store.decide(adapter.run_id, "call-2-0", "approve", decided_by="test")
    assert run_cli("resume", adapter.run_name, dsn=dsn, timeout=90).returncode == 0
    assert store.load_context(adapter.run_id)[0].counters.resumes == 1

    fork = f"{adapter.run_name}-f"
    got = run_cli("fork", adapter.run_id, "--at", "2", "--name", fork, "-f", str(overrides_file(tmp_path)), dsn=dsn)
    assert got.returncode == 0, got.stdout
    assert store.load_context(f"default/{fork}")[0].counters.resumes == 0
    got = run_cli("resume", fork, dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    assert "resumed (#" not in got.stdout, got.stdout
    ctx = store.load_context(f"default/{fork}")[0]
    assert ctx.status.phase == "Succeeded" and ctx.counters.resumes == 0
    assert "resumes 0" in " ".join(run_cli("status", fork, dsn=dsn).stdout.split())

    # Every iteration `history` shows of the fork (0: the input, 1-2: copied, 3: its own) ...
    history = run_cli("history", fork, "-o", "json", dsn=dsn)
    assert history.returncode == 0, history.stdout
    doc = json.loads(history.stdout)
    assert sum(m["role"] == "assistant" for m in doc["transcript"]) == 3
    assert {c["iteration"] for c in doc["checkpoints"]} == {0, 1, 2, 3}, doc["checkpoints"]
    # ... forks again: before the fork point (the source's iterations, as the fork's own history),
    # at it, and after it (the fork's final answer ends it: refused with that reason).
    for at in (0, 1, 2):
        got = run_cli("fork", fork, "--at", str(at), "--name", f"{fork}-{at}", dsn=dsn)
        assert got.returncode == 0, (at, got.stdout)
        assert store.fork_origin(f"default/{fork}-{at}") == (f"default/{fork}", at)
        snap = store.load_snapshot(f"default/{fork}-{at}")
        assert snap.context.counters.iterations == at and snap.context.counters.resumes == 0
        assert snap.messages == store.load_snapshot(adapter.run_id).messages[: len(snap.messages)]
    got = run_cli("fork", fork, "--at", "3", "--name", f"{fork}-3", dsn=dsn)
    said = " ".join(got.stdout.split())
    assert got.returncode == 2, said
    assert (
        f"iteration 3 of default/{fork} ended the run (Succeeded)" in said
        or f"iteration 3 of default/{fork} is the model's final answer" in said
    ), said
    # A fork of the fork made before its fork point runs to its end from there, reusing every result.
    before = (executions(dsn, "lookup_order"), executions(dsn, "add_case_note"), refunds(dsn))
    got = run_cli("resume", f"{fork}-1", dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    done = store.load_context(f"default/{fork}-1")[0]
    assert done.status.phase == "Succeeded" and done.counters.resumes == 0
    assert executions(dsn, "lookup_order") == before[0] and refunds(dsn) == before[2]


def test_a_refusal_to_fork_a_fork_says_the_true_reason(tmp_path: Path, dsn: str, store: Store) -> None:
    """Issue 31 item 6: an iteration of a fork that cannot be forked is refused for what is
    true of it: pruned by retention in the source before the fork was made; waiting for a
    decision at every kept checkpoint; the run's end."""
    adapter = VANILLA
    run_source(tmp_path, dsn, store, adapter)
    # Retention pruned the source's iterations 0 and 1 before the fork was made.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM agentfast_checkpoints WHERE run_id = %s AND iteration <= 1", (adapter.run_id,))
    assert run_cli("fork", adapter.run_id, "--at", "2", "--name", "f2", dsn=dsn).returncode == 0
    got = run_cli("fork", "f2", "--at", "1", "--name", "f2-1", dsn=dsn)
    assert got.returncode == 2, got.stdout
    said = " ".join(got.stdout.split())
    assert (
        "iteration 1 of default/f2 was pruned: retention keeps the latest checkpoints only, in default/refund-demo already"
        " when default/f2 was forked from it at iteration 2" in said
    ), said
    assert "waiting for a decision" not in said and "ended the run" not in said

    # A run whose iteration is kept only at checkpoints waiting for a decision.
    path = agentrun_file(tmp_path, "refund.yaml", uid=str(uuid.uuid4()))
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["name"] = "waits"
    path.write_text(yaml.safe_dump(doc))
    assert run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90).returncode == 0
    with psycopg.connect(dsn, autocommit=True) as conn:  # the boundary checkpoint of iteration 1 pruned
        conn.execute("DELETE FROM agentfast_checkpoints WHERE run_id = 'default/waits' AND iteration = 1 AND pending IS NULL")
    got = run_cli("fork", "waits", "--at", "1", dsn=dsn)
    said = " ".join(got.stdout.split())
    assert got.returncode == 2 and "iteration 1 of default/waits was waiting for a decision at every kept checkpoint" in said, (
        said
    )
    assert "pruned" not in said and "ended the run" not in said
