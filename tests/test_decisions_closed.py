"""A decision the run can no longer use is refused with why, never "recorded" (issue 31 items 5 and 2).

- Case 12: past ``spec.activeDeadlineSeconds`` a run with no runner still reads
  ``WaitingForApproval``. ``status`` says the deadline passed and lists nothing as awaiting;
  ``approve``, ``deny``, ``complete`` and ``reply`` exit 2 naming ``activeDeadlineSeconds`` and
  the run's age; the local inbox offers nothing and refuses; the operator's recording of a
  ``spec.approvals`` entry refuses it with a Warning Event (``DecisionUnusable``) and records
  nothing. The next runner ends the run ``Failed``/``DeadlineExceeded`` and runs nothing.
- The same kind: a run asked to cancel (not yet carried out), and a run that has ended.
- ``complete --result`` takes plain text as well as JSON, and the model reads it as written, in
  both adapters.

Real parts: the test's own PostgreSQL database, ``agentfast`` processes, case 12's tool writing
one line per execution; the operator's recording function on the real store.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from agentfast.runner.decisions import InvalidDecision, check_decision, decisions_closed
from agentfast.runner.inbox import KubeInbox, LocalInbox, Refused, closed_in_agentrun
from agentfast.runner.store import DecisionUnusable, Store

from .helpers import phase_of, wait_until
from .test_decisions import CASES, Cli, refused, tool_messages

RUN, RID = "case3-03-deadline", "default/case3-03-deadline"


def _paused(cli: Cli, store: Store, **spec: object) -> None:
    """Case 12's run started with ``--no-wait``: paused on the gated send_payment (call-1-0), no runner."""
    p = cli("run", str(cli.agentrun(CASES / "12" / "agentrun.yaml", CASES / "12" / "script.yaml", **spec)), "--no-wait")
    assert p.returncode == 0 and "WaitingForApproval" in p.stdout, (p.stdout, p.stderr)
    assert phase_of(store, RID) == "WaitingForApproval"


def _past_deadline(store: Store) -> None:
    clock = store.run_clock(RID)
    assert clock is not None and clock[1] == 3
    wait_until(lambda: store.run_clock(RID)[0] >= 3.2, timeout=10, what="the run's deadline to pass")  # type: ignore[index]


