"""A conversation as people have one (issue 31 item 1, docs/conversation.md), with real runner processes.

In a ``spec.conversation`` run every message of the model that calls no tool ends the agent's
turn and waits for the person (``WaitingForInput``), a statement ("I have cancelled the order.")
as much as a question. The conversation ends only when the person ends it (``agentfast end``),
when the model calls the built-in ``end_conversation`` tool, or after
``spec.conversationIdleTimeout``; each ends the run ``Succeeded`` with its own reason.

The scripted model plays each conversation. A turn after the person's reply ``expect``s their
words, and a request past the script's last turn is answered HTTP 400 (the run would fail), so a
run that ends ``Succeeded`` was asked exactly the turns of its script. The model calls themselves
are counted from ``agentfast_model_replies`` (every reply the endpoint answered, kept or not).
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest
import yaml

from agentfast.runner.store import Store

from .helpers import agentrun_file, count_rows, run_cli, spawn_cli, wait_until

pytestmark = pytest.mark.process

STATEMENT = "I have cancelled the order."
#: The person replies once, then the agent speaks again (a statement that still waits).
TWO_STATEMENTS = [
    {"content": STATEMENT, "usage": {"prompt_tokens": 50, "completion_tokens": 8}},
    {"expect": "Thanks", "content": "You're welcome. Anything else?", "usage": {"prompt_tokens": 70, "completion_tokens": 8}},
]
#: The person replies once, then the agent says goodbye and calls end_conversation.
STATEMENT_THEN_END_TOOL = [
    TWO_STATEMENTS[0],
    {
        "expect": "Thanks",
        "content": "Goodbye!",
        "tool_calls": [{"id": "call_end", "name": "end_conversation", "arguments": {}}],
        "usage": {"prompt_tokens": 70, "completion_tokens": 8},
    },
]


def conversation(tmp_path: Path, adapter: str, turns: list[dict[str, object]], **spec: object) -> tuple[Path, str]:
    """An AgentRun file for the support conversation played by ``turns``; returns it and its name."""
    name = f"chat-{uuid.uuid4().hex[:8]}"
    script = tmp_path / f"{name}-script.yaml"
    script.write_text(yaml.safe_dump({"model": "scripted-chat", "turns": turns}))
    if adapter == "langgraph":
        spec = {**spec, "adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"}}
    path = agentrun_file(
        tmp_path,
        "support-conversation.yaml",
        uid=str(uuid.uuid4()),
        model={"name": "scripted-chat", "script": str(script)},
        **spec,
    )
    text = path.read_text().replace("name: support-chat", f"name: {name}")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path, name


def model_calls(dsn: str, name: str) -> int:
    """How many replies the model endpoint gave run ``name`` (kept by a turn or not)."""
    return count_rows(dsn, "SELECT count(*) FROM agentfast_model_replies WHERE run_id = %s", f"default/{name}")


def waiting_at(store: Store, name: str, call_id: str, timeout: float = 60) -> None:
    """Wait until run ``name`` is WaitingForInput on question ``call_id``."""

    def there() -> bool:
        loaded = store.load_context(f"default/{name}")
        if loaded is None:
            return False
        ctx, pending = loaded
        assert ctx.status.phase not in ("Succeeded", "Failed", "Cancelled"), ctx.status
        return ctx.status.phase == "WaitingForInput" and pending is not None and pending.call_ids == [call_id]

    wait_until(there, timeout=timeout, what=f"{name} to wait for the person at {call_id}")


def status(store: Store, name: str) -> tuple[str, str, str]:
    ctx, _ = store.load_context(f"default/{name}")
    return ctx.status.phase, ctx.status.reason, ctx.status.message


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_a_statement_waits_for_the_person_across_a_kill_and_the_person_ends_it(
    tmp_path: Path, dsn: str, store: Store, adapter: str
) -> None:
    path, name = conversation(tmp_path, adapter, TWO_STATEMENTS)
    proc = spawn_cli("run", str(path), dsn=dsn)
    waiting_at(store, name, "call-1-0")
    _, pending = store.load_context(f"default/{name}")
    [asked] = pending.awaiting
    assert asked.reason == "awaiting_input" and STATEMENT in asked.tool_call.arguments
    assert model_calls(dsn, name) == 1

    # SIGKILLed while it waits: the resumed runner waits at the same message, asking the model nothing.
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    got = run_cli("resume", name, "--force", "--no-wait", dsn=dsn)
    assert got.returncode == 0 and "WaitingForInput" in got.stdout, got.stdout
    waiting_at(store, name, "call-1-0")
    assert model_calls(dsn, name) == 1
    assert store.load_snapshot(f"default/{name}").context.counters.resumes == 1

    # A reply continues the conversation; the agent's next statement waits again.
    got = run_cli("reply", name, "Thanks!", dsn=dsn)
    assert got.returncode == 0, got.stdout
    proc = spawn_cli("resume", name, dsn=dsn)
    waiting_at(store, name, "call-2-0")
    assert model_calls(dsn, name) == 2

    # The person ends it from another terminal: the waiting runner ends the run, asking nothing more.
    got = run_cli("end", name, dsn=dsn)
    assert got.returncode == 0 and "call-2-0" in got.stdout, got.stdout
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert status(store, name) == ("Succeeded", "EndedByUser", "You're welcome. Anything else?")
    assert model_calls(dsn, name) == 2
    assert [(d["call_id"], d["decision"]) for d in store.decision_log(f"default/{name}")] == [
        ("call-1-0", "reply"),
        ("call-2-0", "end"),
    ]
    snap = store.load_snapshot(f"default/{name}")
    assert [m.content for m in snap.messages if m.role == "assistant"] == [STATEMENT, "You're welcome. Anything else?"]
    # Ended: nothing awaits the person any more.
    got = run_cli("end", name, dsn=dsn)
    assert got.returncode == 2 and "the run has ended (Succeeded, EndedByUser)" in got.stdout, got.stdout
    got = run_cli("reply", name, "hello?", dsn=dsn)
    assert got.returncode == 2 and "the run has ended" in got.stdout, got.stdout


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_the_model_ends_the_conversation_with_the_end_tool(tmp_path: Path, dsn: str, store: Store, adapter: str) -> None:
    path, name = conversation(tmp_path, adapter, STATEMENT_THEN_END_TOOL)
    got = run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert got.returncode == 0 and "WaitingForInput" in got.stdout, got.stdout
    assert run_cli("reply", name, "Thanks, bye.", dsn=dsn).returncode == 0
    got = run_cli("resume", name, "--no-wait", dsn=dsn)
    assert got.returncode == 0, got.stdout
    assert status(store, name) == ("Succeeded", "EndedByAgent", "Goodbye!")
    assert model_calls(dsn, name) == 2  # a third request would have been refused by the script (HTTP 400)
    snap = store.load_snapshot(f"default/{name}")
    assert [m.role for m in snap.messages[-2:]] == ["assistant", "tool"]
    assert snap.messages[-1].name == "end_conversation"
    assert snap.context.counters.iterations == 2


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_the_idle_timeout_ends_a_conversation_nobody_answers(tmp_path: Path, dsn: str, store: Store, adapter: str) -> None:
    # A runner that waits ends it when the timeout passes.
    path, name = conversation(tmp_path, adapter, TWO_STATEMENTS, conversationIdleTimeout=2)
    started = time.monotonic()
    got = run_cli("run", str(path), dsn=dsn, timeout=90)
    assert got.returncode == 0, got.stdout
    assert time.monotonic() - started >= 2
    assert status(store, name) == ("Succeeded", "IdleTimeout", STATEMENT)
    assert model_calls(dsn, name) == 1
    [entry] = store.journal(f"default/{name}", 1)
    assert entry.result is not None and entry.result.recorded_by == "ended:idle-timeout"
    assert store.decision_log(f"default/{name}") == []  # the runner records no decision
    assert run_cli("reply", name, "Thanks, too late?", dsn=dsn).returncode == 2

    # No runner while the person is away: the next one (resume, or the operator's pod) ends it at once.
    path, name = conversation(tmp_path, adapter, TWO_STATEMENTS, conversationIdleTimeout=2)
    got = run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert got.returncode == 0 and "WaitingForInput" in got.stdout, got.stdout
    time.sleep(2.5)
    got = run_cli("resume", name, "--no-wait", dsn=dsn)
    assert got.returncode == 0, got.stdout
    assert status(store, name) == ("Succeeded", "IdleTimeout", STATEMENT)
    assert model_calls(dsn, name) == 1


def test_a_reply_within_the_idle_timeout_keeps_the_conversation_going(tmp_path: Path, dsn: str, store: Store) -> None:
    """The timeout counts from the question now awaiting the person, not from the run's start."""
    path, name = conversation(tmp_path, "vanilla", TWO_STATEMENTS, conversationIdleTimeout=6)
    proc = spawn_cli("run", str(path), dsn=dsn)
    waiting_at(store, name, "call-1-0")
    first = time.monotonic()
    time.sleep(3)
    assert run_cli("reply", name, "Thanks!", dsn=dsn).returncode == 0
    waiting_at(store, name, "call-2-0")
    second = time.monotonic()
    time.sleep(max(0.0, first + 7 - time.monotonic()))  # past 6 s since the first wait, not since the second
    assert time.monotonic() - second < 6
    assert status(store, name)[0] == "WaitingForInput"
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert status(store, name) == ("Succeeded", "IdleTimeout", "You're welcome. Anything else?")
    assert model_calls(dsn, name) == 2


