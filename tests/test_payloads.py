"""Issue 15 item 6 on a real PostgreSQL server: large payloads are stored once, outside the hot rows.

A tool output or a model message over the threshold (``AGENTFAST_PAYLOAD_THRESHOLD_BYTES``,
default 1 MiB) is one row of ``agentfast_payloads``; the journal, transcript, turn and checkpoint
rows hold a reference, resolved by the store on load, so the model and a resumed runner see the
value itself. A value over the ceiling (``AGENTFAST_PAYLOAD_MAX_BYTES``) or one Postgres cannot
store (SQLSTATE class 54) ends the run ``Failed`` with exit 1, never an endless exit 75. The
model is the scripted one over real HTTP; runners are real processes, killed with a real SIGKILL.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.adapters.vanilla import VanillaRunner
from agentfast.runner.examples import EXAMPLES_DSN_ENV
from agentfast.runner.loop import run_id_of
from agentfast.runner.model import model_from_spec
from agentfast.runner.names import ExitCode
from agentfast.runner.payloads import PREFIX, Limits, PayloadTooLarge, externalize
from agentfast.runner.spec import AgentRun, parse_agentrun
from agentfast.runner.store import Store, UnreadableState
from agentfast.runner.tools import ToolRegistry
from agentfast.testing.tools import big_text

from .helpers import count_rows, examples_dsn_for, run_cli

MIB = 1 << 20
BIG = {"name": "big_output", "ref": "agentfast.testing.tools:big_output"}
ECHO = {"name": "echo", "ref": "agentfast.testing.tools:echo"}
REFUND = {"name": "issue_refund", "ref": "agentfast.runner.examples.refund:issue_refund", "requiresApproval": True}
HOT_ROW_BYTES = 4096  # every hot row of these runs is far below: a 2 MiB value inline would be ~1 MiB even compressed


def _script(tmp_path: Path, turns: list[dict]) -> str:
    path = tmp_path / f"script-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"model": "scripted-payloads", "turns": turns}))
    return str(path)


def _agentrun(name: str, script: str, tools: list[dict]) -> dict:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "model": {"name": "scripted-payloads", "script": script},
            "input": "Fetch the report.",
            "tools": tools,
            "budget": {"max_iterations": 5, "max_tokens": 5_000_000},
        },
    }


def _big_run(tmp_path: Path, name: str, size: int, *, seed: str = "a") -> dict:
    """A run that calls big_output(size) once, then answers."""
    script = _script(
        tmp_path,
        [
            {"tool_calls": [{"id": "c1", "name": "big_output", "arguments": {"size_bytes": size, "seed": seed}}]},
            {"content": "Here is the report."},
        ],
    )
    return _agentrun(name, script, [BIG])


def _drive(store: Store, doc: dict) -> tuple:
    run: AgentRun = parse_agentrun(doc)
    store.create_run(run_id_of(run), run.metadata.uid, run.model_dump(mode="json", exclude_none=True))
    model = model_from_spec(run.spec.model)
    server = model.server
    try:
        outcome = VanillaRunner(store, run, model, ToolRegistry.from_agentrun(run), wait_for_approval=False).run()
    finally:
        model.close()
    return outcome, list(server.requests)


def _hot_rows(dsn: str, run_id: str) -> dict[str, int]:
    """The largest row of each hot table of the run, in bytes (as stored: pg_column_size)."""
    with psycopg.connect(dsn) as conn:
        out = {}
        for table, col in (
            ("agentfast_tool_calls", "result"),
            ("agentfast_tool_calls", "arguments"),
            ("agentfast_messages", "message"),
            ("agentfast_turns", "message"),
            ("agentfast_checkpoints", "context"),
            ("agentfast_checkpoints", "pending"),
            ("agentfast_checkpoints", "sdk_state"),
        ):
            out[f"{table}.{col}"] = conn.execute(
                f"SELECT coalesce(max(pg_column_size({col})), 0) FROM {table} WHERE run_id = %s", (run_id,)
            ).fetchone()[0]
        return out


def _payloads(dsn: str, run_id: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [
            r[0]
            for r in conn.execute(
                "SELECT size_bytes FROM agentfast_payloads WHERE run_id = %s ORDER BY size_bytes", (run_id,)
            ).fetchall()
        ]


def _invocations(dsn: str, tool: str) -> int:
    return count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_tool_invocations WHERE tool = %s", tool)


def test_a_2_mib_tool_output_is_stored_once_outside_the_hot_rows(dsn: str, store: Store, tmp_path: Path) -> None:
    outcome, requests = _drive(store, _big_run(tmp_path, "big", 2 * MIB))
    assert outcome.exit_code == ExitCode.OK and outcome.phase == "Succeeded", outcome
    run_id = "default/big"
    # Once: the journal's result and the transcript's tool message are the same text, one row.
    assert _payloads(dsn, run_id) == [2 * MIB]
    hot = _hot_rows(dsn, run_id)
    assert max(hot.values()) < HOT_ROW_BYTES, hot
    # Transparent: the model was sent the output itself, and every load gives it back.
    expected = big_text(2 * MIB, "a")
    [tool_msg] = [m for m in requests[1]["messages"] if m["role"] == "tool"]
    assert tool_msg["content"] == expected
    snap = store.load_snapshot(run_id)
    assert [m.content for m in snap.messages if m.role == "tool"] == [expected]
    [entry] = store.journal(run_id)
    assert entry.state == "done" and entry.result.content == expected


def test_a_pending_calls_sibling_result_keeps_the_checkpoint_small(dsn: str, store: Store, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        [
            {
                "tool_calls": [
                    {"id": "c1", "name": "big_output", "arguments": {"size_bytes": 2 * MIB, "seed": "s"}},
                    {
                        "id": "c2",
                        "name": "issue_refund",
                        "arguments": {"order_id": "A-1042", "amount_cents": 4999, "reason": "dup"},
                    },
                ]
            },
            {"content": "Refunded."},
        ],
    )
    outcome, _ = _drive(store, _agentrun("paused", script, [BIG, REFUND]))
    assert outcome.phase == "WaitingForApproval", outcome
    run_id = "default/paused"
    hot = _hot_rows(dsn, run_id)
    assert hot["agentfast_checkpoints.pending"] < HOT_ROW_BYTES, hot  # G5's sibling result, by reference
    assert _payloads(dsn, run_id) == [2 * MIB]
    _, pending = store.load_context(run_id)
    assert [r.content for r in pending.executed_sibling_results] == [big_text(2 * MIB, "s")]
    assert [a.call_id for a in store.awaiting(run_id)] == ["call-1-1"]


@pytest.mark.process
def test_resume_after_sigkill_resolves_the_output_and_never_reruns_the_tool(dsn: str, store: Store, tmp_path: Path) -> None:
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(_big_run(tmp_path, "killed", 2 * MIB, seed="k")))
    # SIGKILL right after the result is persisted, before the iteration's checkpoint.
    first = run_cli("run", str(path), dsn=dsn, fault="tool.after_persist:big_output", timeout=120)
    assert first.returncode == -9, first.stdout
    assert _invocations(dsn, "big_output") == 1
    second = run_cli("resume", "default/killed", dsn=dsn, timeout=120)
    assert second.returncode == ExitCode.OK, second.stdout
    assert _invocations(dsn, "big_output") == 1  # G3: the persisted result was resolved, not re-made
    snap = store.load_snapshot("default/killed")
    assert snap.context.status.phase == "Succeeded" and snap.context.counters.resumes == 1
    assert [m.content for m in snap.messages if m.role == "tool"] == [big_text(2 * MIB, "k")]
    assert _payloads(dsn, "default/killed") == [2 * MIB]
    assert max(_hot_rows(dsn, "default/killed").values()) < HOT_ROW_BYTES


@pytest.mark.process
def test_a_value_over_the_ceiling_fails_the_run_with_its_reason_and_exit_1(dsn: str, store: Store, tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(_big_run(tmp_path, "huge", 2 * MIB)))
    env = {"AGENTFAST_PAYLOAD_MAX_BYTES": str(MIB)}
    first = run_cli("run", str(path), dsn=dsn, env=env, timeout=120)
    assert first.returncode == ExitCode.FAILED, first.stdout
    ctx, _ = store.load_context("default/huge")
    assert (ctx.status.phase, ctx.status.reason) == ("Failed", "PayloadTooLarge")
    assert "call-1-0 (big_output)" in ctx.status.message and "2.0 MiB" in ctx.status.message, ctx.status.message
    assert "AGENTFAST_PAYLOAD_MAX_BYTES" in ctx.status.message
    # The call is done (an error result saying why), so nothing ever runs it again; the run stays Failed.
    [entry] = store.journal("default/huge")
    assert entry.state == "done" and entry.result.is_error and "could not be stored" in entry.result.content
    again = run_cli("resume", "default/huge", dsn=dsn, env=env, timeout=120)
    assert again.returncode == ExitCode.FAILED, again.stdout
    assert _invocations(dsn, "big_output") == 1
    assert _payloads(dsn, "default/huge") == []


def test_a_postgres_program_limit_error_is_permanent_not_retried(dsn: str) -> None:
    with Store(dsn, retry_for_s=30) as s:
        attempts = []

        def op(conn: psycopg.Connection) -> None:
            attempts.append(1)
            conn.execute("SELECT repeat('x', 1100000000)")  # over 1 GB: SQLSTATE 54000, "requested length too large"

        began = time.monotonic()
        with pytest.raises(PayloadTooLarge) as err:
            s._retry(op)
        assert len(attempts) == 1 and time.monotonic() - began < 5  # a connection error would be retried for 30 s
        assert "SQLSTATE 54000" in str(err.value) and "Postgres cannot store it" in str(err.value)


def test_payloads_go_with_the_run_and_follow_an_archive(dsn: str, store: Store, tmp_path: Path) -> None:
    for name in ("kept", "gone"):
        outcome, _ = _drive(store, _big_run(tmp_path, name, 2 * MIB, seed=name))
        assert outcome.phase == "Succeeded", outcome
    archived = store.archive_run("default/kept")
    assert _payloads(dsn, archived) == [2 * MIB]  # renamed with the run (ON UPDATE CASCADE)
    assert [m.content for m in store.load_snapshot(archived).messages if m.role == "tool"] == [big_text(2 * MIB, "kept")]
    # A reference whose payload is gone (a hand-edited database) is an unreadable row, never a wrong value.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM agentfast_payloads WHERE run_id = 'default/gone'")
    with pytest.raises(
        UnreadableState, match=r"agentfast_messages seq 2: it refers to payload sha256:[0-9a-f]{64}, which is not stored"
    ):
        store.load_snapshot("default/gone")
    assert store.delete_run("default/gone")
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_payloads WHERE run_id = 'default/gone'") == 0
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_payloads") == 1


def test_a_large_model_message_and_arguments_are_stored_out_of_line(dsn: str, tmp_path: Path) -> None:
    # The script file is capped at 1 MiB: a 64 KiB threshold makes 200 KB "large".
    answer, text = big_text(200_000, "answer"), big_text(200_000, "args")
    script = _script(
        tmp_path,
        [
            {"tool_calls": [{"id": "c1", "name": "echo", "arguments": {"text": text}}]},
            {"content": answer},
        ],
    )
    with Store(dsn, retry_for_s=5, payload_limits=Limits(threshold_bytes=64 * 1024)) as s:
        s.migrate()
        outcome, requests = _drive(s, _agentrun("talky", script, [ECHO]))
        assert outcome.phase == "Succeeded" and outcome.message == answer, outcome.message[:300]
        run_id = "default/talky"
        hot = _hot_rows(dsn, run_id)
        assert max(hot.values()) < HOT_ROW_BYTES, hot
        # The arguments (in the turn, the journal and the transcript: one row), the echo's
        # output (text + key: another) and the answer (turn and transcript: one more).
        assert len(_payloads(dsn, run_id)) == 3
        assert s.load_turn(run_id, 2).message.content == answer
        [entry] = s.journal(run_id)
        assert yaml.safe_load(entry.tool_call.arguments) == {"text": text} and text in entry.result.content
        snap = s.load_snapshot(run_id)
        assert snap.messages[-1].content == answer and snap.messages[-3].tool_calls[0].arguments == entry.tool_call.arguments
        assert text in [m for m in requests[1]["messages"] if m["role"] == "tool"][0]["content"]


@pytest.mark.process
def test_the_threshold_is_configurable_and_lookalike_text_comes_back_verbatim(
    dsn: str, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTFAST_PAYLOAD_THRESHOLD_BYTES", "1000")
    monkeypatch.setenv("AGENTFAST_PAYLOAD_MAX_BYTES", "5000")
    limits = Limits.from_env()
    assert limits == Limits(1000, 5000)
    out: dict[str, str] = {}
    assert externalize("x" * 1000, limits, out, what="v") == "x" * 1000 and out == {}  # at the threshold: inline
    assert externalize("x" * 1001, limits, out, what="v").startswith(PREFIX) and len(out) == 1
    assert externalize("é" * 501, limits, out, what="v").startswith(PREFIX)  # bytes, not characters: 1002 of them
    with pytest.raises(PayloadTooLarge) as err:
        externalize({"a": ["y" * 5001]}, limits, out, what="the thing")
    assert str(err.value).startswith("the thing of 4.9 KiB (5001 bytes) cannot be stored")
    monkeypatch.setenv("AGENTFAST_PAYLOAD_THRESHOLD_BYTES", "lots")
    with pytest.raises(ValueError, match="AGENTFAST_PAYLOAD_THRESHOLD_BYTES"):
        Limits.from_env()
    monkeypatch.delenv("AGENTFAST_PAYLOAD_THRESHOLD_BYTES")
    monkeypatch.delenv("AGENTFAST_PAYLOAD_MAX_BYTES")
    assert Limits.from_env() == Limits(MIB, 64 * MIB)
    refused = run_cli("list", dsn=dsn, env={"AGENTFAST_PAYLOAD_MAX_BYTES": "64M"})  # a bad setting: bad input, no traceback
    assert refused.returncode == 2 and "AGENTFAST_PAYLOAD_MAX_BYTES: '64M' is not a whole number of bytes" in refused.stdout, (
        refused.stdout
    )
    # Text that looks like a reference (a tool may return anything) is itself kept out of line,
    # so it reads back as written, never as some other payload of the run.
    lookalike = f"{PREFIX}sha256:{'0' * 64}:5"
    outcome, requests = _drive(
        store,
        _agentrun(
            "mimic",
            _script(
                tmp_path,
                [
                    {"tool_calls": [{"id": "c1", "name": "echo", "arguments": {"text": lookalike}}]},
                    {"content": lookalike},
                ],
            ),
            [ECHO],
        ),
    )
    assert outcome.phase == "Succeeded" and outcome.message == lookalike
    snap = store.load_snapshot("default/mimic")
    assert snap.messages[-1].content == lookalike and lookalike in snap.messages[-2].content


@pytest.mark.process
def test_a_namespaces_runner_role_stores_its_payloads_and_sees_no_others(dsn: str, store: Store, tmp_path: Path) -> None:
    doc = _big_run(tmp_path, "tenant-big", 2 * MIB, seed="t")
    doc["metadata"]["namespace"] = "team-a"
    run_id = "team-a/tenant-big"
    store.create_run(run_id, doc["metadata"]["uid"], doc)
    role_a, _ = store.set_tenant_password("team-a", "pw-a")
    role_b, _ = store.set_tenant_password("team-b", "pw-b")
    # What a runner pod does: resume with the namespace's own role (G11), the tools with their own DSN.
    done = run_cli(
        "resume",
        run_id,
        dsn=psycopg.conninfo.make_conninfo(dsn, user=role_a, password="pw-a"),
        env={EXAMPLES_DSN_ENV: examples_dsn_for(dsn)},
        timeout=120,
    )
    assert done.returncode == ExitCode.OK, done.stdout
    assert _payloads(dsn, run_id) == [2 * MIB]
    assert [m.content for m in store.load_snapshot(run_id).messages if m.role == "tool"] == [big_text(2 * MIB, "t")]
    with psycopg.connect(psycopg.conninfo.make_conninfo(dsn, user=role_b, password="pw-b"), autocommit=True) as b:
        assert b.execute("SELECT count(*) FROM agentfast_payloads").fetchone()[0] == 0  # row-level security


@pytest.mark.process
def test_the_langgraph_adapter_resumes_on_a_stored_payload_without_rerunning_the_tool(
    dsn: str, store: Store, tmp_path: Path
) -> None:
    doc = _big_run(tmp_path, "graph-big", 2 * MIB, seed="g")
    doc["spec"].update(adapter="langgraph", graph={"ref": "agentfast.runner.examples.refund_graph:build"})
    path = tmp_path / "graph-big.yaml"
    path.write_text(yaml.safe_dump(doc))
    first = run_cli("run", str(path), dsn=dsn, fault="tool.after_persist:big_output", timeout=120)
    assert first.returncode == -9, first.stdout
    second = run_cli("resume", "default/graph-big", dsn=dsn, timeout=120)
    assert second.returncode == ExitCode.OK, second.stdout
    assert _invocations(dsn, "big_output") == 1  # the journal's stored result was resolved and replayed (G3)
    snap = store.load_snapshot("default/graph-big")
    assert snap.context.status.phase == "Succeeded"
    assert [m.content for m in snap.messages if m.role == "tool"] == [big_text(2 * MIB, "g")]
    assert _payloads(dsn, "default/graph-big") == [2 * MIB]
    hot = _hot_rows(dsn, "default/graph-big")
    # sdk_state is LangGraph's own blob and stays whole (docs/architecture.md, "Large payloads").
    assert max(v for k, v in hot.items() if k != "agentfast_checkpoints.sdk_state") < HOT_ROW_BYTES, hot


def test_a_model_reply_or_an_input_over_the_ceiling_fails_the_run(dsn: str, tmp_path: Path) -> None:
    with Store(dsn, retry_for_s=5, payload_limits=Limits(threshold_bytes=64 * 1024, max_bytes=100_000)) as s:
        s.migrate()
        script = _script(tmp_path, [{"content": big_text(200_000, "reply")}])
        outcome, _ = _drive(s, _agentrun("chatty", script, [ECHO]))
        assert (outcome.phase, outcome.exit_code) == ("Failed", ExitCode.FAILED)
        assert outcome.message.startswith("the model's reply of iteration 1 of 195.3 KiB (200000 bytes) cannot be stored"), (
            outcome.message
        )
        assert s.load_turn("default/chatty", 1) is None  # refused before anything was written
        # The very first commit refused (the input itself): the run still ends Failed, with an empty transcript.
        doc = _agentrun("wordy", script, [ECHO])
        doc["spec"]["input"] = big_text(150_000, "input")
        outcome, requests = _drive(s, doc)
        assert (outcome.phase, outcome.exit_code) == ("Failed", ExitCode.FAILED) and requests == []  # no model call
        assert outcome.message.startswith("message 0 of the transcript of 146.5 KiB"), outcome.message
        ctx, _ = s.load_context("default/wordy")
        assert ctx.status.reason == "PayloadTooLarge" and s.load_snapshot("default/wordy").messages == []
