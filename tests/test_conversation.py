"""A human in the conversation (issue 17 item 3, docs/conversation.md), with real runner processes.

The recorded support conversation (``testing/scripts/support_conversation.yaml``) has the user in
it three times: the agent asks for the order number with ``ask_user``; it asks card or store
credit in plain text ending in ``?`` (``spec.conversation`` makes that a question); and it asks
"anything else?" at the end, after which it ends the conversation with the built-in
``end_conversation`` tool. Between them a gated refund waits for an approval. Each of the
script's turns after a question ``expect``s the user's words in the request's last message: the
scripted model answers HTTP 400 otherwise, so a run that ends Succeeded proves every reply
reached the model.

The oracle is an uninterrupted run (one process; the replies and the approval given while it
waits). The test run SIGKILLs its runner at every wait (three questions, one approval), answers
from another process (``agentfast reply``, ``agentfast approve``), and resumes in a new process:
it must end with the same transcript, each tool's effect made once (counted from the rows the
examples' tools write), and the replies recorded once each, attributed.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest

from agentfast.runner.conversation import ASK_USER, as_question
from agentfast.runner.decisions import InvalidDecision, check_decision, check_decision_fits
from agentfast.runner.snapshot import AwaitedCall, Message, StateSnapshot, ToolCall
from agentfast.runner.spec import SpecError, parse_agentrun
from agentfast.runner.store import Store

from .conformance import invocations, refunds
from .helpers import agentrun_file, phase_of, run_cli, spawn_cli, wait_until

REPLIES = {1: "Sure, it's A-1042.", 3: "To my card, please.", 5: "No, that's all, thanks!"}
APPROVAL = "call-4-0"  # iteration 4: the refund (gated) and a case note


def conversation_file(tmp_path: Path, adapter: str, name: str) -> Path:
    spec: dict[str, object] = {}
    if adapter == "langgraph":
        spec = {"adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"}}
    path = agentrun_file(tmp_path, "support-conversation.yaml", uid=str(uuid.uuid4()), **spec)
    path.write_text(path.read_text().replace("name: support-chat", f"name: {name}"))
    return path


def wait_for_human(store: Store, run_id: str, after: str = "") -> tuple[str, str]:
    """``(phase, call id)`` once the run waits for a reply or a decision on a call other than ``after``."""

    def waiting() -> bool:
        loaded = store.load_context(run_id)
        if loaded is None:
            return False
        ctx, pending = loaded
        if ctx.status.phase in ("Succeeded", "Failed"):
            return True
        return (
            ctx.status.phase in ("WaitingForInput", "WaitingForApproval")
            and pending is not None
            and after not in pending.call_ids
        )

    wait_until(waiting, timeout=60, what=f"{run_id} to wait for a human")
    ctx, pending = store.load_context(run_id)
    assert ctx.status.phase in ("WaitingForInput", "WaitingForApproval"), ctx.status
    assert pending is not None
    return ctx.status.phase, pending.awaiting[0].call_id


def answer(dsn: str, run: str, phase: str, call_id: str) -> None:
    """Answer the awaited call from another process, as a user does."""
    iteration = int(call_id.split("-")[1])
    if phase == "WaitingForInput":
        got = run_cli("reply", run, REPLIES[iteration], dsn=dsn)
    else:
        assert call_id == APPROVAL
        got = run_cli("approve", run, call_id, dsn=dsn)
    assert got.returncode == 0, got.stdout


def assert_effects_once(dsn: str) -> None:
    assert invocations(dsn, "lookup_order") == 1
    assert invocations(dsn, "add_case_note") == 1
    assert refunds(dsn) == 1


@pytest.mark.process
@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_a_recorded_conversation_killed_at_every_wait_ends_as_an_uninterrupted_one(
    tmp_path: Path, dsn: str, store: Store, adapter: str
) -> None:
    # The oracle: one runner, answered while it waits.
    ref_id = "default/chat-ref"
    proc = spawn_cli("run", str(conversation_file(tmp_path, adapter, "chat-ref")), dsn=dsn)
    waits: list[tuple[str, str]] = []
    for _ in range(4):
        phase, call_id = wait_for_human(store, ref_id, after=waits[-1][1] if waits else "")
        waits.append((phase, call_id))
        answer(dsn, "chat-ref", phase, call_id)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    assert waits == [
        ("WaitingForInput", "call-1-0"),
        ("WaitingForInput", "call-3-0"),
        ("WaitingForApproval", APPROVAL),
        ("WaitingForInput", "call-5-0"),
    ]
    ref = store.load_snapshot(ref_id)
    assert (ref.context.status.phase, ref.context.status.reason) == ("Succeeded", "EndedByAgent"), ref.context.status
    assert ref.context.status.message == "You're welcome! Have a great day."
    assert [c.name for c in ref.messages[-2].tool_calls] == ["end_conversation"]
    assert_effects_once(dsn)

    # The same conversation, its runner SIGKILLed at each of the four waits.
    run_id = "default/chat-killed"
    path = conversation_file(tmp_path, adapter, "chat-killed")
    proc = spawn_cli("run", str(path), dsn=dsn)
    after = ""
    for expected in waits:
        assert wait_for_human(store, run_id, after) == expected
        after = expected[1]
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        answer(dsn, "chat-killed", *expected)
        proc = spawn_cli("resume", "chat-killed", "--force", dsn=dsn)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    snap = store.load_snapshot(run_id)
    assert snap.context.status.phase == "Succeeded", snap.context.status
    assert snap.context.counters.resumes == 4

    # The same transcript as the uninterrupted run (but for the run's uid in the refund's key).
    def transcript(s: StateSnapshot) -> str:
        return json.dumps([m.model_dump() for m in s.messages]).replace(s.context.session.run_uid, "UID")

    assert transcript(snap) == transcript(ref)
    # Each reply is the tool result the model read after its question, once.
    results = {m.tool_call_id: m.content for m in snap.messages if m.role == "tool"}
    asks = [c for m in snap.messages for c in m.tool_calls if c.name == ASK_USER]
    assert [results[c.id] for c in asks] == list(REPLIES.values())
    # Every effect of both runs once per run: lookup, note and refund each ran once more, not twice.
    assert invocations(dsn, "lookup_order") == 2 and invocations(dsn, "add_case_note") == 2 and refunds(dsn) == 2
    log = store.decision_log(run_id)
    assert [(d["call_id"], d["decision"]) for d in log] == [
        ("call-1-0", "reply"),
        ("call-3-0", "reply"),
        (APPROVAL, "approve"),
        ("call-5-0", "reply"),
    ]
    assert all(d["decided_by"].startswith("cli:") for d in log)


@pytest.mark.process
def test_reply_and_approve_are_refused_for_the_other_kind_of_wait(tmp_path: Path, dsn: str, store: Store) -> None:
    proc = spawn_cli("run", str(conversation_file(tmp_path, "vanilla", "chat-kinds")), "--no-wait", dsn=dsn)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "the agent asks (call-1-0): Could you give me the order number?" in out
    assert "WaitingForInput" in out
    got = run_cli("approve", "chat-kinds", "call-1-0", dsn=dsn)
    assert got.returncode == 2 and "question to the user" in got.stdout, got.stdout
    got = run_cli("reply", "chat-kinds", "   ", dsn=dsn)
    assert got.returncode == 2 and "needs its text" in got.stdout, got.stdout
    got = run_cli("reply", "chat-kinds", "x", "--call", "call-9-0", dsn=dsn)
    assert got.returncode == 2 and "not a question awaiting a reply" in got.stdout, got.stdout
    assert store.decision_log("default/chat-kinds") == []
    got = run_cli("reply", "chat-kinds", REPLIES[1], dsn=dsn)
    assert got.returncode == 0, got.stdout
    got = run_cli("reply", "chat-kinds", "again", dsn=dsn)  # a second reply to the same question (issue 31 item 2)
    assert got.returncode == 2 and "call-1-0 of run default/chat-kinds was already answered" in got.stdout, got.stdout
    got = run_cli("reply", "chat-kinds", "again", "--call", "call-1-0", dsn=dsn)
    assert got.returncode == 2 and "already decided" in got.stdout, got.stdout
    # Resumed: it looks the order up, then asks card-or-credit in plain text.
    got = run_cli("resume", "chat-kinds", "--no-wait", dsn=dsn)
    assert got.returncode == 0, got.stdout
    assert phase_of(store, "default/chat-kinds") == "WaitingForInput"
    # The refused reply was kept for nothing: the new question awaits its own reply.
    (question,) = store.awaiting("default/chat-kinds")
    assert question.call_id != "call-1-0" and store.get_decision("default/chat-kinds", question.call_id) is None
    assert [d["result"] for d in store.decision_log("default/chat-kinds")] == [REPLIES[1]]
    got = run_cli("reply", "chat-kinds", REPLIES[3], dsn=dsn)
    assert got.returncode == 0, got.stdout
    got = run_cli("resume", "chat-kinds", "--no-wait", dsn=dsn)
    assert got.returncode == 0 and "WaitingForApproval" in got.stdout, got.stdout
    got = run_cli("reply", "chat-kinds", "yes", "--call", APPROVAL, dsn=dsn)
    assert got.returncode == 2 and "not a question awaiting a reply" in got.stdout, got.stdout
    with pytest.raises(InvalidDecision, match="awaiting approval, not a question"):
        store.decide("default/chat-kinds", APPROVAL, "reply", result="yes", decided_by="test")
    assert store.get_decision("default/chat-kinds", APPROVAL) is None


@pytest.mark.process
def test_a_reply_the_model_did_not_get_fails_the_scripted_expectation(tmp_path: Path, dsn: str, store: Store) -> None:
    """The script's ``expect`` is a real check: a reply without the order number makes the
    scripted model refuse the next request (HTTP 400), and the run fails rather than go on."""
    got = run_cli("run", str(conversation_file(tmp_path, "vanilla", "chat-wrong")), "--no-wait", dsn=dsn)
    assert got.returncode == 0, got.stdout
    assert run_cli("reply", "chat-wrong", "I don't remember it", dsn=dsn).returncode == 0
    got = run_cli("resume", "chat-wrong", "--no-wait", dsn=dsn)
    assert got.returncode != 0
    ctx, _ = store.load_context("default/chat-wrong")
    assert ctx.status.phase == "Failed" and "expects the last message to contain 'A-1042'" in ctx.status.message


# -- the rules, without a runner -----------------------------------------------------------------


def test_every_message_without_a_tool_call_becomes_an_ask_user_call() -> None:
    """Issue 31 item 1: in a conversation a statement ends the agent's turn as a question does."""
    for message, question in (
        (Message(role="assistant", content="Card or store credit?  "), "Card or store credit?"),
        (Message(role="assistant", content="I have cancelled the order."), "I have cancelled the order."),
        (Message(role="assistant", content="Done. Have a nice day.\n"), "Done. Have a nice day."),
        (Message(role="assistant", refusal="I cannot help with that."), "I cannot help with that."),
        (Message(role="assistant", content=None), ""),
    ):
        asked = as_question(message, 3)
        assert [(c.id, c.name, json.loads(c.arguments)) for c in asked.tool_calls] == [
            ("ask-3", ASK_USER, {"question": question})
        ]
        assert asked.content == message.content  # the text stays what the model said
    calls = Message(role="assistant", content="Looking?", tool_calls=[ToolCall(id="c", name="lookup_order")])
    assert as_question(calls, 1) == calls


