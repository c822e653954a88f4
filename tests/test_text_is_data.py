"""Text is data: what models, tools and users write is printed literally and stored safely, and
output is best effort (issue 11, items 1-3 and 9; regression cases 01-04 in tests/cases/).

The CLI runs as a real process against the real Postgres (the ``dsn`` fixture), with the case's
own AgentRun, script and tools; the scripted model is served over real HTTP by the runner.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner import output
from agentfast.runner.adapters.vanilla import VanillaRunner
from agentfast.runner.loop import run_id_of
from agentfast.runner.model import MAX_TOOL_CALL_ID, distinct_tool_call_ids, model_from_spec
from agentfast.runner.snapshot import Message, ToolCall
from agentfast.runner.spec import load_agentrun
from agentfast.runner.storable import storable, storable_text
from agentfast.runner.store import Store
from agentfast.runner.tools import ToolRegistry
from agentfast.testing.scripted import strict_violation

CASES = Path(__file__).resolve().parent / "cases"
R = "\ufffd"


# -- helpers -----------------------------------------------------------------------------------


def case_copy(tmp_path: Path, case: str, *, spec: dict | None = None, script: dict | None = None) -> Path:
    """A copy of tests/cases/<case> in tmp_path, with spec / script fields overridden."""
    src = CASES / case
    dst = tmp_path / case
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if spec:
        doc = yaml.safe_load((dst / "agentrun.yaml").read_text())
        doc["spec"].update(spec)
        (dst / "agentrun.yaml").write_text(yaml.safe_dump(doc, allow_unicode=False, sort_keys=False))
    if script:
        doc = yaml.safe_load((dst / "script.yaml").read_text())
        doc.update(script)
        (dst / "script.yaml").write_text(yaml.safe_dump(doc, allow_unicode=False, sort_keys=False))
    return dst


def env_for(case_dir: Path, dsn: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTFAST_FAULT", "FORCE_COLOR")}
    env.update(
        AGENTFAST_DSN=dsn,
        NO_COLOR="1",
        COLUMNS="200",
        CASE_EFFECTS=str(case_dir / "effects.log"),
        PYTHONPATH=os.pathsep.join([str(case_dir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.update(extra)
    return env


def cli(case_dir: Path, *args: str, dsn: str, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
    """``agentfast ARGS`` in the case folder; stdout and stderr kept apart."""
    return subprocess.run(
        [sys.executable, "-m", "agentfast.runner", *args],
        cwd=case_dir,
        env=env_for(case_dir, dsn, **extra),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        timeout=timeout,
    )


def executions(case_dir: Path) -> int:
    log = case_dir / "effects.log"
    return sum(1 for line in log.read_text().splitlines() if line.startswith("ran ")) if log.exists() else 0


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p


# -- case 01: markup-looking text is printed verbatim ---------------------------------------------------

ARGS_01 = '{"ticket_id": "T-5521", "export_path": "[/tmp]/t-5521-transcript.txt"}'


def markup_case(tmp_path: Path, dsn: str, case_dir: Path, run: str, args: str, texts: list[str]) -> None:
    waiting = ok(cli(case_dir, "run", "agentrun.yaml", "--no-wait", dsn=dsn))
    line = next(x for x in waiting.stdout.splitlines() if "call-1-0" in x and "waiting" in x)
    assert args in line, line
    ok(cli(case_dir, "approve", run, "call-1-0", dsn=dsn))
    ok(cli(case_dir, "resume", run, dsn=dsn))
    assert executions(case_dir) == 1
    history = ok(cli(case_dir, "history", run, dsn=dsn)).stdout
    for t in [*texts, args]:
        assert t in history, f"{t!r} not in:\n{history}"
    status = ok(cli(case_dir, "status", run, dsn=dsn)).stdout
    assert "Succeeded" in status
    ok(cli(case_dir, "list", dsn=dsn))


@pytest.mark.process
def test_case01_markup_in_text_is_printed_verbatim(tmp_path: Path, dsn: str) -> None:
    case_dir = case_copy(tmp_path, "c01")
    markup_case(
        tmp_path,
        dsn,
        case_dir,
        "case01-markup",
        ARGS_01,
        ["[bold]hi[/bold] and [/INST]", "Your ticket is closed [/b] ref [provide booking code]."],
    )


@pytest.mark.process
def test_other_bracket_forms_emoji_codes_and_control_characters(tmp_path: Path, dsn: str) -> None:
    user = "see [link=https://evil.example/x]here[/link], [@click=app.quit]x[/], [on red]y[/on red] :warning:"
    answer = "Done [/] [/link] [@click] :thumbs_up: [b]ok[/b] \\[escaped] [[double]]"
    path = "[link=file:///etc]/[@click]/[/]:smile:"
    case_dir = case_copy(
        tmp_path,
        "c01",
        spec={"input": user + " \x1b[2J\x1b]0;title\x07"},
        script={
            "turns": [
                {
                    "tool_calls": [
                        {"id": "tc_a1", "name": "archive_ticket", "arguments": {"ticket_id": "T-1", "export_path": path}}
                    ]
                },
                {"content": answer},
            ]
        },
    )
    args = json.dumps({"ticket_id": "T-1", "export_path": path})
    markup_case(tmp_path, dsn, case_dir, "case01-markup", args, [user, answer])
    history = ok(cli(case_dir, "history", "case01-markup", dsn=dsn)).stdout
    assert "\x1b" not in history and "\x07" not in history  # never a live escape sequence on the terminal
    assert "\\x1b[2J\\x1b]0;title\\x07" in history  # shown, as text


def test_the_consoles_render_every_str_as_data() -> None:
    buf = io.StringIO()
    con = output._DataConsole(file=buf, width=200, soft_wrap=True, color_system=None)
    from rich.table import Table

    t = Table("[bold]head[/bold]", title="[red]title[/red]")
    t.add_row("[link=x]cell[/link] :smile:")
    con.print("[/b] [provide booking code] :smile:", markup=True)  # even when asked for markup
    con.print(t)
    con.rule("[/INST]")
    con.print(output.styled(("a [b]c[/b]", "bold"), " \x1b[31m\udcff\x00"))
    text = buf.getvalue()
    for s in (
        "[/b] [provide booking code] :smile:",
        "[bold]head[/bold]",
        "[red]title[/red]",
        "[link=x]cell[/link] :smile:",
        "[/INST]",
        "a [b]c[/b]",
        f"\\x1b[31m{R}{R}",
    ):
        assert s in text, (s, text)


def test_json_output_is_parseable_and_escapes_c1_controls() -> None:
    text = output.json_text({"a": "x\x9b2J\x7f é \udcff\x00"})
    assert "\x9b" not in text and "\x7f" not in text
    assert json.loads(text) == {"a": f"x\x9b2J\x7f é {R}{R}"}


# -- case 02: every part of every message ------------------------------------------------------------


@pytest.mark.process
def test_case02_history_shows_text_said_with_tool_calls(tmp_path: Path, dsn: str) -> None:
    case_dir = case_copy(tmp_path, "c02")
    ok(cli(case_dir, "run", "agentrun.yaml", dsn=dsn))
    history = ok(cli(case_dir, "history", "case02-text-with-calls", dsn=dsn)).stdout
    assert "Let me check that order first." in history
    assert 'get_order_status({"order_id": "Q-7730"})' in history


@pytest.mark.process
def test_history_shows_several_calls_a_refusal_full_keys_and_json(tmp_path: Path, dsn: str) -> None:
    case_dir = case_copy(
        tmp_path,
        "c02",
        script={
            "turns": [
                {
                    "content": "Two lookups.",
                    "tool_calls": [
                        {"id": "x1", "name": "get_order_status", "arguments": {"order_id": "Q-7730"}},
                        {"id": "x2", "name": "get_order_status", "arguments": {"order_id": "Q-9999"}},
                    ],
                },
                {"refusal": "I can't share the other order.", "content": "Q-7730 is in transit."},
            ]
        },
    )
    ok(cli(case_dir, "run", "agentrun.yaml", dsn=dsn))
    history = ok(cli(case_dir, "history", "case02-text-with-calls", dsn=dsn, COLUMNS="60")).stdout
    for s in (
        "Two lookups.",
        '{"order_id": "Q-7730"}',
        '{"order_id": "Q-9999"}',
        "call-1-0",
        "call-1-1",
        "Q-7730 is in transit.",
        "refusal: I can't share the other order.",
    ):
        assert s in history, (s, history)
    doc = json.loads(ok(cli(case_dir, "history", "case02-text-with-calls", "-o", "json", dsn=dsn)).stdout)
    assert set(doc) >= {"run", "status", "transcript", "journal", "decisions", "checkpoints"}
    assert doc["transcript"][2]["content"] == "Two lookups." and len(doc["transcript"][2]["tool_calls"]) == 2
    assert doc["transcript"][-1]["refusal"] == "I can't share the other order."
    keys = [e["idempotency_key"] for e in doc["journal"]]
    assert len(keys) == 2 and all(k in history for k in keys)  # full keys, even on a narrow terminal
    assert doc["checkpoints"][-1]["saved_at"].endswith("Z")
    listing = ok(cli(case_dir, "list", dsn=dsn)).stdout
    assert re.search(r"\s\d+[smhd]\s", listing) and "case02-text-with-calls" in listing, listing  # readable ages, not ms


# -- case 03: NUL and lone surrogates ----------------------------------------------------------------------


@pytest.mark.process
def test_case03_unstorable_characters_are_replaced_and_the_tool_runs_once(tmp_path: Path, dsn: str) -> None:
    case_dir = case_copy(tmp_path, "c03")
    ok(cli(case_dir, "run", "agentrun.yaml", dsn=dsn))
    ok(cli(case_dir, "resume", "case03-unstorable", dsn=dsn))
    assert executions(case_dir) == 1
    assert "Succeeded" in ok(cli(case_dir, "status", "case03-unstorable", dsn=dsn)).stdout
    history = ok(cli(case_dir, "history", "case03-unstorable", dsn=dsn)).stdout
    assert f"note N-208: caf{R} au lait, shelf 3" in history
    assert f"Reference RX-31{R} confirmed {R} see you soon." in history


@pytest.mark.process
def test_unstorable_characters_in_input_arguments_names_and_ids(tmp_path: Path, dsn: str) -> None:
    case_dir = case_copy(
        tmp_path,
        "c03",
        spec={"input": "What does note \udcff N-\x00208 say? \ud83d\ude00", "systemPrompt": "sys \ud800"},
        script={
            "turns": [
                {
                    "content": "Reading \x00",
                    "tool_calls": [
                        {"id": "t\udcff", "name": "read_archived_note", "arguments_raw": '{"note_id": "N-\\u0000\\udcff"}'},
                        {"id": "t\udcff", "name": "read_\ud800note", "arguments": {"note_id": "x"}},
                    ],
                },
                {"content": "It says caf\udcff."},
            ]
        },
    )
    ok(cli(case_dir, "run", "agentrun.yaml", dsn=dsn))
    assert executions(case_dir) == 1  # the unknown (surrogate) name was answered as an error, not run
    history = ok(cli(case_dir, "history", "case03-unstorable", dsn=dsn)).stdout
    assert f"What does note {R} N-{R}208 say? \U0001f600" in history  # a surrogate pair is joined
    assert f"note N-{R}{R}: caf{R} au lait" in history  # the tool got U+FFFD, not NUL or a surrogate
    assert f"unknown tool 'read_{R}note'" in history
    assert f"It says caf{R}." in history
    doc = json.loads(ok(cli(case_dir, "history", "case03-unstorable", "-o", "json", dsn=dsn)).stdout)
    ids = [c["id"] for c in doc["transcript"][2]["tool_calls"]]
    assert ids[0] == f"t{R}" and ids[1] != ids[0]  # made storable, then unique


def test_a_result_that_cannot_be_stored_ends_the_call_done_and_is_never_rerun(tmp_path: Path, store: Store, dsn: str) -> None:
    """Whatever makes a result unwritable, the call that ran must not stay 'started'."""

    class RefusesBigResults(Store):
        def record_result(self, lease, iteration, position, result):  # noqa: ANN001
            if "au lait" in result.content:  # as Postgres refuses a value past its size limits
                raise psycopg.errors.ProgramLimitExceeded("total size of jsonb object elements exceeds the maximum")
            return super().record_result(lease, iteration, position, result)

    case_dir = case_copy(tmp_path, "c03")
    os.environ["CASE_EFFECTS"] = str(case_dir / "effects.log")
    sys.path.insert(0, str(case_dir))
    try:
        run = load_agentrun(case_dir / "agentrun.yaml")
        run.spec.model.script = str(case_dir / "script.yaml")
        store.create_run(run_id_of(run), "uid-1", run.model_dump(mode="json", exclude_none=True))
        refusing = RefusesBigResults(dsn, retry_for_s=5)
        for s in (refusing, store):  # the first process cannot store the result; a resume must not re-run the tool
            model = model_from_spec(run.spec.model)
            try:
                outcome = VanillaRunner(s, run, model, ToolRegistry.from_agentrun(run), wait_for_approval=False).run()
            finally:
                model.close()
            assert outcome.phase == "Succeeded", outcome
        refusing.close()
    finally:
        sys.path.remove(str(case_dir))
        os.environ.pop("CASE_EFFECTS", None)
    assert executions(case_dir) == 1
    [entry] = store.journal(run_id_of(run))
    assert entry.state == "done" and entry.result.is_error
    assert "ran (its effect, if any, happened), but its result could not be stored" in entry.result.content


def test_storable_text() -> None:
    assert storable_text("plain") == "plain"
    assert storable_text("a\x00b") == f"a{R}b"
    assert storable_text("\udcff") == R and storable_text("\ud83d") == R and storable_text("x\udfff\ud800y") == f"x{R}{R}y"
    assert storable_text("\ud83d\ude00") == "\U0001f600"  # a pair that arrived as two code points
    doc = {"k\x00": ["v\udcff", ("t\x00",), 3, None], "ok": "fine"}
    assert storable(doc) == {f"k{R}": [f"v{R}", (f"t{R}",), 3, None], "ok": "fine"}
    clean = {"a": ["b", {"c": "d"}]}
    assert storable(clean) is clean  # nothing to replace: no copy


def test_the_store_writes_unstorable_text_from_any_caller(store: Store) -> None:
    store.create_run("default/x", "uid", {"spec": {"input": "a\x00\udcff"}})
    # Any SQL through the store's connections, not only the methods that exist today.
    store._retry(
        lambda c: c.execute(
            "INSERT INTO agentfast_approvals (run_id, call_id, decision, reason, decided_by) VALUES (%s, %s, 'deny', %s, %s)",
            ("default/x", "c\x00", "no \udcff\x00", "cli:\ud800"),
        )
    )
    d = store.get_decision("default/x", f"c{R}")
    assert d is not None and (d.call_id, d.reason, d.decided_by) == (f"c{R}", f"no {R}{R}", f"cli:{R}")
    assert store.get_run("default/x").spec == {"spec": {"input": f"a{R}{R}"}}


# -- case 04: output is best effort ---------------------------------------------------------------------------


@pytest.mark.process
def test_case04_closed_stdout_does_not_stop_the_run(tmp_path: Path, dsn: str) -> None:
    case_dir = case_copy(tmp_path, "c04")
    with open(tmp_path / "err.txt", "w") as errf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentfast.runner", "run", "agentrun.yaml"],
            cwd=case_dir,
            env=env_for(case_dir, dsn),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errf,
        )
        proc.stdout.readline()  # `| head -1`
        proc.stdout.close()
        assert proc.wait(timeout=60) == 0, (tmp_path / "err.txt").read_text()
    assert "Succeeded" in ok(cli(case_dir, "status", "case04-closed-stdout", dsn=dsn)).stdout
    assert executions(case_dir) == 2


@pytest.mark.process
@pytest.mark.parametrize("redirect", ["1>&- 2>&-", ">/dev/full 2>/dev/full", "2>&- | head -c 1 >/dev/null"])
def test_closed_or_full_streams_never_change_the_exit_code(tmp_path: Path, dsn: str, redirect: str) -> None:
    case_dir = case_copy(tmp_path, "c04")
    cmd = f'"{sys.executable}" -m agentfast.runner run agentrun.yaml {redirect}; echo "rc=${{PIPESTATUS[0]}}" >rc.txt'
    subprocess.run(["bash", "-c", cmd], cwd=case_dir, env=env_for(case_dir, dsn), stdin=subprocess.DEVNULL, timeout=60)
    assert (case_dir / "rc.txt").read_text().strip() == "rc=0"
    assert executions(case_dir) == 2
    # and a refused command keeps its own exit code (2), not 1, with nowhere to say why
    cmd = f'"{sys.executable}" -m agentfast.runner history no-such-run {redirect}; echo "rc=${{PIPESTATUS[0]}}" >rc.txt'
    subprocess.run(["bash", "-c", cmd], cwd=case_dir, env=env_for(case_dir, dsn), stdin=subprocess.DEVNULL, timeout=60)
    assert (case_dir / "rc.txt").read_text().strip() == "rc=2"


@pytest.mark.process
def test_a_terminal_that_cannot_encode_the_text(tmp_path: Path, dsn: str) -> None:
    case_dir = case_copy(tmp_path, "c03")
    ascii_env = {"PYTHONIOENCODING": "ascii", "LANG": "C", "LC_ALL": "C"}
    ok(cli(case_dir, "run", "agentrun.yaml", dsn=dsn, **ascii_env))
    history = ok(cli(case_dir, "history", "case03-unstorable", dsn=dsn, **ascii_env)).stdout
    assert "note N-208: caf\\ufffd au lait" in history
    assert "Succeeded" in ok(cli(case_dir, "status", "case03-unstorable", dsn=dsn, **ascii_env)).stdout


def test_best_effort_stream_never_raises() -> None:
    r, w = os.pipe()
    os.close(r)
    target = os.fdopen(w, "w")
    stream = output.BestEffortStream(target)
    stream.write("x" * 100_000)
    stream.flush()  # EPIPE: swallowed, the fd now points at /dev/null
    assert stream.broken
    stream.write("more")
    target.write("y")
    target.flush()  # Python's own flush at exit cannot fail any more
    closed = io.StringIO()
    closed.close()
    s2 = output.BestEffortStream(closed)
    s2.write("z")
    s2.flush()
    assert s2.broken
    ascii_target = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    s3 = output.BestEffortStream(ascii_target)
    s3.write("caf\u00e9 \udcff")
    s3.flush()
    assert ascii_target.buffer.getvalue() == b"caf\\xe9 \\ufffd"
    assert output.BestEffortStream(None).write("nowhere") == 7


# -- the wire: tool-call ids made unique (item 9) ---------------------------------------------------------------


def test_distinct_tool_call_ids() -> None:
    earlier = [
        Message(role="assistant", tool_calls=[ToolCall(id="call_1", name="a")]),
        Message(role="tool", content="r", tool_call_id="call_1"),
    ]
    m = Message(
        role="assistant",
        tool_calls=[
            ToolCall(id="call_1", name="b"),
            ToolCall(id="new", name="c"),
            ToolCall(id="new", name="d"),
            ToolCall(id="", name="e"),
            ToolCall(id="x" * 60 + "!", name="f"),
            ToolCall(id="x" * 60 + "!", name="g"),
        ],
    )
    out = distinct_tool_call_ids(m, earlier, 2)
    ids = [c.id for c in out.tool_calls]
    assert ids[:4] == ["call_1_2_0", "new", "new_2_2", "call_2_3"]
    assert len(set(ids)) == 6 and all(len(i) <= MAX_TOOL_CALL_ID for i in ids[5:])
    assert [c.provider_id for c in out.tool_calls][:4] == ["call_1", None, "new", ""]
    assert distinct_tool_call_ids(out, earlier, 2) is out  # already distinct: unchanged
    taken = [Message(role="assistant", tool_calls=[ToolCall(id="a", name="x"), ToolCall(id="a_1_1", name="y")])]
    assert (
        distinct_tool_call_ids(
            Message(role="assistant", tool_calls=[ToolCall(id="z", name="x"), ToolCall(id="a", name="x")]), taken, 1
        )
        .tool_calls[1]
        .id
        == "a_1_1_2"
    )


def test_strict_mode_rejects_what_openai_rejects() -> None:
    def asst(*ids: str) -> dict:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids],
        }

    def tool(i: str) -> dict:
        return {"role": "tool", "tool_call_id": i, "content": "ok"}

    user = {"role": "user", "content": "hi"}
    assert strict_violation([user, asst("a", "b"), tool("a"), tool("b"), asst("c"), tool("c")]) is None
    assert "duplicate tool_call id 'a'" in strict_violation([user, asst("a", "a"), tool("a"), tool("a")])
    assert "duplicate tool_call id 'a'" in strict_violation([user, asst("a"), tool("a"), asst("a"), tool("a")])
    assert "did not have response messages: b" in strict_violation([user, asst("a", "b"), tool("a"), user])
    assert "must be a response" in strict_violation([user, tool("a")])


def test_detached_writes_never_wait_for_a_reader() -> None:
    """While a runner works, a pipe nobody reads (a pager, a stuck consumer) must not hold it up."""
    import threading
    import time

    r, w = os.pipe()
    target = os.fdopen(w, "w")
    stream = output.BestEffortStream(target)
    line = "x" * 99 + "\n"
    started = time.monotonic()
    with output.detached_writes():
        for _ in range(2000):  # 200 kB: three times what a pipe holds
            stream.write(line)
            stream.flush()
    assert time.monotonic() - started < 5  # nothing waited for the reader
    received = bytearray()
    reader = threading.Thread(target=lambda: received.extend(iter_read(r)), daemon=True)
    reader.start()
    stream.write("end\n")  # an ordinary write waits for the queue: the order is kept
    stream.flush()
    target.close()
    reader.join(10)
    assert bytes(received) == (line * 2000 + "end\n").encode()


def iter_read(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


@pytest.mark.process
def test_help_to_a_pipe_and_bytes_written_by_click() -> None:
    """click probes a stream with ``write(b"")`` and then writes bytes to it (``--help`` does):
    the best-effort stream must take them, or ``agentfast --help | cat`` exits 1."""
    proc = subprocess.run([sys.executable, "-m", "agentfast.runner", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Usage" in proc.stdout, proc.stderr
    sink = io.StringIO()
    stream = output.BestEffortStream(sink)
    assert stream.write(b"caf\xc3\xa9 \xff") == len("café \ufffd")
    assert sink.getvalue() == "café \ufffd"
