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
