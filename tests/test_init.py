"""``agentfast init DIR``: a team's own tools, ready to run, test and ship (issue 17 item 1).

What it writes runs: the AgentRun validates and names the tools as their author declared them,
the scaffold's own test passes (a real run of its tools on the scripted model, paused, approved,
resumed, and a runner killed mid-batch settled by the recovery check), and the Dockerfile builds
FROM agentfast's image. What it refuses (a folder that is not new, a name that is not a package)
exits 2 with one line, writing nothing. The image build itself is the cluster tier's.

    pytest tests/test_init.py -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentfast.runner import scaffold
from agentfast.runner.spec import load_agentrun, resolve

pytestmark = pytest.mark.process  # starts the CLI and the scaffold's own tests as processes

REPO = Path(__file__).resolve().parent.parent

FILES = {
    "pyproject.toml",
    "agentrun.yaml",
    "script.yaml",
    "Dockerfile",
    ".dockerignore",
    "README.md",
    "tests/test_tools.py",
    "{package}/__init__.py",
    "{package}/tools.py",
}


def _init(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``agentfast init ARGS`` as a new process."""
    env = {k: v for k, v in os.environ.items() if k != "AGENTFAST_FAULT"}
    return subprocess.run(
        [sys.executable, "-m", "agentfast.runner", "init", *args],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _written(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, comments dropped and continuation lines joined."""
    text = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    return [" ".join(i.split()) for i in re.sub(r"\\\n", " ", text).splitlines() if i.strip()]


def test_init_writes_a_package_of_tools_an_agentrun_a_script_a_test_and_a_dockerfile(tmp_path: Path) -> None:
    root = tmp_path / "team-tools"
    proc = _init(str(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _written(root) == {f.format(package="team_tools") for f in FILES}
    assert "package team_tools" in proc.stdout and "team_tools/tools.py" in proc.stdout
    for path in root.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "{{" not in text, path  # every placeholder replaced
            if path.suffix == ".py":
                compile(text, str(path), "exec")
    tools = (root / "team_tools" / "tools.py").read_text()
    assert "from agentfast.runner import Recovery, ToolContext, tool" in tools
    assert "ctx.idempotency_key" in tools
    assert 'name = "team-tools"' in (root / "pyproject.toml").read_text()
    assert 'dependencies = ["agentfast"]' in (root / "pyproject.toml").read_text()


def test_init_with_a_name_writes_that_package_into_an_empty_folder(tmp_path: Path) -> None:
    root = tmp_path / "anything"
    root.mkdir()
    proc = _init(str(root), "--name", "billing_tools")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _written(root) == {f.format(package="billing_tools") for f in FILES}
    assert "ref: billing_tools.tools:apply_credit" in (root / "agentrun.yaml").read_text()
    assert "name: billing-tools" in (root / "agentrun.yaml").read_text()


def test_init_refuses_a_folder_that_is_not_new_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "taken"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    proc = _init(str(root))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not empty" in proc.stderr and "Traceback" not in proc.stderr
    assert _written(root) == {"notes.txt"} and (root / "notes.txt").read_text() == "mine"

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    proc = _init(str(a_file))
    assert proc.returncode == 2 and "not a folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--name", "team-tools"], "not a Python identifier"),
        (["--name", "1tools"], "not a Python identifier"),
        (["--name", "tööls"], "not a Python identifier"),
        (["--name", "class"], "keyword"),
        (["--name", "json"], "taken"),
        (["--name", "agentfast"], "taken"),
        ([], "not a Python identifier"),  # the folder's name, 2026-tools, starts with a digit
    ],
)
def test_init_refuses_a_package_name_that_is_not_one(tmp_path: Path, args: list[str], said: str) -> None:
    root = tmp_path / "2026-tools"
    proc = _init(str(root), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert said in proc.stderr and "--name" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not root.exists()


def test_the_agentrun_it_writes_validates_and_names_tools_as_their_author_declared_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "init_check_tools"
    assert _init(str(root)).returncode == 0
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(root)  # spec.model.script is a path relative to where the CLI runs
    try:
        run = load_agentrun(root / "agentrun.yaml")  # imports the refs
        resolved = resolve(run)  # and loads the script
        assert run.apiVersion == "agentfast.dev/v1alpha1" and run.metadata.name == "init-check-tools"
        assert {t.name: t.ref for t in run.spec.tools} == {
            "apply_credit": "init_check_tools.tools:apply_credit",
            "send_notice": "init_check_tools.tools:send_notice",
        }
        from init_check_tools import tools

        assert tools.apply_credit.requires_approval and tools.apply_credit.idempotent
        assert not tools.send_notice.idempotent and tools.send_notice.recovery is not None
        assert not tools.send_notice.requires_approval
        assert resolved.script is not None
        [batch, answer] = resolved.script.turns
        assert [c.name for c in batch.tool_calls] == ["apply_credit", "send_notice"] and answer.content
        # The alternatives a team uncomments later are there, commented out.
        text = (root / "agentrun.yaml").read_text()
        assert "#   config: openai" in text and "# runner:" in text and "#   image: " in text
    finally:
        for name in [m for m in sys.modules if m == "init_check_tools" or m.startswith("init_check_tools.")]:
            del sys.modules[name]


def test_the_dockerfile_builds_from_agentfasts_image_and_adds_the_package_offline(tmp_path: Path) -> None:
    root = tmp_path / "team-tools"
    assert _init(str(root)).returncode == 0
    steps = _instructions((root / "Dockerfile").read_text())
    assert steps[:2] == ["ARG AGENTFAST_IMAGE=agentfast:dev", "FROM ${AGENTFAST_IMAGE}"]
    assert steps[-1] == "USER 10001:10001"  # agentfast's user: runner pods run non-root
    assert "COPY team_tools/ /opt/team_tools/team_tools/" in steps
    [run] = [s for s in steps if s.startswith("RUN ")]
    assert 'echo /opt/team_tools >"$site/team_tools.pth"' in run  # on the venv's path
    assert "compileall -q /opt/team_tools" in run and "import team_tools.tools" in run
    assert "pip" not in run and "curl" not in run  # nothing downloaded or built: builds with --network none
    # What it relies on in agentfast's image: the venv on PATH (python3 is its Python) and user 10001.
    ours = _instructions((REPO / "Dockerfile").read_text())
    assert "RUN python3 -m venv /opt/agentfast" in ours
    assert any(s.startswith("ENV PATH=/opt/agentfast/bin:$PATH") for s in ours)
    assert "USER 10001:10001" in ours
    assert ".pth" in (REPO / "Dockerfile").read_text()  # the testing target adds agentfast.testing the same way


@pytest.mark.parametrize("postgres", ["the test's", "embedded"])
def test_the_scaffolds_own_tests_pass(tmp_path: Path, dsn: str, postgres: str) -> None:
    """Its tests run the real CLI: the tools run in a tool host, the run pauses for the gated call,
    is approved, resumed and succeeds, each effect once; a runner SIGKILLed after the notice went
    out is settled by the recovery check. On this test's Postgres, and as a team runs them,
    without AGENTFAST_DSN: on an embedded server of their own."""
    root = tmp_path / "team-tools"
    assert _init(str(root)).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTFAST_FAULT", "AGENTFAST_DSN", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(root)
    if postgres == "the test's":
        env["AGENTFAST_DSN"] = dsn
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(root / "tests"), "-q", "-p", "no:cacheprovider"],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout, proc.stdout[-4000:]


def test_every_template_is_written_and_the_package_name_rules_hold() -> None:
    templates = {p.name for p in (Path(scaffold.__file__).parent / "templates").iterdir()}
    assert templates == {t for t, _ in scaffold.FILES}
    assert scaffold.default_package("/x/Team-A.tools") == "team_a_tools"
    assert scaffold.resource_name("Team__Tools_") == "team-tools"
    with pytest.raises(scaffold.ScaffoldError):
        scaffold.render("os")
