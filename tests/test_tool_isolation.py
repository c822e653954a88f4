"""Tools run in a tool host that never holds the runner's credentials (G11; runner/toolhost.py).

Real processes against the real test server: ``agentfast run`` with a store DSN carrying a marker
password and a marker model key; a hostile tool (``probe_credentials``) reports what it can see.
Locally the tests run as root, who may read any process's files, so what a non-root tool host
cannot read of its runner (``/proc/PID/environ`` of a non-dumpable process) is checked on the
cluster tier, where the runner pod runs as uid 10001 (tests/e2e/test_trust_boundaries.py).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.examples import EXAMPLES_DSN_ENV
from agentfast.runner.store import Store
from agentfast.runner.toolhost import CREDENTIAL_ENV, tool_environment

from .helpers import run_cli, spawn_cli

PROBE = {"name": "probe_credentials", "ref": "agentfast.testing.tools:probe_credentials"}
DIE_ONCE = {"name": "die_once", "ref": "tests.tool_fixtures:die_once"}


def _file(tmp_path: Path, name: str, script: str, tools: list[dict]) -> Path:
    """An AgentRun file; ``script`` is a bundled script's name, or "call:TOOL" for a script (written
    beside it) that calls TOOL once with ``{"text": "hi"}`` and then answers."""
    if script.startswith("call:"):
        turns = [{"tool_calls": [{"id": "c1", "name": script[5:], "arguments": {"text": "hi"}}]}, {"content": "done"}]
        (tmp_path / f"{name}-script.yaml").write_text(yaml.safe_dump({"model": f"scripted-{name}", "turns": turns}))
        script = str(tmp_path / f"{name}-script.yaml")
    doc = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "uid": str(uuid.uuid4())},
        "spec": {"model": {"name": f"scripted-{name}", "script": script}, "input": "go", "tools": tools},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _result(dsn: str, run: str, iteration: int, position: int = 0) -> str:
    with Store(dsn) as s:
        (entry,) = [e for e in s.journal(f"default/{run}", iteration) if e.position == position]
    assert entry.state == "done" and entry.result is not None, entry
    return entry.result.content


def _with_password(dsn: str, password: str) -> str:
    # The test server trusts local sockets, so any password connects; the marker is what leaks if anything does.
    return psycopg.conninfo.make_conninfo(dsn, password=password)


@pytest.mark.process
def test_a_hostile_tool_sees_neither_the_store_credential_nor_the_model_key(dsn: str, tmp_path: Path) -> None:
    password, key = f"store-pw-{uuid.uuid4().hex}", f"sk-model-{uuid.uuid4().hex}"
    store_dsn = _with_password(dsn, password)
    done = run_cli(
        "run",
        str(_file(tmp_path, "probe", "probe_credentials", [PROBE])),
        dsn=store_dsn,
        env={"AGENTFAST_MODEL_API_KEY": key, "SOME_APP_SETTING": f"postgresql://x:{password}@db/app"},
    )
    assert done.returncode == 0, done.stdout
    found = json.loads(_result(store_dsn, "probe", 1))
    env = found["environ"]
    assert not CREDENTIAL_ENV & set(env), sorted(CREDENTIAL_ENV & set(env))
    own = found["reads"]["/proc/self/environ"]
    for secret in (password, key):
        assert not any(secret in v for v in env.values())  # SOME_APP_SETTING held the password: dropped
        assert secret not in own
    assert "SOME_APP_SETTING" not in env
    assert env[EXAMPLES_DSN_ENV], "the tools' own settings still reach them"
    assert "agentfast.runner.toolhost" in found["reads"]["/proc/self/cmdline"]  # the tool ran in the host


@pytest.mark.process
def test_the_runner_never_imports_a_tool_module(dsn: str, tmp_path: Path) -> None:
    log = tmp_path / "imports.log"
    flag = tmp_path / "die.flag"
    flag.write_text("already died")  # die_once answers at once
    proc = spawn_cli(
        "run",
        str(_file(tmp_path, "imports", "call:die_once", [DIE_ONCE])),
        dsn=dsn,
        env={"TOOL_FIXTURES_IMPORT_LOG": str(log), "DIE_ONCE_FLAG": str(flag), "PYTHONPATH": str(Path.cwd())},
    )
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    importers = {int(line) for line in log.read_text().split()}
    assert importers and proc.pid not in importers, (proc.pid, importers)


@pytest.mark.process
def test_a_tool_host_that_dies_mid_call_leaves_the_call_in_flight_and_the_resume_settles_it(dsn: str, tmp_path: Path) -> None:
    flag = tmp_path / "die.flag"
    env = {"DIE_ONCE_FLAG": str(flag), "PYTHONPATH": str(Path.cwd())}
    path = _file(tmp_path, "dies", "call:die_once", [DIE_ONCE])
    first = run_cli("run", str(path), dsn=dsn, env=env)
    assert first.returncode == 75, first.stdout  # retry me: the call's effect may have happened
    with Store(dsn) as s:
        (entry,) = s.journal("default/dies", 1)
        assert entry.state == "started" and entry.result is None  # no result was made up for it
    second = run_cli("resume", "dies", dsn=dsn, env=env)
    assert second.returncode == 0, second.stdout
    answer = json.loads(_result(dsn, "dies", 1))
    keys = Path(f"{flag}.calls").read_text().split()
    assert keys == [answer["idempotency_key"]] * 2  # run again (idempotent) with the same key (G4)


def test_tool_environment_drops_credentials_and_adds_the_tools_own_settings(tmp_path: Path) -> None:
    settings = tmp_path / "tool-env"
    settings.mkdir()
    # as the kubelet mounts a Secret: each key a symlink into a timestamped ..data directory
    (settings / "..2026_12_01").mkdir()
    (settings / "..2026_12_01" / "STRIPE_KEY").write_text("sk_live_tools_own")
    (settings / "..2026_12_01" / EXAMPLES_DSN_ENV).write_text("host=db user=agentfast_examples")
    (settings / "..data").symlink_to("..2026_12_01")
    for key in ("STRIPE_KEY", EXAMPLES_DSN_ENV):
        (settings / key).symlink_to(f"..data/{key}")
    (settings / "LD_PRELOAD").write_text("/tmp/evil.so")  # would change how the host starts
    (settings / "AGENTFAST_DSN").write_text("postgresql://tools@db/x")  # would pose as the store's
    (settings / "not-a-name").write_text("x")
    (settings / "LEAK").write_text("has s3cret-pw inside")
    env = {
        "AGENTFAST_DSN": "postgresql://r:s3cret-pw@db/af",
        "AGENTFAST_MODEL_API_KEY": "sk-1",
        "PGPASSWORD": "p",
        "PGHOST": "/home/me/.local/share/agentfast/pgdata",  # libpq's: names the local store's socket
        "PGSSLKEY": "/home/me/.postgresql/key",
        "AGENTFAST_HOME": "/home/me/af",  # where the local store's password file is
        "WHERE": "/home/me/af/postgres.password",
        "HOME": "/tmp",
        "COPY": "s3cret-pw",
        "AGENTFAST_TOOL_ENV_DIR": str(settings),
    }
    got = tool_environment(env, secrets=("s3cret-pw", "sk-1", "", "/home/me/af/postgres.password"))
    assert got == {
        "HOME": "/tmp",
        "AGENTFAST_TOOL_ENV_DIR": str(settings),
        "STRIPE_KEY": "sk_live_tools_own",
        EXAMPLES_DSN_ENV: "host=db user=agentfast_examples",
    }


@pytest.mark.process
def test_a_tool_module_that_raises_on_import_fails_the_run_not_the_runner(dsn: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad_tools_mod.py"
    bad.write_text("raise RuntimeError('no config for this tool')\n")
    path = _file(tmp_path, "badimport", "call:x", [{"name": "x", "ref": "bad_tools_mod:x"}])
    done = run_cli("run", str(path), dsn=dsn, env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2, done.stdout
    assert "importing module 'bad_tools_mod' raised RuntimeError" in done.stdout  # the text goes to the log only


SLOW_TOOLS = """
import os, time
time.sleep(float(os.environ["SLOW_IMPORT_S"]))
from agentfast.runner.examples.refund import add_case_note, issue_refund, lookup_order
with open(os.environ["SLOW_IMPORTED_AT"], "a") as f:
    f.write(repr(time.time()) + "\\n")