@pytest.mark.process
def test_case12_past_its_deadline_every_decision_path_refuses_with_why(
    tmp_path: Path, dsn: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    cli = Cli(dsn, tmp_path, CASES / "12")
    _paused(cli, store)
    _past_deadline(store)

    # status: the deadline passed, and nothing shows as awaiting a decision
    doc = json.loads(cli("status", RUN, "-o", "json").stdout)
    assert doc["awaiting"] == [] and doc["deadline"]["passed"] is True
    assert doc["decisions_closed"]["reason"] == "DeadlineExceeded"
    assert "activeDeadlineSeconds" in doc["decisions_closed"]["message"]
    assert doc["next"]["state"] == "ending" and "resume" in doc["next"]["message"]
    text = cli("status", RUN).stdout
    phase_row = next(line for line in text.splitlines() if line.strip().startswith("phase"))
    assert "WaitingForApproval (DeadlineExceeded)" in phase_row and "past its deadline" in phase_row, text
    assert "the deadline has passed" in text and not any(line.strip().startswith("awaiting") for line in text.splitlines())
    assert "not decided" in text and "never runs" in text

    # the CLI: every decision refused, exit 2, naming the deadline and the run's age
    for args in (
        ("approve", RUN, "call-1-0"),
        ("deny", RUN, "call-1-0", "--reason", "too late anyway"),
        ("complete", RUN, "call-1-0", "--result", "paid by hand"),
    ):
        p = cli(*args)
        refused(p, "cannot be decided", "spec.activeDeadlineSeconds", "s old, over its deadline of 3 s")
    refused(cli("reply", RUN, "yes"), "takes no reply", "spec.activeDeadlineSeconds")

    # the store (every path's one rule), the local inbox
    with pytest.raises(DecisionUnusable, match="activeDeadlineSeconds") as got:
        store.decide(RID, "call-1-0", "approve", decided_by="test")
    assert got.value.closed.reason == "DeadlineExceeded"
    inbox = LocalInbox(store, "inbox:test")
    (row,) = [r for r in inbox.runs() if r.key == RID]
    assert row.pending == () and row.reason == "DeadlineExceeded" and "activeDeadlineSeconds" in (row.closed or "")
    with pytest.raises(Refused, match="activeDeadlineSeconds"):
        inbox.decide(RID, "call-1-0", "approve")

    # the operator's recording of spec.approvals: refused with a Warning Event, nothing recorded
    from agentfast.operator import main

    warned: list[tuple[str, str, str]] = []
    monkeypatch.setattr(main, "_event", lambda body, kind, reason, message: warned.append((kind, reason, message)))
    monkeypatch.setattr(main, "_warned", set())
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main, "approval_policy_missing", lambda: None)  # the chart's policy in force
    body = {
        "metadata": {"name": RUN, "namespace": "default", "uid": "u"},
        "spec": {"approvals": {"call-1-0": {"decision": "approve", "decidedBy": "alice"}}},
        "status": {},
    }
    # the operator's status: says why, lists no call as pending (so the admission policy admits none)
    from agentfast.operator.status import status_from_store

    ctx, pending, extra = main._load_status(RID)
    st = status_from_store(ctx, pending, generation=1, old=None, run_id=RID, **extra)
    assert st["phase"] == "WaitingForApproval" and st["pendingApprovals"] == [] and st["awaiting"] == ""
    assert "activeDeadlineSeconds" in st["message"] and "no decision can be used" in st["message"]
    (cond,) = [c for c in st["conditions"] if c["type"] == "DecisionsClosed"]
    assert (cond["status"], cond["reason"]) == ("True", "DeadlineExceeded")

    main._record_approvals(body, RID)
    assert [(k, r) for k, r, _ in warned] == [("Warning", "DecisionUnusable")]
    assert "spec.approvals: call-1-0" in warned[0][2] and "activeDeadlineSeconds" in warned[0][2]
    assert store.get_decision(RID, "call-1-0") is None and store.decision_log(RID) == []

    # the next runner ends it DeadlineExceeded without running the call; decisions stay refused, saying so
    p = cli("resume", RUN, "--no-wait")
    assert p.returncode == 1, (p.stdout, p.stderr)
    ctx, _ = store.load_context(RID)
    assert (ctx.status.phase, ctx.status.reason) == ("Failed", "DeadlineExceeded")
    assert cli.ran("send_payment") == 0
    refused(cli("approve", RUN, "call-1-0"), "the run has ended (Failed, DeadlineExceeded)")
    assert json.loads(cli("status", RUN, "-o", "json").stdout)["decisions_closed"] is None  # ended: the phase says it


