"""A decision binds to what its decider saw (G13; issue 30 items 1 and 8).

The attack of issue 30: the approver was shown ``amount_cents: 4999``; a write path (there, a
runner role of another namespace) changed the stored arguments afterwards, and the tool received
999999. Whatever the write path, a decision now stores the digest of the arguments as shown
(runner/arguments.py) and the runner runs an approved call only with arguments of that digest.
And what is shown is what runs: arguments with a key twice are refused (the model is told), and
a cut view in status says it is cut and where the whole text is.

Real parts: the test's own PostgreSQL database, ``agentfast`` processes, the refund example's
tools writing to their ledger, and the operator's decision path (``_record_approvals``) on the
real store.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.arguments import DuplicateKey, arguments_digest, loads_arguments
from agentfast.runner.decisions import InvalidDecision
from agentfast.runner.snapshot import AwaitedCall, ToolCall
from agentfast.runner.store import Store

from .helpers import run_cli
from .test_trust_boundaries import _refund_doc, _refunds

SHOWN = '"amount_cents": 4999'


def _paused(tmp_path: Path, dsn: str, store: Store, name: str) -> str:
    """The refund example run ``name`` paused on its gated refund call-2-0; returns its run id."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_refund_doc(name)))
    proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
    run_id = f"default/{name}"
    assert proc.returncode == 0 and [a.call_id for a in store.awaiting(run_id)] == ["call-2-0"], proc.stdout
    return run_id


def _shown(store: Store, run_id: str) -> str:
    """The arguments of call-2-0 as a decider is shown them (the awaited call's)."""
    (a,) = store.awaiting(run_id)
    assert SHOWN in a.tool_call.arguments, a.tool_call.arguments
    return a.tool_call.arguments