"""


@pytest.mark.process
def test_a_replacement_commits_its_takeover_while_the_tool_host_still_imports(dsn: str, tmp_path: Path) -> None:
    # Issue 14: the runner takes the run over (lease, epoch bump, checkpoint) while the tool host
    # imports the tools beside it, and asks for them only then; nothing runs before the takeover.
    (tmp_path / "slow_tools.py").write_text(SLOW_TOOLS)
    imported_at = tmp_path / "imported-at"
    doc = yaml.safe_load((Path(__file__).resolve().parent.parent / "manifests" / "examples" / "refund.yaml").read_text())
    doc["metadata"]["uid"] = str(uuid.uuid4())
    for t in doc["spec"]["tools"]:
        t["ref"] = "slow_tools:" + t["ref"].partition(":")[2]
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {"PYTHONPATH": str(tmp_path), "SLOW_IMPORT_S": "3", "SLOW_IMPORTED_AT": str(imported_at)}
    first = run_cli("run", str(path), "--no-wait", dsn=dsn, env=env, timeout=90)
    assert first.returncode == 0 and "WaitingForApproval" in first.stdout, first.stdout
    run_id = "default/refund-demo"
    with Store(dsn) as s:
        epoch = s.get_run(run_id).epoch
    resumed = run_cli("resume", "refund-demo", "--no-wait", dsn=dsn, env=env, timeout=90)
    assert resumed.returncode == 0 and "WaitingForApproval" in resumed.stdout, resumed.stdout
    with psycopg.connect(dsn) as conn:
        [(takeover_ms,)] = conn.execute(
            "SELECT min(saved_at) FROM agentfast_checkpoints WHERE run_id = %s AND epoch > %s", (run_id, epoch)
        ).fetchall()
    tools_ready = float(imported_at.read_text().splitlines()[-1])  # the resume's tool host, done importing
    assert takeover_ms / 1000 < tools_ready - 1.5, (takeover_ms / 1000, tools_ready)  # committed well before the tools were there
    with Store(dsn) as s:
        ctx, pending = s.load_context(run_id)
        assert ctx.counters.resumes == 1 and pending.awaiting[0].call_id == "call-2-0"
        assert [e.state for e in s.journal(run_id)] == ["done", "planned", "done"]  # nothing ran again, nothing new ran