@pytest.mark.process
def test_the_inbox_page_offers_nothing_past_the_deadline_and_a_stale_form_is_refused_saying_why(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    from .test_ui import _csrf, inbox_server

    cli = Cli(dsn, tmp_path, CASES / "12")
    _paused(cli, store, activeDeadlineSeconds=3600)
    with inbox_server(dsn) as inbox, inbox.client() as http:
        shown = http.get(f"/runs/{RID}")  # the page a person reads, with its approve form
        assert 'data-call-id="call-1-0"' in shown.text and "No decision can be used" not in shown.text
        with psycopg.connect(dsn, autocommit=True) as conn:  # as if an hour and a minute had gone by since
            conn.execute("UPDATE agentfast_runs SET created_at = now() - interval '61 minutes' WHERE run_id = %s", (RID,))
        page = http.get(f"/runs/{RID}")
        assert page.status_code == 200 and "No decision can be used any more" in page.text, page.text[:2000]
        assert "activeDeadlineSeconds" in page.text and 'data-call-id="call-1-0"' not in page.text
        listed = http.get("/")
        assert "no decision can be used" in listed.text and 'data-call-id="call-1-0"' not in listed.text
        # The form of the page shown before the deadline, posted after it
        form = {"call_id": "call-1-0", "decision": "approve", "csrf": _csrf(shown.text), "uid": store.get_run(RID).run_uid}  # type: ignore[union-attr]
        late = http.post(f"/runs/{RID}/decide", data=form)
        assert late.status_code == 409 and "cannot be decided" in late.text, late.text[:2000]
        assert "over its deadline of 3600 s" in late.text
    assert store.decision_log(RID) == [] and cli.ran("send_payment") == 0


@pytest.mark.process
def test_a_run_asked_to_cancel_or_ended_takes_no_decision_and_says_why(tmp_path: Path, dsn: str, store: Store) -> None:
    cli = Cli(dsn, tmp_path, CASES / "12")
    _paused(cli, store, activeDeadlineSeconds=None)
    assert store.decisions_closed(RID) is None and store.run_clock(RID)[1] is None  # type: ignore[index]
    # A cancel recorded and not carried out yet (the operator's spec.cancel while a runner holds the run)
    store.request_cancel(RID, "kubernetes (spec.cancel)")
    refused(cli("approve", RUN, "call-1-0"), "a cancel was asked for by kubernetes (spec.cancel)", "ends Cancelled")
    assert store.awaiting(RID) == [] and store.get_decision(RID, "call-1-0") is None
    doc = json.loads(cli("status", RUN, "-o", "json").stdout)
    assert doc["decisions_closed"]["reason"] == "Cancelled" and doc["deadline"] is None
    p = cli("resume", RUN, "--no-wait")
    assert p.returncode == 0 and phase_of(store, RID) == "Cancelled", (p.stdout, p.stderr)
    for args in (("approve", RUN, "call-1-0"), ("complete", RUN, "call-1-0", "--result", '{"sent": 50}')):
        refused(cli(*args), "cannot be decided", "the run has ended (Cancelled)")
    assert cli.ran("send_payment") == 0 and store.decision_log(RID) == []


@pytest.mark.process
def test_a_decision_before_the_deadline_is_recorded_and_used(tmp_path: Path, dsn: str, store: Store) -> None:
    """The rule refuses only what the run can no longer use: within its deadline a decision counts."""
    cli = Cli(dsn, tmp_path, CASES / "12")
    _paused(cli, store, activeDeadlineSeconds=120)
    before = json.loads(cli("status", RUN, "-o", "json").stdout)
    assert [a["call_id"] for a in before["awaiting"]] == ["call-1-0"] and before["decisions_closed"] is None
    assert before["deadline"]["seconds"] == 120 and before["deadline"]["passed"] is False
    assert "deadline has passed" not in cli("status", RUN).stdout
    # No question waits (the run waits for an approval): a reply is refused, never kept for later
    refused(cli("reply", RUN, "yes, pay her"), "asks the user nothing now", "never kept for a question to come")
    refused(cli("reply", RUN, "yes", "--call", "call-1-0"), "call-1-0", "is not a question awaiting a reply")
    p = cli("approve", RUN, "call-1-0")
    assert p.returncode == 0 and "approve recorded" in p.stdout, (p.stdout, p.stderr)
    p = cli("resume", RUN, "--no-wait")
    assert p.returncode == 0 and "Succeeded" in p.stdout, p.stdout
    assert cli.ran("send_payment") == 1


def test_the_rule_in_order_ended_then_cancelled_then_past_the_deadline() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert decisions_closed(phase="WaitingForApproval", age_s=2.9, deadline_s=3) is None
    assert decisions_closed(phase="WaitingForInput", age_s=1e9) is None  # no deadline
    late = decisions_closed(phase="WaitingForApproval", age_s=3.0, deadline_s=3)
    assert (
        late is not None and late.reason == "DeadlineExceeded" and "the run is 3 s old, over its deadline of 3 s" in late.message
    )
    cancel = decisions_closed(phase="Running", cancel_by="cli:ann", cancel_at=at, age_s=9, deadline_s=3)
    assert cancel is not None and cancel.reason == "Cancelled" and "cli:ann at 2026-01-02T03:04:05Z" in cancel.message
    ended = decisions_closed(phase="Failed", phase_reason="DeadlineExceeded", cancel_by="x", age_s=9, deadline_s=3)
    assert ended is not None and ended.reason == "RunEnded" and "(Failed, DeadlineExceeded)" in ended.message


def test_the_cluster_inbox_reads_the_rule_off_the_agentrun() -> None:
    """--kube and the cluster inbox: from what the API server returned (the operator applies the
    same rule to the store when it records the entry)."""
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    body = {
        "metadata": {"name": "r", "namespace": "ns", "uid": "u", "creationTimestamp": "2026-01-02T03:04:00Z"},
        "spec": {"activeDeadlineSeconds": 3},
        "status": {
            "phase": "WaitingForApproval",
            "reason": "AwaitingApproval",
            "pendingApprovals": [
                {"callId": "call-1-0", "tool": "send_payment", "arguments": "{}", "reason": "requires_approval"}
            ],
        },
    }
    late = closed_in_agentrun(body, now)
    assert late is not None and late.reason == "DeadlineExceeded" and "the run is 5 s old" in late.message
    assert closed_in_agentrun(body, now - timedelta(seconds=3)) is None
    row = KubeInbox._row({**body, "metadata": {**body["metadata"], "creationTimestamp": "2000-01-01T00:00:00Z"}})
    assert row.pending == () and row.reason == "DeadlineExceeded" and row.closed
    cancelled = {**body, "spec": {"cancel": True}}
    assert closed_in_agentrun(cancelled, now).reason == "Cancelled"  # type: ignore[union-attr]
    ended = {**body, "status": {"phase": "Succeeded", "reason": "Completed"}}
    assert closed_in_agentrun(ended, now).reason == "RunEnded"  # type: ignore[union-attr]
    # The reply of --kube picks the question from status, never one spec.replies already answers
    asking = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
        "spec": {"replies": [{"callId": "call-1-0", "text": "A-1042", "repliedBy": "ann"}]},
        "status": {
            "phase": "WaitingForInput",
            "pendingApprovals": [
                {"callId": "call-1-0", "tool": "ask_user", "arguments": '{"question": "Order?"}', "reason": "awaiting_input"}
            ],
        },
    }
    inbox = KubeInbox.__new__(KubeInbox)
    with pytest.raises(Refused, match="call-1-0 of agentrun ns/c was already answered by ann"):
        inbox.question_now(asking, None)
    running = {**asking, "status": {"phase": "Running"}}
    with pytest.raises(Refused, match="asks the user nothing now .its last question, call-1-0, was answered by ann"):
        inbox.question_now(running, None)
    asking["spec"] = {}
    assert inbox.question_now(asking, None) == "call-1-0"


