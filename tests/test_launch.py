"""Issue 30 item 3 on real parts: what a spec gives a stdio MCP server it names (runner/launch.py).

The attack: an AgentRun whose stdio MCP server is the bundled test server (an allowed program),
with a variable that makes the process load a hostile file first (PYTHONPATH, LD_PRELOAD,
BASH_ENV, NODE_OPTIONS, PATH), or with arguments that make an allowed interpreter run code
(``python -c``, ``node -e``, ``bash -c``, ``env LD_PRELOAD=...``). Each hostile file writes a
marker when it runs; each case is first shown to work on a real process (the control), then:

- ``agentfast run`` refuses it (exit 2, the field and the variable named, nothing registered);
- the operator's checks refuse it (parse_agentrun, check_cluster_policy), even where the admin
  lists the variable (the operator then does not start);
- the runner refuses a run registered past the CLI, as the operator registers one (exit 2, nothing
  taken over; arguments the admin's entries do not allow end the run Failed/InvalidSpec);
- the tool host refuses it even for a run built without validation;

and the marker is never written. An allowed variable of the admin's list reaches the server.
Real Postgres, real processes, the bundled scripted model and test MCP server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentfast.runner.errors import SettingError, SpecError
from agentfast.runner.launch import ENV_DENIED, command_refusal, env_refusal, env_value_refusal
from agentfast.runner.spec import AgentRun, McpServerSpec, check_cluster_policy, mcp_env_from_env, parse_agentrun
from agentfast.testing.mcp_server import EFFECTS_ENV, effects

from .helpers import run_cli

pytestmark = pytest.mark.process

SERVER = [sys.executable, "-m", "agentfast.testing.mcp_server", "--stdio"]
#: The admin's entry for the test server: the interpreter with the module it runs.
ENTRY = " ".join(SERVER[:3])
#: The variables and arguments a cluster's admin allows in the tests that play a cluster.
POLICY = {
    "AGENTFAST_ALLOWED_MODULES": "agentfast.runner.examples",
    "AGENTFAST_MCP_ALLOWED_COMMANDS": ENTRY,
    "AGENTFAST_MCP_ALLOWED_ENV": EFFECTS_ENV,
}


def _doc(name: str, server: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "model": {"name": "scripted-mcp", "script": "mcp_orders"},
            "input": "settle order A-1",
            "mcpServers": [{"name": "orders", **server}],
        },
    }


def _file(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


class Hostile:
    """Hostile files under ``root``, each writing ``marker`` when a process loads or runs it."""

    def __init__(self, root: Path):
        self.root, self.marker = root, root / "pwned"
        root.mkdir(exist_ok=True)

    def write(self, name: str, text: str, mode: int = 0o644) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
        return path

    def case(self, variable: str) -> tuple[list[str], dict[str, str]]:
        """``(command, env)``: an MCP server command and one variable that runs the hostile file."""
        m = str(self.marker)
        if variable == "PYTHONPATH":  # site imports sitecustomize from the first sys.path entry
            self.write("py/sitecustomize.py", f"open({m!r}, 'w').close()\n")
            return SERVER, {variable: str(self.root / "py")}
        if variable == "LD_PRELOAD":  # the loader runs a preloaded library's constructor
            src = self.write(
                "preload.c",
                f'#include <stdio.h>\n__attribute__((constructor)) static void f(void) {{ FILE *f = fopen("{m}", "w"); if (f) fclose(f); }}\n',
            )
            lib = self.root / "preload.so"
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
            return SERVER, {variable: str(lib)}
        if variable == "BASH_ENV":  # a non-interactive bash sources it before its script
            wrapper = self.write("server.sh", f"exec {' '.join(SERVER)}\n")
            return ["bash", str(wrapper)], {variable: str(self.write("env.sh", f": > {m}\n"))}
        if variable == "NODE_OPTIONS":  # node --require runs the file before the server's script
            wrapper = self.write(
                "server.js",
                f"require('child_process').spawnSync({SERVER[0]!r}, {SERVER[1:]!r}, {{stdio: 'inherit'}});\n",
            )
            hook = self.write("hook.js", f"require('fs').writeFileSync({m!r}, '');\n")
            return ["node", str(wrapper)], {variable: f"--require {hook}"}
        if variable == "PATH":  # the server's own command name is looked up on the child's PATH
            self.write("bin/python", f'#!/bin/sh\n: > {m}\nexec {SERVER[0]} "$@"\n', mode=0o755)
            return ["python", *SERVER[1:]], {variable: f"{self.root / 'bin'}:{os.environ['PATH']}"}
        raise AssertionError(variable)

    def runs(self, command: list[str], env: dict[str, str]) -> bool:
        """The control: started as the tool host would start it, with ``env`` added, does the hostile file run?"""
        self.marker.unlink(missing_ok=True)
        subprocess.run(command, env={**os.environ, **env}, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        ran = self.marker.exists()
        self.marker.unlink(missing_ok=True)
        return ran


HIJACKS = ["PYTHONPATH", "LD_PRELOAD", "BASH_ENV", "NODE_OPTIONS", "PATH"]


@pytest.fixture
def hostile(tmp_path: Path) -> Hostile:
    for tool in ("gcc", "bash", "node"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is needed to build the hostile files")
    return Hostile(tmp_path / "hostile")


@pytest.mark.parametrize("variable", HIJACKS)
def test_a_variable_that_loads_code_is_refused_by_agentfast_run(
    variable: str, hostile: Hostile, tmp_path: Path, dsn: str, store
) -> None:
    command, env = hostile.case(variable)
    assert hostile.runs(command, env), f"the control: {variable} does not run the hostile file"
    proc = run_cli(
        "run",
        _file(tmp_path, _doc(f"env-{variable.lower().replace('_', '-')}", {"command": command, "env": env})),
        "--no-wait",
        dsn=dsn,
        timeout=90,
    )
    assert proc.returncode == 2, proc.stdout
    assert f"spec.mcpServers[0]: env.{variable}: no run may set it" in proc.stdout, proc.stdout
    assert [r.run_id for r, _ in store.list_runs()] == []
    assert not hostile.marker.exists()


@pytest.mark.parametrize("variable", HIJACKS)
def test_the_cluster_checks_refuse_it_even_when_the_admin_lists_it(variable: str, hostile: Hostile) -> None:
    command, env = hostile.case(variable)
    # The operator's path (operator/main.py): parse without imports, then the admin's policy.
    with pytest.raises(SpecError, match=rf"spec\.mcpServers\[0\]: env\.{variable}: no run may set it"):
        parse_agentrun(_doc("op", {"command": command, "env": env}), check_imports=False)
    # An admin cannot list it: the operator (and a runner pod) would not start.
    with pytest.raises(SettingError, match=rf"AGENTFAST_MCP_ALLOWED_ENV \(mcp.allowedEnv\): '{variable}'"):
        mcp_env_from_env({"AGENTFAST_MCP_ALLOWED_ENV": f"{EFFECTS_ENV},{variable}"})
    # check_cluster_policy itself, on a run built without validation (it never trusts the model alone).
    run = _unchecked_run(command, env)
    with pytest.raises(SpecError) as err:
        check_cluster_policy(run, (), ["mcp_orders"], mcp_commands=(ENTRY, "bash", "node", "python"), mcp_env=(variable,))
    assert f"spec.mcpServers[0].env.{variable}: no run may set it" in str(err.value)
    assert not hostile.marker.exists()


def _unchecked_run(command: list[str], env: dict[str, str]) -> AgentRun:
    """An AgentRun whose MCP server skipped validation (as a caller could build one)."""
    run = parse_agentrun(_doc("unchecked", {"command": SERVER}), check_imports=False)
    server = McpServerSpec.model_construct(name="orders", command=command, env=env, serverRef=None, url=None, tools={})
    return run.model_copy(update={"spec": run.spec.model_copy(update={"mcpServers": [server]})})


@pytest.mark.parametrize("variable", HIJACKS)
def test_the_runner_refuses_a_run_registered_past_the_cli(variable: str, hostile: Hostile, dsn: str, store) -> None:
    # As in a cluster: the operator registered the run without running it; the runner pod runs
    # `agentfast resume` (here without and with the admin's policy in its environment).
    command, env = hostile.case(variable)
    for i, policy in enumerate(({}, POLICY)):
        doc = _doc(f"reg-{variable.lower().replace('_', '-')}-{i}", {"command": command, "env": env})
        run_id = f"default/{doc['metadata']['name']}"
        store.create_run(run_id, doc["metadata"]["uid"], doc)
        proc = run_cli("resume", run_id, "--no-wait", dsn=dsn, timeout=90, env=policy)
        # The stored spec does not parse: the runner says why and takes nothing of the run over.
        assert proc.returncode == 2 and f"spec.mcpServers[0]: env.{variable}: no run may set it" in proc.stdout, proc.stdout
        assert store.load_context(run_id) is None and store.journal(run_id) == []
    assert not hostile.marker.exists()


@pytest.mark.parametrize("variable", HIJACKS)
def test_the_tool_host_starts_nothing_for_a_run_built_without_validation(variable: str, hostile: Hostile) -> None:
    from agentfast.runner.mcp import mcp_tools

    command, env = hostile.case(variable)
    run = _unchecked_run(command, env)
    for policy in ({}, POLICY):  # a local run, and a runner pod's environment
        with pytest.raises(SpecError, match=rf"spec\.mcpServers\[0\]\.env\.{variable}: no run may set it"):
            mcp_tools(run, set(), env={**os.environ, **policy})
    assert not hostile.marker.exists()


#: Arguments that make an allowed interpreter run code no allow-list names, each writing MARKER;
#: the admin allowed the test server's entry and, carelessly, bare interpreters and a launcher.
CARELESS = (ENTRY, "python", sys.executable, "node", "bash", "env")


def _argument_attacks(hostile: Hostile) -> dict[str, list[str]]:
    m = str(hostile.marker)
    hook = hostile.write("hook.js", f"require('fs').writeFileSync({m!r}, '');\n")
    return {
        "python -c": [sys.executable, "-c", f"open({m!r}, 'w').close()"],
        "python -m with the code in its arguments": [
            sys.executable,
            "-m",
            "timeit",
            "-n1",
            "-s",
            f"open({m!r}, 'w').close()",
            "pass",
        ],
        "node -e": ["node", "-e", f"require('fs').writeFileSync({m!r}, '')"],
        "node --require": ["node", "--require", str(hook), "-e", "0"],
        "bash -c": ["bash", "-c", f": > {m}"],
        "env VAR=... PROGRAM": ["env", f"BASH_ENV={hostile.write('env.sh', f': > {m}')}", "bash", "-c", "true"],
    }


def test_arguments_that_make_an_allowed_program_run_other_code_are_refused(
    hostile: Hostile, tmp_path: Path, dsn: str, store
) -> None:
    attacks = _argument_attacks(hostile)
    for what, argv in attacks.items():
        assert hostile.runs(argv, {}), f"the control: {what} does not run the code"
        run = parse_agentrun(_doc("args", {"command": argv}), check_imports=False)
        with pytest.raises(SpecError, match=r"spec\.mcpServers\[0\]\.command: "):
            check_cluster_policy(run, (), ["mcp_orders"], mcp_commands=CARELESS)
    # In a runner pod: a run registered past the operator ends InvalidSpec; nothing started.
    doc = _doc("args-pod", {"command": attacks["python -c"]})
    store.create_run("default/args-pod", doc["metadata"]["uid"], doc)
    policy = {**POLICY, "AGENTFAST_MCP_ALLOWED_COMMANDS": ",".join(CARELESS)}
    proc = run_cli("resume", "default/args-pod", "--no-wait", dsn=dsn, timeout=90, env=policy)
    assert proc.returncode == 2 and "spec.mcpServers[0].command" in proc.stdout and "is an interpreter" in proc.stdout, (
        proc.stdout
    )
    assert store.load_context("default/args-pod")[0].status.reason == "InvalidSpec"
    # Under the same policy, `agentfast run` refuses it before registering anything.
    proc = run_cli(
        "run", _file(tmp_path, _doc("args-cli", {"command": attacks["bash -c"]})), "--no-wait", dsn=dsn, timeout=90, env=policy
    )
    assert proc.returncode == 2 and "spec.mcpServers[0].command" in proc.stdout, proc.stdout
    assert [r.run_id for r, _ in store.list_runs()] == ["default/args-pod"]
    assert not hostile.marker.exists()


def test_an_admin_allowed_variable_reaches_the_server_and_another_is_refused(tmp_path: Path, dsn: str, store) -> None:
    db = tmp_path / "effects.sqlite3"
    ok = _doc("allowed-env", {"command": SERVER, "env": {EFFECTS_ENV: str(db)}})
    proc = run_cli("run", _file(tmp_path, ok), "--no-wait", dsn=dsn, timeout=120, env=POLICY)
    assert proc.returncode == 0 and "waiting for approval" in proc.stdout, proc.stdout
    assert [tool for tool, _, _ in effects(db)] == ["add_note"]  # the server wrote where the variable said
    # A harmless name the admin did not list is refused all the same: the list is the admin's.
    other = _doc("unlisted-env", {"command": SERVER, "env": {EFFECTS_ENV: str(db), "ORDERS_REGION": "eu"}})
    proc = run_cli("run", _file(tmp_path, other), "--no-wait", dsn=dsn, timeout=90, env=POLICY)
    assert proc.returncode == 2, proc.stdout
    assert (
        "spec.mcpServers[0].env.ORDERS_REGION: not a variable this cluster lets a run set (mcp.allowedEnv: MCP_TEST_EFFECTS)"
        in proc.stdout
    )
    assert [r.run_id for r, _ in store.list_runs()] == ["default/allowed-env"]


def test_the_deny_list_covers_each_kind_whatever_the_case() -> None:
    refused = [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "DYLD_INSERT_LIBRARIES",
        "GCONV_PATH",
        "GLIBC_TUNABLES",
        "PATH",
        "path",
        "BASH_ENV",
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "PROMPT_COMMAND",
        "IFS",
        "BASH_FUNC_ls",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "PYTHONWARNINGS",
        "PYTHONBREAKPOINT",
        "NODE_OPTIONS",
        "NODE_PATH",
        "NODE_TLS_REJECT_UNAUTHORIZED",
        "npm_config_node_options",
        "PERL5OPT",
        "PERL5LIB",
        "PERLLIB",
        "RUBYOPT",
        "RUBYLIB",
        "JAVA_TOOL_OPTIONS",
        "_JAVA_OPTIONS",
        "JDK_JAVA_OPTIONS",
        "CLASSPATH",
        "DOTNET_STARTUP_HOOKS",
        "CORECLR_PROFILER_PATH",
        "LUA_INIT",
        "PHPRC",
        "GIT_SSH_COMMAND",
        "GIT_CONFIG_COUNT",
        "GIT_CONFIG_KEY_0",
        "EDITOR",
        "PAGER",
        "LESSOPEN",
        "HOME",
        "XDG_CONFIG_HOME",
        "OPENSSL_CONF",
        "SSL_CERT_FILE",
        "SSLKEYLOGFILE",
        "https_proxy",
        "HOSTALIASES",
        "RES_OPTIONS",
        "LOCPATH",
        "NLSPATH",
        "AGENTFAST_DSN",
        "PIP_INDEX_URL",
        "KRB5_CONFIG",
    ]
    assert [n for n in refused if env_refusal(n) is None] == []
    assert [n for n in ("ORDERS_REGION", "LANG", "LC_ALL", "TZ", "TMPDIR", "MCP_TEST_EFFECTS") if env_refusal(n)] == []
    assert env_refusal("A-B") and env_refusal("1A") and env_refusal("A" * 129)
    assert env_value_refusal("a\nb") and env_value_refusal("a\0b") and env_value_refusal("x" * 1025)
    assert env_value_refusal("tab\tok") is None
    # The spec refuses what the values rule refuses (a newline would start a line of its own in an env file).
    with pytest.raises(SpecError, match=r"env\.ORDERS_REGION: its value holds the character U\+000A"):
        parse_agentrun(_doc("nl", {"command": SERVER, "env": {"ORDERS_REGION": "eu\nLD_PRELOAD=/x"}}), check_imports=False)
    assert all(n == n.upper() for names, _ in ENV_DENIED for n in names)


def test_an_admins_entry_names_the_command_word_by_word() -> None:
    allowed = {
        (ENTRY,): [*SERVER, "--port", "3"],  # words after the module's are the module's own
        ("orders-mcp --stdio",): ["orders-mcp", "--stdio", "--region", "eu"],  # a server's own program
        ("npx -y @acme/orders-mcp@1.2.0",): ["npx", "-y", "@acme/orders-mcp@1.2.0"],  # a launcher, exactly
        ("node /app/server.js",): ["node", "/app/server.js", "-e", "x"],  # after the script: the script's
    }
    for entries, argv in allowed.items():
        assert command_refusal(argv, entries) is None, (entries, argv)
    refused = {
        ("python",): ([sys.executable, "x.py"], "is not a command"),  # compared as written, never on a PATH
        ("python ",): (["python", "x.py"], "'python' is an interpreter"),
        ("python -m",): (["python", "-m", "timeit"], "is an interpreter"),  # an entry ending with an option
        ("npx -y @acme/orders-mcp@1.2.0",): (["npx", "-y", "@acme/orders-mcp@1.2.0", "evil"], "exactly as the entry"),
        ("/usr/bin/env",): (["/usr/bin/env", "LD_PRELOAD=/x", "python"], "'/usr/bin/env' runs what its arguments name"),
        ("python3.11 /app/s.py",): (["python3.11", "/app/s.py.evil"], "is not a command"),
    }
    for entries, (argv, said) in refused.items():
        why = command_refusal(argv, entries)
        assert why is not None and said in why, (entries, argv, why)
