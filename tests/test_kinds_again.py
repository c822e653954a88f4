"""Issue 11, each kind of fault tried again with new inputs (docs/reliability.md, "Issue 11: kinds
tried again with new inputs"). Every input here misbehaved once; each test drives the real CLI as
a process against the real Postgres (the ``dsn`` fixture) and the scripted model over HTTP.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from .test_text_is_data import cli, ok

CASE = Path(__file__).resolve().parent / "cases" / "breaker"
TOOLS = ("echo", "boom", "gated", "send", "slow", "badexc", "gated_bad")


def make_case(
    tmp_path: Path, name: str, turns: list[dict], *, adapter: str = "vanilla", strict: bool = False, **spec: object
) -> Path:
    """A case folder in tmp_path: AgentRun ``name`` with every tool of breaker_tools.py and a script of ``turns``."""
    d = tmp_path / name
    d.mkdir()
    (d / "breaker_tools.py").write_bytes((CASE / "breaker_tools.py").read_bytes())
    script = {"model": f"{name}-scripted", **({"strict": True} if strict else {}), "turns": turns}
    (d / "script.yaml").write_text(yaml.safe_dump(script, sort_keys=False))
    doc = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": f"{name}-scripted", "script": "script.yaml"},
            "systemPrompt": "You help.",
            "input": "hello",
            "tools": [{"name": t, "ref": f"breaker_tools:{t}"} for t in TOOLS],
            "budget": {"max_iterations": 8, "max_tokens": 50000, "max_duration_ms": 120000, "classifier": "none"},
            **(
                {"adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"}}
                if adapter == "langgraph"
                else {}
            ),
            **spec,
        },
    }
    (d / "agentrun.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return d


# -- kind 02: every part of a message in every transcript view ------------------------------------------------


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
@pytest.mark.parametrize("content", ["", "Here is what I can do."])
def test_a_final_answer_with_a_refusal_shows_the_refusal_in_the_outcome_and_status(
    tmp_path: Path, dsn: str, adapter: str, content: str
) -> None:
    refusal = "I will not disclose the password."
    d = make_case(tmp_path, "refuses", [{"content": content, "refusal": refusal}], adapter=adapter)
    run = ok(cli(d, "run", "agentrun.yaml", dsn=dsn)).stdout
    assert refusal in run.splitlines()[-1] or refusal in run.split("Succeeded:", 1)[1], run
    doc = json.loads(ok(cli(d, "status", "refuses", "-o", "json", dsn=dsn)).stdout)
    message = doc["context"]["status"]["message"]
    assert refusal in message and content in message, message
    assert refusal in ok(cli(d, "status", "refuses", dsn=dsn)).stdout


def effects(d: Path) -> list[str]:
    """The "ran TOOL CALL_ID KEY" lines breaker_tools.py wrote, in order."""
    log = d / "effects.log"
    return log.read_text().splitlines() if log.exists() else []


# -- kind 03: unstorable characters, in places of the LangGraph adapter ---------------------------------------


def test_json_escapes_of_unstorable_characters_in_arguments_do_not_stop_a_langgraph_run(tmp_path: Path, dsn: str) -> None:
    # The arguments are valid JSON text, but they decode to a NUL and lone surrogates, which
    # LangGraph's checkpointer (msgpack) cannot serialize: the run crashed with a traceback, for good.
    d = make_case(
        tmp_path,
        "lgsurrogates",
        [
            {
                "tool_calls": [
                    {"id": "a1", "name": "echo", "arguments": {"text": "v\ud800al\0"}},
                    {"id": "a0", "name": "echo", "arguments": {"text": "t", "k\udfff\0": "x"}},  # a key: msgpack refuses it
                    {"id": "a2", "name": "gated", "arguments": {"what": "\udfff"}},
                    {"id": "a3", "name": "echo", "arguments_raw": '{"text": "\\ud83d\\u0000"}'},
                ]
            },
            {"content": "done"},
        ],
        adapter="langgraph",
    )
    ok(cli(d, "run", "agentrun.yaml", "--no-wait", dsn=dsn))
    ok(cli(d, "approve", "lgsurrogates", "call-1-2", dsn=dsn))
    assert "Succeeded: done" in ok(cli(d, "resume", "lgsurrogates", dsn=dsn)).stdout
    assert sorted(line.split()[1] for line in effects(d)) == [
        "echo",
        "echo",
        "gated",
    ]  # the one with the bad key is refused by validation


# -- kind 04: a display failure never stops a run: the waiting prompt on a terminal -----------------------


def _read_until(fd: int, needle: bytes, seconds: float) -> bytes:
    import select
    import time

    buf, deadline = b"", time.monotonic() + seconds
    while needle not in buf and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                buf += os.read(fd, 4096)
            except OSError:
                break
    return buf


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_the_prompt_shows_its_question_and_a_terminal_that_goes_away_does_not_end_the_run(
    tmp_path: Path, dsn: str, adapter: str
) -> None:
    import pty
    import sys
    import time

    from .test_text_is_data import env_for

    d = make_case(
        tmp_path,
        "hangup",
        [
            {
                "tool_calls": [
                    {"id": "w1", "name": "gated", "arguments": {"what": "x"}},
                    {"id": "w2", "name": "echo", "arguments": {"text": "y"}},
                ]
            },
            {"content": "done"},
        ],
        adapter=adapter,
    )
    env = env_for(d, dsn)
    pid, fd = pty.fork()
    if pid == 0:  # the child: agentfast run on a terminal (stdin and stdout a tty: the prompt is asked)
        os.chdir(d)
        os.execve(sys.executable, [sys.executable, "-m", "agentfast.runner", "run", "agentrun.yaml"], env)
    try:
        seen = _read_until(fd, b"[w]: ", 60)
        # The question was written as bytes into a text stream and dropped: the user saw a blank line.
        assert b"Approve call-1-0 (gated) now?" in seen, seen[-400:]
        os.close(fd)  # the terminal goes away while the prompt waits (SIGHUP, then end of input)
        fd = -1
        status = ok(cli(d, "status", "hangup", "-o", "json", dsn=dsn))
        assert json.loads(status.stdout)["runner"]["alive"] is True, status.stdout  # it died on SIGHUP
        ok(cli(d, "approve", "hangup", "call-1-0", dsn=dsn))
        deadline = time.monotonic() + 60
        while True:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert done, "the runner did not finish after the approval"
        assert os.waitstatus_to_exitcode(code) == 0
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    doc = json.loads(ok(cli(d, "status", "hangup", "-o", "json", dsn=dsn)).stdout)
    assert doc["context"]["status"]["phase"] == "Succeeded"
    assert sorted(line.split()[1] for line in effects(d)) == ["echo", "gated"]


# -- kinds 05 and 08: a denial's words, for a call that may have run ---------------------------------------------


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_denying_the_rerun_of_an_interrupted_call_never_says_it_was_not_run(tmp_path: Path, dsn: str, adapter: str) -> None:
    d = make_case(
        tmp_path,
        "rerun",
        [
            {
                "tool_calls": [
                    {"id": "r1", "name": "echo", "arguments": {"text": "a"}},
                    {"id": "r2", "name": "send", "arguments": {"to": "bob"}},
                    {"id": "r3", "name": "gated", "arguments": {"what": "g"}},
                ]
            },
            {"content": "done"},
        ],
        adapter=adapter,
    )
    killed = cli(d, "run", "agentrun.yaml", "--no-wait", dsn=dsn, AGENTFAST_FAULT="tool.after_call:send")
    assert killed.returncode == -9, killed.returncode
    assert "call-1-1-rerun1" in ok(cli(d, "resume", "rerun", "--no-wait", dsn=dsn)).stdout
    ok(cli(d, "deny", "rerun", "call-1-1-rerun1", "--reason", "customer said no", dsn=dsn))
    ok(cli(d, "deny", "rerun", "call-1-2", "--reason", "not now", dsn=dsn))
    out = ok(cli(d, "resume", "rerun", dsn=dsn)).stdout
    assert [e.split()[1:3] for e in effects(d)].count(["send", "call-1-1"]) == 1  # it ran once: before the kill
    rerun_line = next(line for line in out.splitlines() if "call-1-1" in line)
    assert "not run:" not in rerun_line and "may have taken effect" in rerun_line and "call-1-1-rerun1" in rerun_line, rerun_line
    assert "denied, not run: call-1-2 gated: not now" in out, out


# -- kind 10: state this release cannot read: every reader refuses it, a decision too --------------------------


def _corrupt_latest_checkpoint(dsn: str, run: str, assignment: str) -> None:
    """UPDATE the run's latest checkpoint (the fence trigger needs the run's epoch and uid in agentfast.epoch, agentfast.run_uid)."""
    import psycopg

    with psycopg.connect(dsn) as conn, conn.transaction():
        conn.execute(
            "SELECT set_config('agentfast.epoch', epoch::text, true), set_config('agentfast.run_uid', run_uid, true)"
            " FROM agentfast_runs WHERE run_id = %s",
            (run,),
        )
        n = conn.execute(
            f"""UPDATE agentfast_checkpoints SET {assignment} WHERE run_id = %s AND checkpoint_id =
                             (SELECT max(checkpoint_id) FROM agentfast_checkpoints WHERE run_id = %s)""",
            (run, run),
        ).rowcount
    assert n == 1


@pytest.mark.parametrize(
    "assignment",
    [
        "pending = '[1, 2]'",  # approve crashed with a traceback (exit 1)
        "phase = 'Exploded', context = jsonb_set(context, '{status,phase}', '\"Exploded\"')",  # approve accepted; list showed it
        "schema_version = 3",
        "context = '\"truncated\"'",
    ],
)
def test_no_reader_and_no_decision_acts_on_a_checkpoint_it_cannot_read(tmp_path: Path, dsn: str, assignment: str) -> None:
    d = make_case(
        tmp_path, "unreadable", [{"tool_calls": [{"id": "u1", "name": "gated", "arguments": {"what": "x"}}]}, {"content": "done"}]
    )
    ok(cli(d, "run", "agentrun.yaml", "--no-wait", dsn=dsn))
    _corrupt_latest_checkpoint(dsn, "default/unreadable", assignment)
    commands = [["approve", "unreadable", "call-1-0"], ["status", "unreadable"], ["resume", "unreadable", "--no-wait"]]
    if "Exploded" in assignment or "schema_version" in assignment:
        commands.append(["list"])  # list reads the summary columns: the phase and the version
    for args in commands:
        p = cli(d, *args, dsn=dsn)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (args, p.returncode, p.stderr[-600:])
        assert "cannot read run default/unreadable" in p.stderr, (args, p.stderr)
    assert effects(d) == []
