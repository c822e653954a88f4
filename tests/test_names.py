"""The shared names (runner/names.py) and errors (runner/errors.py) say what the wire says.

Phases, exit codes, the run id's format and the CRDs' coordinates are read by other programs
(the API server's schema and printer columns, kubectl, the kubelet's view of an exit code,
rows stored by an earlier release): their values are pinned here as literals, and compared with
the CRDs the chart installs and manifests/install.yaml renders.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from agentfast.runner import errors, names
from agentfast.runner.names import (
    API_VERSION,
    GROUP,
    KIND,
    MODELCONFIG_KIND,
    MODELCONFIG_PLURAL,
    PLURAL,
    TERMINAL_PHASES,
    VERSION,
    WAITING_PHASES,
    EventReason,
    ExitCode,
    Phase,
    format_run_id,
    parse_run_id,
)

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "charts" / "agentfast" / "crds"
INSTALL = ROOT / "manifests" / "install.yaml"


def _crds() -> dict[tuple[str, str], dict[str, Any]]:
    """Every CRD, by (where, metadata.name): the chart's files and the rendered install.yaml."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        found[(path.name, doc["metadata"]["name"])] = doc
    for doc in yaml.safe_load_all(INSTALL.read_text()):
        if doc and doc.get("kind") == "CustomResourceDefinition":
            found[("install.yaml", doc["metadata"]["name"])] = doc
    return found


def test_phases_are_the_strings_stored_and_shown() -> None:
    assert [p.value for p in Phase] == [
        "Pending",
        "Running",
        "WaitingForApproval",
        "WaitingForInput",
        "Succeeded",
        "Failed",
        "Cancelled",
    ]
    assert TERMINAL_PHASES == {"Succeeded", "Failed", "Cancelled"}
    assert WAITING_PHASES == {"WaitingForApproval", "WaitingForInput"}
    assert all(isinstance(p, str) and str(p) == p.value and f"{p}" == p.value for p in Phase)
    assert json.dumps({"phase": Phase.WAITING_FOR_APPROVAL}) == '{"phase": "WaitingForApproval"}'


def test_phases_match_the_snapshot_literal_and_the_crd() -> None:
    from agentfast.runner.snapshot import Phase as SnapshotPhase
    from agentfast.runner.snapshot import RunStatus

    assert get_args(SnapshotPhase) == tuple(Phase)
    assert type(RunStatus(phase=Phase.FAILED).phase) is str  # stored as the plain string
    seen = 0
    for (where, name), crd in _crds().items():
        if name != f"{PLURAL}.{GROUP}":
            continue
        [version] = crd["spec"]["versions"]
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        assert status["phase"]["enum"] == [p.value for p in Phase], where
        assert {"name": "Phase", "type": "string", "jsonPath": ".status.phase"} in version["additionalPrinterColumns"], where
        seen += 1
    assert seen == 2  # the chart's and install.yaml's


def test_exit_codes() -> None:
    assert {c.name: c.value for c in ExitCode} == {
        "OK": 0,
        "FAILED": 1,
        "BAD_INPUT": 2,
        "NO_POSTGRES": 3,
        "RETRY": 75,
        "LEASE_LOST": 76,
    }
    assert str(ExitCode.RETRY) == "75" and f"{ExitCode.LEASE_LOST}" == "76"


def test_no_other_module_names_an_exit_code() -> None:
    """ExitCode is the one home: no module keeps its own EXIT_* number (liveness's EXIT_GRACE_S is
    seconds, not a code)."""
    import re

    from agentfast.operator import lifecycle

    repo = Path(__file__).resolve().parent.parent
    own = [
        f"{path.relative_to(repo)}: {m.group(0)}"
        for folder in ("runner", "operator")
        for path in sorted((repo / folder).rglob("*.py"))
        for m in re.finditer(r"^\s*EXIT_(?!GRACE_S)\w+\s*[:=].*$", path.read_text(encoding="utf-8"), re.M)
    ]
    assert own == []
    assert lifecycle.RUN_ENDED_EXITS == {1, 2}


@pytest.mark.parametrize(("namespace", "name"), [("default", "refund-demo"), ("team-a", "a.b-c"), ("x", "y")])
def test_run_id_round_trip(namespace: str, name: str) -> None:
    run_id = format_run_id(namespace, name)
    assert run_id == f"{namespace}/{name}"
    assert parse_run_id(run_id) == (namespace, name)