def test_reply_rules() -> None:
    assert check_decision("reply", None, "A-1042") == (None, "A-1042")
    assert check_decision("reply", None, "bad \x00 byte") == (None, "bad \ufffd byte")
    for reason, text, said in (
        (None, None, "needs its text"),
        (None, " \n", "needs its text"),
        ("because", "x", "has no reason"),
        (None, "x" * 4097, "at most 4096"),
    ):
        with pytest.raises(InvalidDecision, match=said):
            check_decision("reply", reason, text)
    question = AwaitedCall(
        call_id="call-1-0",
        iteration=1,
        position=0,
        tool_call=ToolCall(id="a", name=ASK_USER, arguments='{"question": "?"}'),
        idempotency_key="u:1:0",
        reason="awaiting_input",
    )
    gated = question.model_copy(update={"reason": "requires_approval", "tool_call": ToolCall(id="b", name="issue_refund")})
    check_decision_fits("reply", question)
    check_decision_fits("end", question)
    check_decision_fits("approve", gated)
    assert check_decision("end", None, None) == (None, None)
    with pytest.raises(InvalidDecision, match="only with complete"):
        check_decision("end", None, "text")
    for decision, awaited in (
        ("approve", question),
        ("complete", question),
        ("deny", question),
        ("reply", gated),
        ("end", gated),
    ):
        with pytest.raises(InvalidDecision):
            check_decision_fits(decision, awaited)


