"""The conformance suite every adapter passes: kill a real runner process, resume it elsewhere.

Each case runs the adapter's refund AgentRun (manifests/examples/refund*.yaml) in a real OS
process against a real Postgres, kills it with SIGKILL at a named point, records the human's
decision, resumes in a new process, and compares the end state with an uninterrupted run's of the
same adapter: same iteration, same transcript, exactly one refund in the ledger, and the
non-gated sibling executed exactly once, counted from the rows its executions wrote.

An adapter joins by a test module with a ``Test...`` subclass of :class:`ConformanceSuite` that
sets ``ADAPTER``: ``tests/test_flagship_vanilla.py`` and ``tests/test_flagship_kill_resume.py``
(LangGraph) do.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentfast.runner.store import Store

from .helpers import PgServer, agentrun_file, count_rows, phase_of, run_cli, spawn_cli, wait_until


@dataclass(frozen=True)
class Adapter:
    """An adapter under test: its refund example file and the run's name in it."""

    name: str
    example: str
    run_name: str

    @property
    def run_id(self) -> str:
        return f"default/{self.run_name}"


VANILLA = Adapter("vanilla", "refund.yaml", "refund-demo")
LANGGRAPH = Adapter("langgraph", "refund-langgraph.yaml", "refund-langgraph")


def invocations(dsn: str, tool: str) -> int:
    return count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_tool_invocations WHERE tool = %s", tool)


def refunds(dsn: str) -> int:
    return count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger")


def wait_for_approval_request(store: Store, run_id: str) -> str:
    wait_until(lambda: phase_of(store, run_id) == "WaitingForApproval", what="the run to wait for approval")
    _, pending = store.load_context(run_id)
    assert pending is not None
    return pending.call_id


def assert_same_end_state(store: Store, dsn: str, reference: dict, run_id: str) -> None:
    snap = store.load_snapshot(run_id)
    assert snap.context.status.phase == "Succeeded", snap.context.status
    assert snap.pending is None
    assert snap.context.counters.iterations == reference["iterations"] == 3
    assert [m.model_dump() for m in snap.messages] == reference["messages"]
    assert snap.context.usage.total_tokens == reference["usage"]
    assert refunds(dsn) == 1
    # The ledger row is keyed by this one call's idempotency key: run uid, iteration 2, position 0.
    assert (
        count_rows(
            dsn,
            "SELECT count(*) FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key = %s",
            f"{snap.context.session.run_uid}:2:0",
        )
        == 1
    )