# -- complete --result: plain text as well as JSON ---------------------------------------------------


def test_complete_takes_plain_text_and_json_verbatim() -> None:
    assert check_decision("complete", None, "voucher V-100 went out by hand") == (None, "voucher V-100 went out by hand")
    assert check_decision("complete", None, '{"voucher": "V-100"}') == (None, '{"voucher": "V-100"}')
    assert check_decision("complete", None, '"quoted"') == (None, '"quoted"')  # JSON is kept as written, too
    for bad in ("", "   "):
        with pytest.raises(InvalidDecision, match="JSON or plain text"):
            check_decision("complete", None, bad)
    with pytest.raises(InvalidDecision, match="levels deep"):
        check_decision("complete", None, "[" * 200 + "]" * 200)


@pytest.mark.process
@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_complete_with_plain_text_is_the_result_the_model_reads(tmp_path: Path, dsn: str, store: Store, adapter: str) -> None:
    cli = Cli(dsn, tmp_path, CASES)
    tools = [{"name": n, "ref": f"decision_tools:{n}"} for n in ("freeze_card", "add_note", "refund_charge")]
    extra = (
        {"adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"}}
        if adapter == "langgraph"
        else {}
    )
    path = cli.agentrun(CASES / "05" / "agentrun.yaml", CASES / "batch4.yaml", tools=tools, **extra)
    rid = "default/case05-decisions"
    proc = cli.spawn("run", str(path))  # waits for the decisions
    try:
        wait_until(lambda: [a.call_id for a in store.awaiting(rid)] == ["call-1-0", "call-1-2"], what="both gated calls pending")
        p = cli("complete", "case05-decisions", "call-1-0", "--result", "card 0457 frozen by phone")
        assert p.returncode == 0 and "with result card 0457 frozen by phone" in p.stdout, (p.stdout, p.stderr)
        assert cli("approve", "case05-decisions", "call-1-2").returncode == 0
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Succeeded" in out, (out, err)
    assert tool_messages(store, rid)["tc_1"] == "card 0457 frozen by phone"  # as written: never a quoted JSON string
    assert cli.ran("freeze_card") == 0