def test_spec_conversation_and_replies_shapes(tmp_path: Path) -> None:
    base = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": "c"},
        "spec": {"model": {"name": "m", "script": "refund"}, "input": "hi", "conversation": True},
    }
    assert parse_agentrun(base, check_imports=False).spec.conversation is True
    for builtin in ("ask_user", "end_conversation"):
        mine = {**base["spec"], "tools": [{"name": builtin, "ref": "pkg.tools:ask"}]}
        with pytest.raises(SpecError, match=f"{builtin} is a built-in tool of spec.conversation"):
            parse_agentrun({**base, "spec": mine}, check_imports=False)
    idle = {**base["spec"], "conversationIdleTimeout": 600}
    assert parse_agentrun({**base, "spec": idle}, check_imports=False).spec.conversationIdleTimeout == 600
    with pytest.raises(SpecError, match="needs spec.conversation: true"):
        parse_agentrun({**base, "spec": {**idle, "conversation": False}}, check_imports=False)
    with pytest.raises(SpecError, match="conversationIdleTimeout"):
        parse_agentrun({**base, "spec": {**idle, "conversationIdleTimeout": 0}}, check_imports=False)
    ended = {"callId": "call-1-0", "end": True, "repliedBy": "alice"}
    assert parse_agentrun({**base, "spec": {**base["spec"], "replies": [ended]}}, check_imports=False).spec.replies[0].end
    for bad, said in (
        ({**ended, "text": "bye"}, "not both"),
        ({"callId": "call-1-0", "repliedBy": "alice"}, "needs its text"),
    ):
        with pytest.raises(SpecError, match=said):
            parse_agentrun({**base, "spec": {**base["spec"], "replies": [bad]}}, check_imports=False)
    reply = {"callId": "call-1-0", "text": "yes", "repliedBy": "alice"}
    with pytest.raises(SpecError, match="answered twice: call-1-0"):
        parse_agentrun({**base, "spec": {**base["spec"], "replies": [reply, reply]}}, check_imports=False)
    with pytest.raises(SpecError, match="callId"):
        parse_agentrun({**base, "spec": {**base["spec"], "replies": [{**reply, "callId": "x"}]}}, check_imports=False)


@pytest.mark.process
def test_spec_replies_are_never_read_from_a_file(tmp_path: Path, dsn: str) -> None:
    path = agentrun_file(
        tmp_path, "support-conversation.yaml", replies=[{"callId": "call-1-0", "text": "A-1042", "repliedBy": "me"}]
    )
    got = run_cli("run", str(path), dsn=dsn)
    assert got.returncode == 2 and "spec.replies is never read from a file" in got.stdout, got.stdout