def _rewrite_journal(dsn: str, run_id: str, arguments: str) -> None:
    """Change what the runner would run, as an unknown write path would: the journal's arguments
    of call-2-0, written as a superuser past every trigger (more than any role of the product holds)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")  # past every trigger, the fence's too
        done = conn.execute(
            "UPDATE agentfast_tool_calls SET arguments = %s WHERE run_id = %s AND call_id = 'call-2-0'", (arguments, run_id)
        )
        assert done.rowcount == 1


@pytest.mark.process
def test_arguments_changed_after_the_approval_never_run_and_the_run_fails_saying_why(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    run_id = _paused(tmp_path, dsn, store, "rewritten")
    shown = _shown(store, run_id)
    approved = run_cli("approve", "rewritten", "call-2-0", dsn=dsn)
    assert approved.returncode == 0, approved.stdout
    assert store.get_decision(run_id, "call-2-0").arguments_digest == arguments_digest(shown)

    _rewrite_journal(dsn, run_id, shown.replace("4999", "999999"))
    resumed = run_cli("resume", "rewritten", dsn=dsn, timeout=90)
    assert resumed.returncode == 1, (resumed.stdout, resumed.stderr)
    assert _refunds(dsn) == 0  # the tool never received the call
    ctx, _ = store.load_context(run_id)
    assert (ctx.status.phase, ctx.status.reason) == ("Failed", "ArgumentsChanged")
    assert "call-2-0 issue_refund was approved by cli:" in ctx.status.message
    assert arguments_digest(shown)[:19] in ctx.status.message and "never ran" in ctx.status.message


@pytest.mark.process
def test_unchanged_arguments_run_once_approved_with_the_digest_shown(tmp_path: Path, dsn: str, store: Store) -> None:
    run_id = _paused(tmp_path, dsn, store, "bound")
    shown = run_cli("status", "bound", "-o", "json", dsn=dsn)
    (awaiting,) = json.loads(shown.stdout)["awaiting"]  # what a person reads, with what --digest takes
    digest = awaiting["arguments_digest"]
    assert awaiting["arguments"] == _shown(store, run_id) and digest == arguments_digest(awaiting["arguments"])
    text = run_cli("status", "bound", dsn=dsn).stdout
    assert "arguments digest" in text and digest in "".join(text.split()), text  # the table may wrap it
    approved = run_cli("approve", "bound", "call-2-0", "--digest", digest, dsn=dsn)
    assert approved.returncode == 0, approved.stdout
    resumed = run_cli("resume", "bound", dsn=dsn, timeout=90)
    assert resumed.returncode == 0 and "Succeeded" in resumed.stdout, resumed.stdout
    assert _refunds(dsn) == 1


@pytest.mark.process
def test_a_decision_on_arguments_that_are_not_the_calls_is_refused_and_nothing_recorded(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    run_id = _paused(tmp_path, dsn, store, "mismatch")
    other = arguments_digest(_shown(store, run_id).replace("4999", "999999"))
    for decision in (("approve",), ("deny", "--reason", "no"), ("complete", "--result", '{"ok": true}')):
        p = run_cli(decision[0], "mismatch", "call-2-0", *decision[1:], "--digest", other, dsn=dsn)
        said = p.stdout + p.stderr
        assert p.returncode == 2 and "not the ones you were shown" in said and "Traceback" not in said, said
    with pytest.raises(InvalidDecision, match="nothing was decided"):
        store.decide(run_id, "call-2-0", "approve", decided_by="cli:t", arguments_digest=other)
    assert store.get_decision(run_id, "call-2-0") is None
    # A digest that is not one at all never reaches the store (the column's CHECK refuses it too).
    p = run_cli("approve", "mismatch", "call-2-0", "--digest", "sha256:nope", dsn=dsn)
    assert p.returncode == 2 and store.get_decision(run_id, "call-2-0") is None


@pytest.mark.process
def test_the_operator_binds_a_spec_approval_to_the_digest_status_showed(
    tmp_path: Path, dsn: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentfast.operator import main
    from agentfast.operator.status import status_from_store

    run_id = _paused(tmp_path, dsn, store, "cluster-bound")
    warned: list[tuple[str, str]] = []
    monkeypatch.setattr(main, "_event", lambda body, kind, reason, message: warned.append((reason, message)))
    monkeypatch.setattr(main, "_warned", set())
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main, "approval_policy_missing", lambda: None)  # the chart's policy in force
    ctx, pending, extra = main._load_status(run_id)
    status = status_from_store(ctx, pending, generation=1, old=None, **extra)
    (listed,) = status["pendingApprovals"]
    shown = _shown(store, run_id)
    assert listed["arguments"] == shown and listed["argumentsDigest"] == arguments_digest(shown)
    assert "argumentsTruncated" not in listed

    # The status the approver saw named other arguments than the call holds now (here the
    # status is the stale one; either way the decision is on something other than what would run).
    body = {
        "metadata": {"name": "cluster-bound", "namespace": "default", "uid": "u"},
        "spec": {"approvals": {"call-2-0": {"decision": "approve", "decidedBy": "alice"}}},
        "status": {"pendingApprovals": [{**listed, "argumentsDigest": arguments_digest(shown.replace("4999", "999999"))}]},
    }
    main._record_approvals(body, run_id)  # status (as the decider saw it) names other arguments: refused
    assert store.get_decision(run_id, "call-2-0") is None
    assert [r for r, _ in warned] == ["InvalidDecision"] and "not the ones you were shown" in warned[0][1]

    body["status"]["pendingApprovals"] = [listed]
    monkeypatch.setattr(main, "_warned", set())
    main._record_approvals(body, run_id)
    d = store.get_decision(run_id, "call-2-0")
    assert d is not None and d.arguments_digest == listed["argumentsDigest"]


def test_status_says_when_the_arguments_it_shows_are_cut_and_digests_the_whole_text() -> None:
    from agentfast.operator.status import ARGUMENTS_CHARS, pending_entry

    whole = json.dumps({"amount_cents": 4999, "note": "x" * 2000, "tail": "after the cut"})
    call = AwaitedCall(
        call_id="call-2-0",
        iteration=2,
        position=0,
        tool_call=ToolCall(id="t", name="issue_refund", arguments=whole),
        idempotency_key="k",
        reason="requires_approval",
    )
    entry = pending_entry(call)
    assert entry["arguments"] == whole[:ARGUMENTS_CHARS] and entry["argumentsTruncated"] is True
    assert entry["argumentsChars"] == len(whole)
    assert f"first {ARGUMENTS_CHARS} of {len(whole)} characters" in entry["argumentsNote"]
    assert "agentfast ui" in entry["argumentsNote"] and "argumentsDigest" in entry["argumentsNote"]
    assert entry["argumentsDigest"] == arguments_digest(whole)  # the whole text, never the cut


def test_arguments_naming_a_key_twice_are_refused_however_deep() -> None:
    assert loads_arguments('{"a": 1, "b": {"c": [1, {"d": 2}]}}') == {"a": 1, "b": {"c": [1, {"d": 2}]}}
    assert loads_arguments("") == {}
    for text in (
        '{"amount_cents": 4999, "reason": "x", "amount_cents": 999999}',
        '{"order": {"id": 1, "id": 2}}',
        '[{"k": 1}, {"k": 2, "k": 3}]',
    ):
        with pytest.raises(DuplicateKey, match="appears twice"):
            loads_arguments(text)
    # The digest is of the exact text: a byte of spacing is another text.
    assert arguments_digest('{"a": 1}') != arguments_digest('{"a":1}')
    assert arguments_digest('{"a": 1}') == arguments_digest('{"a": 1}')


@pytest.mark.process
def test_a_tool_call_naming_a_key_twice_never_runs_and_the_model_is_told(tmp_path: Path, dsn: str, store: Store) -> None:
    # The decoy of issue 30 item 8: a gated refund whose arguments show 4999 first and carry
    # 999999 after it. A human may approve what they read; the tool host refuses the text.
    script = {
        "model": "dup-keys",
        "turns": [
            {
                "tool_calls": [
                    {"id": "c1", "name": "lookup_order", "arguments_raw": '{"order_id": "A-1042", "order_id": "A-9999"}'},
                    {
                        "id": "c2",
                        "name": "issue_refund",
                        "arguments_raw": '{"order_id": "A-1042", "amount_cents": 4999, "reason": "dup", "amount_cents": 999999}',
                    },
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5},
            },
            {"content": "I could not issue it.", "usage": {"prompt_tokens": 10, "completion_tokens": 5}},
        ],
    }
    (tmp_path / "script.yaml").write_text(yaml.safe_dump(script))
    doc = _refund_doc("dup-keys")
    doc["spec"]["model"] = {"name": "dup-keys", "script": str(tmp_path / "script.yaml")}
    path = tmp_path / "dup.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
    run_id = "default/dup-keys"
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    if store.awaiting(run_id):  # the gated call waits for a person, who approves what is shown
        assert run_cli("approve", "dup-keys", "call-1-1", dsn=dsn).returncode == 0
        proc = run_cli("resume", "dup-keys", dsn=dsn, timeout=90)
    assert proc.returncode == 0 and "Succeeded" in proc.stdout, (proc.stdout, proc.stderr)
    assert _refunds(dsn) == 0
    told = {m.tool_call_id: m.content for m in store.load_snapshot(run_id).messages if m.role == "tool"}
    for call in ("c1", "c2"):
        assert "appears twice" in told[call] and "send each key once" in told[call], told