def test_a_bare_name_is_in_the_default_namespace() -> None:
    from agentfast.runner.cli import _run_key

    assert parse_run_id("refund-demo") == ("default", "refund-demo")
    assert parse_run_id("refund-demo", default_namespace="team-a") == ("team-a", "refund-demo")
    assert _run_key("refund-demo") == "default/refund-demo" and _run_key("team-a/refund-demo") == "team-a/refund-demo"


def test_crd_coordinates_match_the_crds() -> None:
    assert (GROUP, VERSION, API_VERSION) == ("agentfast.dev", "v1alpha1", "agentfast.dev/v1alpha1")
    expected = {f"{PLURAL}.{GROUP}": (KIND, PLURAL), f"{MODELCONFIG_PLURAL}.{GROUP}": (MODELCONFIG_KIND, MODELCONFIG_PLURAL)}
    assert expected == {
        "agentruns.agentfast.dev": ("AgentRun", "agentruns"),
        "modelconfigs.agentfast.dev": ("ModelConfig", "modelconfigs"),
    }
    crds = _crds()
    assert sorted(crds) == sorted((where, n) for n in expected for where in ("install.yaml", f"{n}.yaml"))
    for (where, name), crd in crds.items():
        spec = crd["spec"]
        assert spec["group"] == GROUP, where
        assert [v["name"] for v in spec["versions"]] == [VERSION], where
        assert (spec["names"]["kind"], spec["names"]["plural"]) == expected[name], where


def test_the_spec_models_literals_say_the_same() -> None:
    from agentfast.runner.spec import AgentRun, ModelConfig

    for model, kind in ((AgentRun, KIND), (ModelConfig, MODELCONFIG_KIND)):
        assert get_args(model.model_fields["apiVersion"].annotation) == (API_VERSION,)
        assert get_args(model.model_fields["kind"].annotation) == (kind,)


def test_event_reasons() -> None:
    assert {r.value for r in EventReason} == {
        "EarlierRunKept",
        "RunnerCreated",
        "RunnerLost",
        "Resumed",
        "Decided",
        "ApprovalPolicyMissing",
        "InvalidCallId",
        "UnattributedDecision",
        "DecisionConflict",
        "NotAwaitingDecision",
        "InvalidDecision",
        "DecisionUnusable",
    }
    assert (names.EVENT_NORMAL, names.EVENT_WARNING) == ("Normal", "Warning")


def test_names_and_errors_import_only_the_standard_library() -> None:
    """The CLI imports them for every command (tests/test_cli_imports.py): they must stay cheap."""
    code = (
        "import sys; before = set(sys.modules); import agentfast.runner.names, agentfast.runner.errors; "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    ours = {"agentfast", "agentfast.runner", "agentfast.runner.names", "agentfast.runner.errors"}
    others = [m for m in proc.stdout.split() if m not in ours and m.split(".")[0] not in sys.stdlib_module_names]
    assert others == [], others


# -- errors ----------------------------------------------------------------------------------------


def _our_exception_classes() -> list[type[BaseException]]:
    found = []
    for package in ("agentfast.runner", "agentfast.operator"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + "."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            found += [
                c
                for _, c in inspect.getmembers(module, inspect.isclass)
                if issubclass(c, BaseException) and c.__module__ == info.name
            ]
    return found


def test_every_error_of_ours_derives_from_the_base() -> None:
    classes = _our_exception_classes()
    assert {c.__name__ for c in classes} >= {
        "SpecError",
        "StoreError",
        "LeaseLost",
        "UnknownCall",
        "ModelError",
        "RunnerPodRefused",
    }
    assert sorted(c.__name__ for c in classes if not issubclass(c, errors.AgentfastError)) == []


def test_domain_errors_are_still_the_builtins_they_replaced() -> None:
    from agentfast.runner import decisions, spec, store

    assert spec.SpecError is errors.SpecError and issubclass(errors.SpecError, ValueError)
    assert decisions.InvalidDecision is errors.InvalidDecision and issubclass(errors.InvalidDecision, ValueError)
    assert issubclass(errors.SettingError, ValueError)
    assert issubclass(errors.UnknownRun, KeyError) and not issubclass(errors.UnknownRun, store.StoreError)
    assert issubclass(store.InvalidDsn, ValueError) and issubclass(store.LeaseLost, errors.AgentfastError)
