"""Test support is apart from the runtime (issue 16 item 6): ``agentfast.testing`` holds the
scripted model, the fault points' trigger and the test tools; the production image leaves it out
(Dockerfile; tests/e2e/test_images.py checks that image), so the runtime must work without it.

Here the runner runs as real OS processes with ``agentfast.testing`` made unimportable (an import
hook on ``PYTHONPATH``, like an install without the package), and every attempt to import it is
recorded:

- a run on a ModelConfig endpoint goes from start to approval to ``Succeeded`` and tries to import
  nothing of test support;
- a run naming ``spec.model.script`` is refused (exit 2) with a sentence saying why and what to do;
- ``AGENTFAST_FAULT`` set there is an error naming the variable, never a silent no-op that would
  let a kill test pass without killing anything.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from agentfast.runner.names import ExitCode
from agentfast.runner.spec import NO_SCRIPTED_MODEL
from agentfast.testing.scripted import ScriptedModelServer, load_script

from .helpers import EXAMPLES, run_cli

pytestmark = pytest.mark.process

_BLOCKER = '''
import importlib.abc, os, sys

class _NoTestSupport(importlib.abc.MetaPathFinder):
    """Stand-in for an install without agentfast.testing: refuse it, and record who asked."""
    def find_spec(self, name, path=None, target=None):
        if name == "agentfast.testing" or name.startswith("agentfast.testing."):
            with open(os.environ["BLOCKED_IMPORTS_LOG"], "a") as log:
                log.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTestSupport())
'''


@pytest.fixture
def without_test_support(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """``(env, log)``: the environment that hides agentfast.testing from a process (and the
    processes it starts), and the file listing every import of it that was tried."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_BLOCKER)
    log = tmp_path / "blocked-imports.log"
    return {"PYTHONPATH": str(hook), "BLOCKED_IMPORTS_LOG": str(log)}, log


def _attempts(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _refund(run: str, **model: object) -> dict:
    """The refund example named ``run``, on ``spec.model`` = ``model``."""
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"] = {"name": run, "uid": str(uuid.uuid4())}
    doc["spec"]["model"] = model
    return doc


def test_the_hook_hides_test_support(without_test_support, dsn: str) -> None:
    # The check of the checks below: with the hook, a process cannot import agentfast.testing.
    import subprocess
    import sys

    env, log = without_test_support
    probe = "import agentfast.runner.cli\ntry:\n import agentfast.testing.scripted\nexcept ModuleNotFoundError as e:\n print('hidden', e.name)"
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert out.stdout.strip() == "hidden agentfast.testing", out
    assert _attempts(log) == ["agentfast.testing"]


def _endpoint_run(tmp_path: Path, server: ScriptedModelServer, run: str) -> Path:
    """A file with the refund example named ``run`` on a ModelConfig pointing at ``server``."""
    modelconfig = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "ModelConfig",
        "metadata": {"name": "llm"},
        "spec": {"baseURL": server.base_url, "models": ["scripted-refund"], "maxRetries": 0, "timeoutSeconds": 20},
    }
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump_all([modelconfig, _refund(run, name="scripted-refund", config="llm")]))
    return path


def test_a_run_on_an_endpoint_needs_no_test_support(tmp_path: Path, dsn: str, store, without_test_support) -> None:
    env, log = without_test_support
    # The model is served by this test's process (which has test support), over real HTTP.
    with ScriptedModelServer(load_script("refund")) as server:
        proc = run_cli("run", str(_endpoint_run(tmp_path, server, "endpoint")), "--no-wait", dsn=dsn, timeout=90, env=env)
        assert proc.returncode == 0, proc.stdout
        assert store.load_context("default/endpoint")[0].status.phase == "WaitingForApproval"
        store.decide("default/endpoint", "call-2-0", "approve", decided_by="test")
        proc = run_cli("resume", "default/endpoint", "--no-wait", dsn=dsn, timeout=90, env=env)
        assert proc.returncode == 0, proc.stdout
        assert store.load_context("default/endpoint")[0].status.phase == "Succeeded"
        assert len(server.requests) == 3
    assert _attempts(log) == [], "the runtime tried to import test support for a run that needs none"


def test_a_scripted_run_without_test_support_is_refused_saying_why(tmp_path: Path, dsn: str, store, without_test_support) -> None:
    env, log = without_test_support
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_refund("scripted", name="scripted-refund", script="refund")))
    proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90, env=env)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stdout
    assert NO_SCRIPTED_MODEL in proc.stdout and "Traceback" not in proc.stdout, proc.stdout
    assert [r.run_id for r, _ in store.list_runs()] == []  # refused before anything was registered
    assert set(_attempts(log)) == {"agentfast.testing"}


def test_a_fault_point_without_test_support_is_an_error_not_a_no_op(tmp_path: Path, dsn: str, without_test_support) -> None:
    env, log = without_test_support
    with ScriptedModelServer(load_script("refund")) as server:
        path = _endpoint_run(tmp_path, server, "faulted")
        proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90, env=env, fault="tool.after_call")
    assert proc.returncode not in (0, -9), proc.stdout  # neither run on nor killed: the point never armed
    assert "AGENTFAST_FAULT is set, but fault points are test support" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout
    assert "agentfast.testing" in _attempts(log)