def test_ending_is_refused_while_no_question_awaits_the_person(tmp_path: Path, dsn: str, store: Store) -> None:
    """``agentfast end`` answers the person's turn: a run waiting for an approval is not ended by it."""
    path = agentrun_file(tmp_path, "refund.yaml", uid=str(uuid.uuid4()))
    got = run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert got.returncode == 0 and "WaitingForApproval" in got.stdout, got.stdout
    run = yaml.safe_load(path.read_text())["metadata"]["name"]
    got = run_cli("end", run, dsn=dsn)
    assert got.returncode == 2 and "asks the user nothing now" in got.stdout, got.stdout
    [awaited] = store.awaiting(f"default/{run}")
    got = run_cli("end", run, "--call", awaited.call_id, dsn=dsn)
    assert got.returncode == 2 and "not a question awaiting a reply" in got.stdout, got.stdout
    assert store.decision_log(f"default/{run}") == []


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_a_runner_killed_once_the_end_tool_ran_ends_the_run_on_resume_without_asking_the_model(
    tmp_path: Path, dsn: str, store: Store, adapter: str
) -> None:
    """The ending is read from the journal: SIGKILLed after ``end_conversation``'s result was
    persisted (before the iteration's checkpoint), the resumed runner ends the run as the first
    would have, and asks the model nothing (a third request would be refused by the script)."""
    path, name = conversation(tmp_path, adapter, STATEMENT_THEN_END_TOOL)
    got = run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert got.returncode == 0 and "WaitingForInput" in got.stdout, got.stdout
    assert run_cli("reply", name, "Thanks, bye.", dsn=dsn).returncode == 0
    got = run_cli("resume", name, "--no-wait", dsn=dsn, fault="tool.after_persist:end_conversation")
    assert got.returncode == -signal.SIGKILL, got.stdout
    assert status(store, name)[0] != "Succeeded"
    got = run_cli("resume", name, "--force", "--no-wait", dsn=dsn)
    assert got.returncode == 0, got.stdout
    assert status(store, name) == ("Succeeded", "EndedByAgent", "Goodbye!")
    assert model_calls(dsn, name) == 2
    [entry] = store.journal(f"default/{name}", 2)
    assert entry.tool_call.name == "end_conversation" and entry.attempts == 1  # it ran once
