"""Logs (runner/logs.py, issue 18 item 3): JSON lines in pods, readable lines on a terminal.

A real run, in a real process, with ``AGENTFAST_LOG_FORMAT=json``: every line on its stderr is a
JSON object naming the run, and the lines of its work carry the epoch, the iteration and (a tool
call's) the call id. The console format is not JSON; the CLI's output for people (stdout) is
unchanged.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentfast.runner import logs
from agentfast.runner.errors import SettingError
from agentfast.runner.examples import EXAMPLES_DSN_ENV

from .helpers import agentrun_file, examples_dsn_for


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Restore the root logger's handlers and level after a test configures it; no fields bound
    before (an in-process run of an earlier test binds its own) or after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logs.clear()
    yield
    logs.clear()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_the_bound_fields(root_logging: None) -> None:
    stream = io.StringIO()
    assert logs.configure("INFO", stream=stream, fmt="json") == "json"
    log = logging.getLogger("agentfast.test")
    logs.bind(run="ns/r1", epoch=3)
    with logs.bound(iteration=2, call_id="call-2-0"):
        log.info("tool %s", "lookup_order")
    log.warning("after")
    assert logs.fields() == {"run": "ns/r1", "epoch": 3}
    logs.bind(run=None, epoch=None)
    log.info("unbound")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0] == {
        **{k: lines[0][k] for k in ("timestamp",)},
        "event": "tool lookup_order",
        "level": "info",
        "logger": "agentfast.test",
        "run": "ns/r1",
        "epoch": 3,
        "iteration": 2,
        "call_id": "call-2-0",
    }
    assert lines[0]["timestamp"].endswith("Z")
    assert lines[1]["event"] == "after" and lines[1]["level"] == "warning"
    assert "iteration" not in lines[1] and "call_id" not in lines[1] and lines[1]["run"] == "ns/r1"
    assert "run" not in lines[2] and "epoch" not in lines[2]


def test_an_exception_is_one_json_line_with_its_traceback(root_logging: None) -> None:
    stream = io.StringIO()
    logs.configure("INFO", stream=stream, fmt="json")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("agentfast.test").exception("it failed")
    (line,) = stream.getvalue().splitlines()
    doc = json.loads(line)
    assert doc["event"] == "it failed" and "ValueError: boom" in doc["exception"]


def test_the_console_format_is_readable_not_json(root_logging: None) -> None:
    stream = io.StringIO()
    assert logs.configure("INFO", stream=stream, fmt="console") == "console"
    with logs.bound(run="ns/r1", iteration=4):
        logging.getLogger("agentfast.test").info("model_call")
    text = stream.getvalue()
    assert text.count("\n") == 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert "model_call" in text and "run=ns/r1" in text and "iteration=4" in text


def test_the_format_follows_the_environment_then_the_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert logs.choose_format(io.StringIO(), {}) == "json"  # a pod's stderr is no terminal
    assert logs.choose_format(Tty(), {}) == "console"
    assert logs.choose_format(Tty(), {logs.FORMAT_ENV: "JSON"}) == "json"
    assert logs.choose_format(io.StringIO(), {logs.FORMAT_ENV: "console"}) == "console"
    with pytest.raises(SettingError, match="AGENTFAST_LOG_FORMAT"):
        logs.choose_format(io.StringIO(), {logs.FORMAT_ENV: "xml"})


def _cli(dsn: str, fmt: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``agentfast ARGS`` as a real process at INFO (what the operator gives runner pods), stderr apart."""
    env = {
        **os.environ,
        "AGENTFAST_DSN": dsn,
        EXAMPLES_DSN_ENV: examples_dsn_for(dsn),
        "AGENTFAST_LOG_LEVEL": "INFO",
        logs.FORMAT_ENV: fmt,
    }
    env.pop("AGENTFAST_FAULT", None)
    return subprocess.run(
        [sys.executable, "-m", "agentfast.runner", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _refund(tmp_path: Path, dsn: str, fmt: str) -> list[subprocess.CompletedProcess[str]]:
    """The refund example: a first runner until it pauses for the refund's approval, the approval,
    then a second runner (it takes the run over: epoch 2) to the end. Every process's result."""
    first = _cli(dsn, fmt, "run", "--no-wait", str(agentrun_file(tmp_path)))
    assert "approval" in first.stdout, first.stdout + first.stderr
    decided = _cli(dsn, fmt, "approve", "default/refund-demo", "call-2-0")
    assert decided.returncode == 0, decided.stdout + decided.stderr
    second = _cli(dsn, fmt, "resume", "default/refund-demo")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Succeeded" in second.stdout  # the output for people is still on stdout
    return [first, decided, second]


@pytest.mark.process
def test_a_real_runs_log_is_json_lines_with_run_epoch_iteration_and_call_id(tmp_path: Path, dsn: str) -> None:
    first, decided, second = _refund(tmp_path, dsn, "json")
    assert decided.stderr == ""  # a command that logs nothing writes nothing
    runners = [[json.loads(line) for line in p.stderr.splitlines()] for p in (first, second)]  # every line: one JSON object
    for epoch, lines in enumerate(runners, start=1):
        assert lines, "a run at INFO logs its course"
        assert all(d["run"] == "default/refund-demo" and {"timestamp", "level", "logger", "event"} <= d.keys() for d in lines)
        for d in lines:
            if d["event"] in ("model_call", "checkpoint", "tool call started", "tool call done", "finished", "waiting"):
                assert d["epoch"] == epoch, d
            if d["event"] in ("model_call", "tool call started", "tool call done"):
                assert d["iteration"] >= 1, d
            if d["event"].startswith("tool call"):
                assert d["call_id"].startswith(f"call-{d['iteration']}-") and d["tool"], d
            else:
                assert "call_id" not in d, d  # a call's id is bound around that call only
    events = [[d["event"] for d in lines] for lines in runners]
    assert events[0].count("model_call") == 2 and "waiting" in events[0]
    assert events[1].count("model_call") == 1 and events[1][-1] == "finished"
    done = {(d["iteration"], d["call_id"], d["tool"]) for lines in runners for d in lines if d["event"] == "tool call done"}
    assert done == {(1, "call-1-0", "lookup_order"), (2, "call-2-1", "add_case_note"), (2, "call-2-0", "issue_refund")}


@pytest.mark.process
def test_the_console_format_of_a_real_run_is_not_json(tmp_path: Path, dsn: str) -> None:
    lines = [line for p in _refund(tmp_path, dsn, "console") for line in p.stderr.splitlines()]
    assert any("model_call" in line and "run=default/refund-demo" in line for line in lines)
    for line in lines:
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)


def test_the_operator_keeps_kopfs_handler_with_our_lines(root_logging: None) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    root.handlers[:] = [logging.StreamHandler(stream)]  # kopf installs its own handler on the root logger
    root.setLevel(logging.INFO)
    assert logs.reformat_handlers("json") == "json"
    with logs.bound(run="ns/r2"):
        logging.getLogger("kopf.objects").info("Handler succeeded", extra={"k8s_ref": {"name": "r2", "namespace": "ns"}})
    doc = json.loads(stream.getvalue())
    assert doc["run"] == "ns/r2" and doc["k8s_ref"] == {"name": "r2", "namespace": "ns"} and doc["logger"] == "kopf.objects"


@pytest.mark.process
def test_an_unknown_log_format_is_refused_by_name(dsn: str) -> None:
    proc = _cli(dsn, "xml", "list")
    assert proc.returncode == 2 and "AGENTFAST_LOG_FORMAT='xml'" in proc.stdout + proc.stderr