@pytest.mark.process  # starts real runner processes and SIGKILLs them (tests/conftest.py: tiers)
class ConformanceSuite:
    """The suite's tests, for one adapter: a test module subclasses it as ``Test...`` and sets
    ``ADAPTER`` (pytest collects the inherited tests there and runs them on that adapter)."""

    ADAPTER: Adapter

    @pytest.fixture
    def adapter(self) -> Adapter:
        return self.ADAPTER

    @pytest.fixture
    def reference(self, tmp_path_factory: pytest.TempPathFactory, pg_server: PgServer, adapter: Adapter) -> dict:
        """An uninterrupted run: one process, approved while it waits; its end state is the oracle."""
        import uuid

        import psycopg

        name = f"t_ref_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        dsn = pg_server.dsn_for(name)
        path = agentrun_file(tmp_path_factory.mktemp("ref"), adapter.example)
        with Store(dsn) as store:
            store.migrate()
            proc = spawn_cli("run", str(path), dsn=dsn)
            call = wait_for_approval_request(store, adapter.run_id)
            store.decide(adapter.run_id, call, "approve", decided_by="test")
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, out
            snap = store.load_snapshot(adapter.run_id)
        assert snap.context.status.phase == "Succeeded"
        result = {
            "iterations": snap.context.counters.iterations,
            "messages": [m.model_dump() for m in snap.messages],
            "usage": snap.context.usage.total_tokens,
            "refunds": refunds(dsn),
            "notes": invocations(dsn, "add_case_note"),
        }
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        return result

    def test_reference_run_is_what_the_script_says(self, reference: dict) -> None:
        assert reference["iterations"] == 3
        roles = [m["role"] for m in reference["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "tool", "assistant"]
        # The model's original order is kept: issue_refund's result first, then add_case_note's.
        assert [m.get("name") for m in reference["messages"][5:7]] == ["issue_refund", "add_case_note"]
        assert reference["refunds"] == 1 and reference["notes"] == 1

    def test_sigkill_while_waiting_for_approval(
        self, tmp_path: Path, dsn: str, store: Store, reference: dict, adapter: Adapter
    ) -> None:
        path = agentrun_file(tmp_path, adapter.example)
        proc = spawn_cli("run", str(path), dsn=dsn)
        call = wait_for_approval_request(store, adapter.run_id)
        assert call == "call-2-0"
        _, pending = store.load_context(adapter.run_id)
        # G5: the non-gated sibling ran before the pause and its result is in the snapshot.
        assert [r.tool_name for r in pending.executed_sibling_results] == ["add_case_note"]
        assert invocations(dsn, "add_case_note") == 1
        assert refunds(dsn) == 0

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL

        store.decide(adapter.run_id, call, "approve", decided_by="test")
        resumed = run_cli("resume", adapter.run_name, dsn=dsn)
        assert resumed.returncode == 0, resumed.stdout

        assert_same_end_state(store, dsn, reference, adapter.run_id)
        assert invocations(dsn, "add_case_note") == 1  # the sibling was not re-run
        assert invocations(dsn, "issue_refund") == 1
        assert invocations(dsn, "lookup_order") == 1
        assert store.load_snapshot(adapter.run_id).context.counters.resumes == 1

    def test_sigkill_between_refund_and_its_persisted_result(
        self, tmp_path: Path, dsn: str, store: Store, reference: dict, adapter: Adapter
    ) -> None:
        path = agentrun_file(tmp_path, adapter.example)
        proc = spawn_cli("run", str(path), dsn=dsn, fault="tool.after_call:issue_refund")
        call = wait_for_approval_request(store, adapter.run_id)
        store.decide(adapter.run_id, call, "approve", decided_by="test")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, out
        # The refund happened, but its result was never persisted: the journal says "started".
        assert refunds(dsn) == 1
        [entry] = [e for e in store.journal(adapter.run_id, 2) if e.position == 0]
        assert entry.state == "started" and entry.result is None

        resumed = run_cli("resume", adapter.run_name, dsn=dsn)
        assert resumed.returncode == 0, resumed.stdout

        assert_same_end_state(store, dsn, reference, adapter.run_id)
        # The refund's recovery check found it in the ledger (by its idempotency key): the call is
        # recorded done with that refund, and the body did not run again.
        assert invocations(dsn, "issue_refund") == 1
        [entry] = [e for e in store.journal(adapter.run_id, 2) if e.position == 0]
        assert entry.state == "done" and entry.result.recorded_by == "recovery_check" and entry.attempts == 1
        assert invocations(dsn, "add_case_note") == 1

    def test_sigkill_before_the_refund_took_effect_reruns_it_with_its_key(
        self, tmp_path: Path, dsn: str, store: Store, reference: dict, adapter: Adapter
    ) -> None:
        path = agentrun_file(tmp_path, adapter.example)
        proc = spawn_cli("run", str(path), dsn=dsn, fault="tool.before_call:issue_refund")
        call = wait_for_approval_request(store, adapter.run_id)
        store.decide(adapter.run_id, call, "approve", decided_by="test")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, out
        assert refunds(dsn) == 0  # killed after its intent, before its effect

        resumed = run_cli("resume", adapter.run_name, dsn=dsn)
        assert resumed.returncode == 0, resumed.stdout

        assert_same_end_state(store, dsn, reference, adapter.run_id)
        # The check found no refund under the key, so the call ran again (G4: with the same key).
        [entry] = [e for e in store.journal(adapter.run_id, 2) if e.position == 0]
        assert entry.attempts == 2 and entry.result.recorded_by is None
        assert invocations(dsn, "issue_refund") == 1 and refunds(dsn) == 1

    def test_sigkill_after_sibling_persisted_before_pause(
        self, tmp_path: Path, dsn: str, store: Store, reference: dict, adapter: Adapter
    ) -> None:
        path = agentrun_file(tmp_path, adapter.example)
        proc = spawn_cli("run", str(path), dsn=dsn, fault="tool.after_persist:add_case_note")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, out
        assert invocations(dsn, "add_case_note") == 1
        assert phase_of(store, adapter.run_id) == "Running"  # the pause was never committed

        proc = spawn_cli("resume", adapter.run_name, dsn=dsn)
        call = wait_for_approval_request(store, adapter.run_id)
        _, pending = store.load_context(adapter.run_id)
        assert [r.tool_name for r in pending.executed_sibling_results] == ["add_case_note"]
        store.decide(adapter.run_id, call, "approve", decided_by="test")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out

        assert_same_end_state(store, dsn, reference, adapter.run_id)
        assert invocations(dsn, "add_case_note") == 1  # G3: a persisted result is never re-run

    def test_in_flight_non_idempotent_call_goes_to_a_human(
        self, tmp_path: Path, dsn: str, store: Store, adapter: Adapter
    ) -> None:
        tools = [
            {"name": "lookup_order", "ref": "agentfast.runner.examples.refund:lookup_order"},
            {"name": "issue_refund", "ref": "agentfast.runner.examples.refund:issue_refund", "requiresApproval": True},
            {"name": "add_case_note", "ref": "agentfast.runner.examples.refund:add_case_note", "idempotent": False},
        ]
        path = agentrun_file(tmp_path, adapter.example, tools=tools)
        proc = spawn_cli("run", str(path), dsn=dsn, fault="tool.after_call:add_case_note")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, out
        assert invocations(dsn, "add_case_note") == 1

        # Every call needing a human is asked at once: the gated refund and the in-flight note, the
        # latter not re-run blindly but a question under its own id.
        resumed = run_cli("resume", adapter.run_name, "--no-wait", dsn=dsn)
        assert resumed.returncode == 0, resumed.stdout
        _, pending = store.load_context(adapter.run_id)
        assert pending.call_ids == ["call-2-0", "call-2-1-rerun1"]
        assert [a.reason for a in pending.awaiting] == ["requires_approval", "in_flight_not_idempotent"]
        assert [a.call_id for a in store.awaiting(adapter.run_id)] == ["call-2-0", "call-2-1-rerun1"]
        assert invocations(dsn, "add_case_note") == 1

        # Decided in the other order; one resume.
        store.decide(adapter.run_id, "call-2-1-rerun1", "deny", reason="it already ran", decided_by="test")
        assert [a.call_id for a in store.awaiting(adapter.run_id)] == ["call-2-0"]
        store.decide(adapter.run_id, "call-2-0", "approve", decided_by="test")
        resumed = run_cli("resume", adapter.run_name, dsn=dsn)
        assert resumed.returncode == 0, resumed.stdout
        snap = store.load_snapshot(adapter.run_id)
        assert snap.context.status.phase == "Succeeded"
        assert invocations(dsn, "add_case_note") == 1 and refunds(dsn) == 1
        note_result = [m for m in snap.messages if m.role == "tool" and m.name == "add_case_note"][0]
        assert note_result.content.startswith("denied:") and "it already ran" in note_result.content
        # It may have run before the crash: the model is not told it did not.
        assert "not run" not in note_result.content and "may have taken effect" in note_result.content

    def test_budget_exceeded_ends_the_run_failed(self, tmp_path: Path, dsn: str, store: Store, adapter: Adapter) -> None:
        path = agentrun_file(tmp_path, adapter.example, budget={"max_iterations": 1, "classifier": "none"})
        done = run_cli("run", str(path), dsn=dsn)
        assert done.returncode == 1, done.stdout
        ctx, pending = store.load_context(adapter.run_id)
        assert ctx.status.phase == "Failed" and ctx.status.reason == "BudgetExceeded" and pending is None
        assert "max_iterations is 1" in ctx.status.message
        assert ctx.counters.model_calls == 1  # checked before the second model call, not after it
        assert invocations(dsn, "lookup_order") == 1 and refunds(dsn) == 0

    @pytest.mark.parametrize(
        ("limits", "prices", "said"),
        [
            # The refund script's replies: 203 tokens, then 359 with the gated call: 562 in all.
            ({"max_tokens": 500}, None, "budget exceeded: max_tokens is 500 and the run has used 562 tokens"),
            # At 2 + 8 per million: 0.000532 after the first reply, 0.001658 after the second.
            (
                {"max_cost": 0.001},
                {"promptPerMillionTokens": 2, "completionPerMillionTokens": 8},
                "budget exceeded: max_cost is 0.001 USD and the run has cost 0.001658 USD",
            ),
        ],
        ids=["max_tokens", "max_cost"],
    )
    def test_a_run_over_its_spend_never_asks_for_approval(
        self, tmp_path: Path, dsn: str, store: Store, adapter: Adapter, limits: dict, prices: dict | None, said: str
    ) -> None:
        """Issue 31 item 3: the reply that asks for the gated call takes the run over max_tokens
        (max_cost): the run ends Failed with that reason instead of asking a person to approve a
        call it could never go on from; the call never runs and no one is asked (no pending call,
        no approval counted, no prompt)."""
        model = {"name": "scripted-refund", "script": "refund", **({"prices": prices} if prices else {})}
        budget = {"max_iterations": 10, "max_tokens": 20000, "max_duration_ms": 120000, **limits}
        path = agentrun_file(tmp_path, adapter.example, budget=budget, model=model)
        done = run_cli("run", str(path), dsn=dsn)
        assert done.returncode == 1, done.stdout
        ctx, pending = store.load_context(adapter.run_id)
        assert (ctx.status.phase, ctx.status.reason) == ("Failed", "BudgetExceeded"), ctx.status
        assert ctx.status.message.startswith(said), ctx.status.message
        assert "no one was asked to decide on call-2-0" in ctx.status.message
        assert pending is None and ctx.counters.approvals_requested == 0
        assert store.awaiting(adapter.run_id) == []
        assert "waiting for approval" not in done.stdout and "Approve" not in done.stdout
        assert refunds(dsn) == 0 and invocations(dsn, "lookup_order") == 1
        # No checkpoint of it ever waited: a live inbox never showed the call.
        assert [c.phase for c in store.list_checkpoints(adapter.run_id)][-1] == "Failed"
        assert not any(c.phase == "WaitingForApproval" for c in store.list_checkpoints(adapter.run_id))

    def test_malformed_arguments_go_back_to_the_model(self, tmp_path: Path, dsn: str, store: Store, adapter: Adapter) -> None:
        doc_model = {"name": "scripted-malformed", "script": "malformed"}
        path = agentrun_file(tmp_path, adapter.example, model=doc_model)
        done = run_cli("run", str(path), dsn=dsn)
        assert done.returncode == 0, done.stdout
        snap = store.load_snapshot(adapter.run_id)
        assert snap.context.status.phase == "Succeeded"
        assert snap.context.counters.malformed_tool_calls == 1 and snap.context.counters.iterations == 3
        first_result = [m for m in snap.messages if m.role == "tool"][0]
        assert first_result.content.startswith("error: arguments are not valid JSON")
        assert invocations(dsn, "lookup_order") == 1  # the broken call never reached the tool

    def test_repeated_tool_call_ids_pass_a_strict_endpoint(
        self, tmp_path: Path, dsn: str, store: Store, adapter: Adapter
    ) -> None:
        """A provider that gives every call the same id, within a response and across turns: the ids
        are made unique before they are stored or sent back, so an endpoint that rejects duplicate
        ids as OpenAI does (the scripted model's strict mode) accepts every later request."""
        import yaml

        from .helpers import REPO

        script = yaml.safe_load((REPO / "testing" / "scripts" / "refund.yaml").read_text())
        script["strict"] = True
        for turn in script["turns"]:
            for call in turn.get("tool_calls", []):
                call["id"] = "call_1"
        script_path = tmp_path / "strict-refund.yaml"
        script_path.write_text(yaml.safe_dump(script))
        path = agentrun_file(tmp_path, adapter.example, model={"name": script["model"], "script": str(script_path)})
        first = run_cli("run", str(path), "--no-wait", dsn=dsn)
        assert first.returncode == 0, first.stdout
        assert store.load_context(adapter.run_id)[1].call_id == "call-2-0"
        store.decide(adapter.run_id, "call-2-0", "approve", decided_by="test")
        done = run_cli("resume", adapter.run_name, dsn=dsn)
        assert done.returncode == 0, done.stdout
        snap = store.load_snapshot(adapter.run_id)
        assert snap.context.status.phase == "Succeeded", snap.context.status
        ids = [c.id for m in snap.messages for c in m.tool_calls]
        assert len(ids) == len(set(ids)) == 3 and ids[0] == "call_1"
        answered = [m.tool_call_id for m in snap.messages if m.role == "tool"]
        assert sorted(answered) == sorted(ids)
        assert refunds(dsn) == 1
