"""Issue 30 item 4: inputs that loop instead of failing.

The attack: a model sends tool arguments nested ~1,000 deep (about 2 KB of output). Before,
``json.loads`` raised RecursionError in the tool host, which died at every attempt; the runner
exited 75 and was restarted for ever. Now every JSON or YAML the product parses from a model, a
tool, an MCP server or a person is bounded (``runner/boundedjson.py``, ``runner/safeyaml.py``):
the model is told, a person is refused with a clear message. And an iteration that crashes its
runner N times in a row (``AGENTFAST_MAX_ITERATION_CRASHES``) ends the run ``Failed`` with reason
``CrashLoop`` instead of looping (migration 18, ``Store.start_attempt``).

Real parts: the real CLI as OS processes (with its tool host), the scripted model over HTTP, a
real PostgreSQL with the real migrations; crashes are real SIGKILLs at a named fault point.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner import boundedjson
from agentfast.runner.decisions import InvalidDecision, check_decision
from agentfast.runner.names import ExitCode
from agentfast.runner.safeyaml import UnsafeYaml, load_all
from agentfast.runner.store import Store
from agentfast.runner.tools import ToolArgumentsError, parse_arguments_object

from .helpers import agentrun_file, count_rows, run_cli

DEEP = 1000


def deep_json(n: int = DEEP) -> str:
    return '{"order_id": ' + "[" * n + "]" * n + "}"


def deep_script(tmp_path: Path) -> Path:
    """A model that sends deeply nested arguments once, then answers."""
    path = tmp_path / "deep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": "scripted-deep",
                "turns": [
                    {
                        "tool_calls": [{"id": "call_1", "name": "lookup_order", "arguments_raw": deep_json()}],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 1000},
                    },
                    {"content": "Sorry, I could not look the order up.", "usage": {"prompt_tokens": 150, "completion_tokens": 9}},
                ],
            }
        )
    )
    return path


# -- the module's limits ------------------------------------------------------------------------------


def test_bounded_json_refuses_deep_and_large_text_with_a_clear_error() -> None:
    with pytest.raises(boundedjson.JsonLimitExceeded, match=r"tool arguments: JSON nested 1001 levels deep; the limit is 64"):
        boundedjson.loads(deep_json(), what="tool arguments")
    with pytest.raises(boundedjson.JsonLimitExceeded, match=r"the reply: 101 bytes of JSON; the limit is 100 bytes"):
        boundedjson.loads('"' + "x" * 99 + '"', what="the reply", max_bytes=100)
    with pytest.raises(boundedjson.JsonLimitExceeded, match="not convertible"):
        boundedjson.loads("1" * 5000, what="n")
    # Still a json.JSONDecodeError, so every except written around json.loads catches it.
    with pytest.raises(json.JSONDecodeError):
        boundedjson.loads("[" * 100_000, what="x")
    # Brackets inside strings do not count; 64 levels pass.
    assert boundedjson.loads('{"a": "' + "[" * 500 + '"}', what="x") == {"a": "[" * 500}
    assert boundedjson.depth("[" * 64 + "]" * 64) == 64
    assert boundedjson.loads("[" * 64 + "]" * 64, what="x") is not None
    with pytest.raises(boundedjson.JsonLimitExceeded, match="a value nested deeper than 64"):
        value: list = []
        for _ in range(5000):
            value = [value]
        boundedjson.dumps(value, what="the tool's result")


def test_deep_tool_arguments_are_a_tool_arguments_error() -> None:
    with pytest.raises(ToolArgumentsError, match="arguments refused: tool arguments: JSON nested 1001 levels deep"):
        parse_arguments_object(deep_json())


def test_a_person_complete_result_too_deep_is_refused_with_a_clear_message() -> None:
    with pytest.raises(InvalidDecision, match="the result: JSON nested 1001 levels deep; the limit is 64"):
        check_decision("complete", None, deep_json())


def test_deep_yaml_is_refused_before_it_is_composed() -> None:
    with pytest.raises(UnsafeYaml, match=r"f.yaml: YAML nested deeper than 64 levels \(line 1\)"):
        load_all("spec: " + "[" * 5000 + "]" * 5000, "f.yaml")
    nested = "a:\n" + "".join("  " * i + "k:\n" for i in range(1, 100)) + "  " * 100 + "v: 1\n"
    with pytest.raises(UnsafeYaml, match="nested deeper than 64"):
        load_all(nested, "g.yaml")
    with pytest.raises(UnsafeYaml, match="bytes of YAML; the limit is 100 bytes"):
        load_all("a: " + "x" * 200, "h.yaml", max_bytes=100)


# -- the attack, on real processes ---------------------------------------------------------------------


@pytest.mark.process
def test_deeply_nested_arguments_go_to_the_model_and_the_run_finishes(tmp_path: Path, dsn: str, store: Store) -> None:
    path = agentrun_file(tmp_path, uid=str(uuid.uuid4()))
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["model"] = {"name": "scripted-deep", "script": str(deep_script(tmp_path))}
    path.write_text(yaml.safe_dump(doc))
    done = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=120)
    # The tool host survived: no exit 75, no restart; the run went on to the model's answer.
    assert done.returncode == ExitCode.OK, done.stdout
    assert "Traceback" not in done.stdout
    snap = store.load_snapshot("default/refund-demo")
    assert snap is not None
    c = snap.context
    assert (c.status.phase, c.counters.iterations, c.counters.resumes) == ("Succeeded", 2, 0)
    assert c.counters.malformed_tool_calls == 1
    # The model was told why, as the call's result; the call never ran.
    [told] = [m for m in snap.messages if m.role == "tool"]
    assert "arguments refused" in (told.content or "") and "nested 1001 levels deep; the limit is 64" in (told.content or "")
    [entry] = store.journal("default/refund-demo", 1)
    assert entry.attempts == 0 and entry.result is not None and entry.result.error_kind == "malformed"


@pytest.mark.process
def test_a_deep_agentrun_file_is_refused_with_a_clear_message(tmp_path: Path, dsn: str) -> None:
    path = tmp_path / "deep.yaml"
    text = agentrun_file(tmp_path).read_text() + "  extra: " + "[" * 3000 + "]" * 3000 + "\n"
    path.write_text(text)
    refused = run_cli("run", str(path), dsn=dsn)
    assert refused.returncode == ExitCode.BAD_INPUT, refused.stdout
    assert "nested deeper than 64 levels" in refused.stdout and "Traceback" not in refused.stdout


@pytest.mark.process
def test_a_complete_with_a_deep_result_is_refused_by_the_cli(tmp_path: Path, dsn: str, store: Store) -> None:
    path = agentrun_file(tmp_path, uid=str(uuid.uuid4()))
    assert run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=120).returncode == 0
    call = store.load_context("default/refund-demo")[1].call_id
    refused = run_cli("complete", "refund-demo", call, "--result", deep_json(), dsn=dsn)
    assert refused.returncode == ExitCode.BAD_INPUT, refused.stdout
    assert "nested 1001 levels deep; the limit is 64" in refused.stdout
    assert store.get_decision("default/refund-demo", call) is None


# -- crash loops ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_an_iteration_that_kills_its_runner_every_time_ends_failed_crashloop(tmp_path: Path, dsn: str, store: Store) -> None:
    """SIGKILL at the same step of iteration 1 in every runner: after the limit (here 3) the next
    runner ends the run Failed/CrashLoop at once, naming the iteration and the count."""
    path = agentrun_file(tmp_path, uid=str(uuid.uuid4()))
    env = {"AGENTFAST_MAX_ITERATION_CRASHES": "3"}
    first = run_cli("run", str(path), dsn=dsn, fault="tool.before_call:lookup_order", env=env, timeout=120)
    assert first.returncode == -9, first.stdout
    codes = []
    for _ in range(3):
        again = run_cli("resume", "refund-demo", dsn=dsn, fault="tool.before_call:lookup_order", env=env, timeout=120)
        codes.append(again.returncode)
        if again.returncode != -9:
            break
    assert codes == [-9, -9, ExitCode.FAILED], codes
    assert "CrashLoop" in again.stdout or "crashed its runner" in again.stdout, again.stdout
    ctx = store.load_snapshot("default/refund-demo").context
    assert (ctx.status.phase, ctx.status.reason) == ("Failed", "CrashLoop")
    assert "iteration 1 crashed its runner 3 times in a row" in ctx.status.message
    assert store.attempts("default/refund-demo") == (1, 3, False)
    # Ended for good: a further resume does not try the iteration again.
    final = run_cli("resume", "refund-demo", dsn=dsn, env=env, timeout=60)
    assert (
        final.returncode == ExitCode.FAILED
        and count_rows(dsn, "SELECT count(*) FROM agentfast_tool_calls WHERE run_id = %s AND attempts > 3", "default/refund-demo")
        == 0
    )


def test_graceful_ends_do_not_count_and_a_new_iteration_starts_from_zero(store: Store, dsn: str) -> None:
    """The store's count (migration 18): a start after an attempt that never ended counts it as
    a crash of the iteration started now; an attempt that ended (end_attempt) does not count."""
    run_id = f"default/attempts-{uuid.uuid4().hex[:8]}"
    store.create_run(run_id, str(uuid.uuid4()), {"spec": {}})
    lease = store.acquire_lease(run_id)
    assert store.start_attempt(lease, 1) == 0
    assert store.start_attempt(lease, 1) == 1  # the one before never ended: a crash
    store.end_attempt(lease, 1)
    assert store.start_attempt(lease, 1) == 1  # a graceful end is no crash, and keeps the count
    assert store.start_attempt(lease, 3) == 1  # it died after committing 2: a crash of 3
    store.end_attempt(lease, 4)  # it went on and stopped gracefully at 4
    assert store.start_attempt(lease, 4) == 0
    assert store.attempts(run_id) == (4, 0, True)
    # Fenced like every runner write: a lease taken over cannot count or clear.
    newer = store.acquire_lease(run_id)
    with pytest.raises(Exception, match="lease lost|stale"):
        store.start_attempt(lease, 4)
    assert store.start_attempt(newer, 4) == 1
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT epoch FROM agentfast_attempts WHERE run_id = %s", (run_id,)).fetchone()[0] == newer.epoch


def test_a_model_reply_nested_too_deep_is_a_model_error_not_a_crash() -> None:
    """The model endpoint's reply is checked (a response hook) before the SDK parses it: over the
    depth limit it is a ModelError that is not retriable (the run ends Failed/ModelError), never
    a RecursionError that would kill the runner at every attempt."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agentfast.runner.model import ModelError, OpenAIChatModel
    from agentfast.runner.snapshot import Message

    body = (
        '{"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": ' + "[" * 5000 + "]" * 5000 + "}"
    ).encode()

    class Deep(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Deep)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        model = OpenAIChatModel(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="k", model="m", max_retries=0)
        with pytest.raises(ModelError) as caught:
            model.complete([Message(role="user", content="hi")], [])
        assert not caught.value.retriable
        assert "the model endpoint's reply: JSON nested 5001 levels deep; the limit is 64" in str(caught.value)
        model.close()
    finally:
        server.shutdown()
