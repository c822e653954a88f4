"""The CRD's schema and the runner's AgentRun model describe the same resource.

The CRD (charts/agentfast/crds/) is what the API server validates; runner/spec.py is what the
runner and `agentfast run` validate. A field in one and not the other would be silently pruned
by the API server or rejected by the runner; this test keeps them in step. The CEL rules
themselves are exercised against a real API server in tests/e2e/test_crd_validation.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from agentfast.runner.spec import AgentRunSpec, ApprovalDecision, BudgetSpec, GraphSpec, ModelSpec, SecretKeyRef, ToolSpec

CRD = Path(__file__).resolve().parent.parent / "charts" / "agentfast" / "crds" / "agentruns.agentfast.dev.yaml"


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())


def spec_schema() -> dict[str, Any]:
    [version] = crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def fields(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def test_top_level_spec_fields_match() -> None:
    assert set(spec_schema()["properties"]) == fields(AgentRunSpec)


def test_nested_fields_match() -> None:
    props = spec_schema()["properties"]
    assert set(props["model"]["properties"]) == fields(ModelSpec)
    assert set(props["model"]["properties"]["apiKeySecretRef"]["properties"]) == fields(SecretKeyRef)
    assert set(props["tools"]["items"]["properties"]) == fields(ToolSpec)
    assert set(props["graph"]["properties"]) == fields(GraphSpec)
    assert set(props["budget"]["properties"]) == fields(BudgetSpec)
    assert set(props["approvals"]["additionalProperties"]["properties"]) == fields(ApprovalDecision)


def test_defaults_match() -> None:
    props = spec_schema()["properties"]
    for name, prop in props["budget"]["properties"].items():
        assert prop["default"] == BudgetSpec.model_fields[name].default, name
    assert props["adapter"]["default"] == AgentRunSpec.model_fields["adapter"].default
    assert props["model"]["properties"]["apiKeyEnv"]["default"] == ModelSpec.model_fields["apiKeyEnv"].default


def test_every_spec_field_is_documented_for_kubectl_explain() -> None:
    def walk(schema: dict[str, Any], path: str) -> list[str]:
        missing = []
        for name, prop in schema.get("properties", {}).items():
            here = f"{path}.{name}"
            if prop.get("type") in ("object", "array") and "description" not in prop:
                missing.append(here)
            missing += walk(prop, here)
            if "items" in prop:
                missing += walk(prop["items"], here + "[]")
        return missing

    assert walk(spec_schema(), "spec") == []


def test_printer_columns_and_names() -> None:
    doc = crd()
    [version] = doc["spec"]["versions"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Phase", "Iteration", "Tokens", "Restarts", "Awaiting", "Age"]
    assert version["subresources"] == {"status": {}}
    assert doc["spec"]["names"]["shortNames"] == ["ar"] and "agentfast" in doc["spec"]["names"]["categories"]


def test_every_number_has_a_maximum() -> None:
    def walk(schema: dict[str, Any], path: str) -> list[str]:
        missing = [path] if schema.get("type") in ("integer", "number") and "maximum" not in schema else []
        for name, prop in schema.get("properties", {}).items():
            missing += walk(prop, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                missing += walk(schema[key], f"{path}[]")
        return missing

    [version] = crd()["spec"]["versions"]
    assert walk(version["schema"]["openAPIV3Schema"], "") == []


def test_patterns_and_limits_are_the_runners() -> None:
    from agentfast.runner import spec as s

    props = spec_schema()["properties"]
    model = props["model"]["properties"]
    assert model["apiKeyEnv"]["pattern"] == s.API_KEY_ENV_PATTERN
    assert model["apiKeySecretRef"]["properties"]["name"]["pattern"] == s.DNS1123_SUBDOMAIN
    assert model["script"]["pattern"] == s.SCRIPT_NAME_PATTERN  # a cluster: bundled names only, never paths
    assert props["tools"]["items"]["properties"]["ref"]["pattern"] == s.REF_PATTERN
    assert props["graph"]["properties"]["ref"]["pattern"] == s.REF_PATTERN
    assert props["approvals"]["maxProperties"] == s.MAX_APPROVALS
    for name, prop in props["budget"]["properties"].items():
        if name != "classifier":
            assert prop["maximum"] == next(m.le for m in BudgetSpec.model_fields[name].metadata if hasattr(m, "le")), name
    assert model["maxRetries"]["maximum"] == next(m.le for m in ModelSpec.model_fields["maxRetries"].metadata if hasattr(m, "le"))
    rules = [r["rule"] for r in props["approvals"]["x-kubernetes-validations"]]
    assert not any("matches(" in r for r in rules), "a regex over map keys has an unbounded estimated cost"
