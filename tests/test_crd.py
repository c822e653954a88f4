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

from agentfast.runner.spec import (
    MAX_MCP_ARGS,
    MAX_MCP_SERVERS,
    MCP_SERVER_NAME_PATTERN,
    AgentRunSpec,
    ApprovalDecision,
    BudgetSpec,
    ForkFrom,
    GraphSpec,
    McpServerSpec,
    McpToolOverride,
    ModelConfigSpec,
    ModelPrices,
    ModelSpec,
    SecretKeyRef,
    ToolSpec,
)

CRDS = Path(__file__).resolve().parent.parent / "charts" / "agentfast" / "crds"
CRD = CRDS / "agentruns.agentfast.dev.yaml"
MC_CRD = CRDS / "modelconfigs.agentfast.dev.yaml"


def crd(path: Path = CRD) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def mc_spec_schema() -> dict[str, Any]:
    [version] = crd(MC_CRD)["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _le(model: type[BaseModel], name: str) -> Any:
    return next(m.le for m in model.model_fields[name].metadata if hasattr(m, "le"))


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
    assert set(props["tools"]["items"]["properties"]) == fields(ToolSpec)
    mcp = props["mcpServers"]["items"]["properties"]
    assert set(mcp) == fields(McpServerSpec)
    assert set(mcp["tools"]["additionalProperties"]["properties"]) == fields(McpToolOverride)
    assert props["mcpServers"]["maxItems"] == MAX_MCP_SERVERS and mcp["command"]["maxItems"] == MAX_MCP_ARGS
    assert mcp["name"]["pattern"] == mcp["serverRef"]["pattern"] == MCP_SERVER_NAME_PATTERN
    assert set(props["graph"]["properties"]) == fields(GraphSpec)
    assert set(props["budget"]["properties"]) == fields(BudgetSpec)
    assert set(props["approvals"]["additionalProperties"]["properties"]) == fields(ApprovalDecision)
    assert set(props["forkFrom"]["properties"]) == fields(ForkFrom)
    assert props["forkFrom"]["properties"]["run"]["pattern"] == ForkFrom.model_fields["run"].metadata[-1].pattern


def test_defaults_match() -> None:
    props = spec_schema()["properties"]
    for name, prop in props["budget"]["properties"].items():
        assert prop.get("default") == BudgetSpec.model_fields[name].default, name  # max_cost: none, no limit
    assert props["adapter"]["default"] == AgentRunSpec.model_fields["adapter"].default
    mc = mc_spec_schema()["properties"]
    for name in ("timeoutSeconds", "maxRetries"):
        assert mc[name]["default"] == ModelConfigSpec.model_fields[name].default, name
    assert mc["prices"]["properties"]["currency"]["default"] == ModelPrices.model_fields["currency"].default


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
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Reason",
        "Iteration",
        "Tokens",
        "Cost",
        "Restarts",
        "Awaiting",
        "Age",
    ]
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

    for path in (CRD, MC_CRD):
        [version] = crd(path)["spec"]["versions"]
        assert walk(version["schema"]["openAPIV3Schema"], "") == [], path.name


def test_patterns_and_limits_are_the_runners() -> None:
    from agentfast.runner import spec as s

    props = spec_schema()["properties"]
    model = props["model"]["properties"]
    # no URL, no Secret, no variable (issue 12 item 4); prices only for the scripted model (a CEL rule)
    assert set(model) == {"name", "config", "script", "temperature", "prices"}
    assert model["config"]["pattern"] == s.DNS1123_SUBDOMAIN and model["name"]["pattern"] == s.MODEL_NAME_PATTERN
    assert model["script"]["pattern"] == s.SCRIPT_NAME_PATTERN  # a cluster: bundled names only, never paths
    assert props["tools"]["items"]["properties"]["ref"]["pattern"] == s.REF_PATTERN
    assert props["graph"]["properties"]["ref"]["pattern"] == s.REF_PATTERN
    assert props["approvals"]["maxProperties"] == s.MAX_APPROVALS
    for name, prop in props["budget"]["properties"].items():
        if name != "classifier":
            assert prop["maximum"] == next(m.le for m in BudgetSpec.model_fields[name].metadata if hasattr(m, "le")), name
            assert prop["minimum"] in (0, 1) and prop.get("exclusiveMinimum", False) == (prop["minimum"] == 0), name
    rules = [r["rule"] for r in props["approvals"]["x-kubernetes-validations"]]
    assert not any("matches(" in r for r in rules), "a regex over map keys has an unbounded estimated cost"


def test_the_mcp_env_rule_refuses_the_runners_deny_list_at_a_bounded_cost() -> None:
    import re

    from agentfast.runner.launch import ENV_DENIED, MAX_ENV_VALUE
    from agentfast.runner.spec import MAX_MCP_ENV

    env = spec_schema()["properties"]["mcpServers"]["items"]["properties"]["env"]
    assert env["maxProperties"] == MAX_MCP_ENV and env["additionalProperties"]["maxLength"] == MAX_ENV_VALUE
    rules = [r["rule"] for r in env["x-kubernetes-validations"]]
    assert not any("matches(" in r for r in rules), "a regex over map keys has an unbounded estimated cost"
    [rule] = [r for r in rules if "startsWith" in r]
    names, prefixes = (re.findall(r"'([^']*)'", part) for part in rule.split(".exists(")[0].split("]) && !["))
    assert names == [n for ns, _ in ENV_DENIED for n in ns if not n.endswith("*")]
    assert prefixes == [n[:-1] for ns, _ in ENV_DENIED for n in ns if n.endswith("*")]


def test_modelconfig_crd_mirrors_the_runners_model() -> None:
    doc = crd(MC_CRD)
    assert doc["spec"]["scope"] == "Namespaced"  # the Secret it names must be in the run's namespace to be mounted
    assert doc["spec"]["names"]["kind"] == "ModelConfig" and doc["spec"]["names"]["shortNames"] == ["mc"]
    assert "agentfast" in doc["spec"]["names"]["categories"]
    [version] = doc["spec"]["versions"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["BaseURL", "Models", "Age"]
    spec = mc_spec_schema()
    props = spec["properties"]
    assert set(props) == fields(ModelConfigSpec)
    assert set(spec["required"]) == {n for n, f in ModelConfigSpec.model_fields.items() if f.is_required()}
    assert set(props["apiKeySecretRef"]["properties"]) == fields(SecretKeyRef)
    assert set(props["prices"]["properties"]) == fields(ModelPrices)
    assert set(props["prices"]["required"]) == {n for n, f in ModelPrices.model_fields.items() if f.is_required()}


def test_modelconfig_patterns_and_limits_are_the_runners() -> None:
    from agentfast.runner import spec as s

    props = mc_spec_schema()["properties"]
    assert props["baseURL"]["pattern"] == s.BASE_URL_PATTERN
    assert props["baseURL"]["maxLength"] == next(
        m.max_length for m in ModelConfigSpec.model_fields["baseURL"].metadata if hasattr(m, "max_length")
    )
    assert props["apiKeySecretRef"]["properties"]["name"]["pattern"] == s.DNS1123_SUBDOMAIN
    assert props["apiKeySecretRef"]["properties"]["key"]["pattern"] == s.SECRET_KEY_PATTERN
    assert props["models"]["maxItems"] == s.MAX_CONFIG_MODELS and props["models"]["minItems"] == 1
    assert props["models"]["x-kubernetes-list-type"] == "set"  # distinct, as the runner checks
    assert props["models"]["items"]["pattern"] == s.MODEL_NAME_PATTERN
    for name in ("timeoutSeconds", "maxRetries", "maxTokensPerRequest"):
        assert props[name]["maximum"] == _le(ModelConfigSpec, name), name
    for name in ("promptPerMillionTokens", "completionPerMillionTokens"):
        assert props["prices"]["properties"][name]["maximum"] == _le(ModelPrices, name), name


def test_every_modelconfig_field_is_documented_for_kubectl_explain() -> None:
    props = mc_spec_schema()["properties"]
    assert all("description" in p for p in props.values()), [n for n, p in props.items() if "description" not in p]


def test_the_immutability_rule_covers_every_spec_field_but_approvals_replies_and_cancel() -> None:
    """A field the rule forgets would be editable after creation (a budget raised mid-run, a
    deadline lifted): every field of spec is compared with oldSelf, except the three requests."""
    import re

    rules = spec_schema()["x-kubernetes-validations"]
    immutable = next(r for r in rules if "spec is immutable" in r["message"])
    compared = set(re.findall(r"self\.([A-Za-z]+) == oldSelf\.\1", immutable["rule"]))
    assert compared == set(spec_schema()["properties"]) - {"approvals", "replies", "cancel"}
    assert "spec.approvals, spec.replies and spec.cancel" in immutable["message"]


def test_cancel_is_a_one_way_switch_and_the_deadline_the_runners() -> None:
    from agentfast.runner.spec import MAX_DEADLINE_S

    props = spec_schema()["properties"]
    assert props["cancel"]["type"] == "boolean" and "default" not in props["cancel"]  # absent until someone cancels
    assert props["activeDeadlineSeconds"]["minimum"] == 1 and props["activeDeadlineSeconds"]["maximum"] == MAX_DEADLINE_S
    assert AgentRunSpec.model_fields["activeDeadlineSeconds"].metadata[0].ge == 1
    one_way = [r for r in spec_schema()["x-kubernetes-validations"] if r.get("fieldPath") == ".cancel"]
    assert [r["rule"] for r in one_way] == ["!has(oldSelf.cancel) || !oldSelf.cancel || (has(self.cancel) && self.cancel)"]
    assert "cannot be taken back" in one_way[0]["message"]


def test_spec_runner_mirrors_the_runners_model_and_is_bounded_everywhere() -> None:
    # Issue 14 item 7: the same fields at every depth (an unknown field is pruned by the API server
    # and refused by the runner's model), the same patterns, and every list, map and string bounded.
    from agentfast.runner import spec as s

    runner = spec_schema()["properties"]["runner"]

    def model_of(annotation: Any) -> Any:
        import typing

        for arg in typing.get_args(annotation) or (annotation,):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
            inner = model_of(arg) if typing.get_args(arg) else None
            if inner is not None:
                return inner
        return None

    def walk(schema: dict[str, Any], model: type[BaseModel], path: str) -> None:
        assert set(schema["properties"]) == fields(model), path
        for name, prop in schema["properties"].items():
            sub = model_of(model.model_fields[name].annotation)
            if prop["type"] == "array":
                assert "maxItems" in prop, f"{path}.{name}"
                if sub is not None:
                    walk(prop["items"], sub, f"{path}.{name}[]")
            elif prop["type"] == "object" and "additionalProperties" in prop:
                assert "maxProperties" in prop, f"{path}.{name}"
            elif prop["type"] == "object":
                assert sub is not None, f"{path}.{name}"
                walk(prop, sub, f"{path}.{name}")
            elif prop["type"] == "string":
                assert "maxLength" in prop or "enum" in prop, f"{path}.{name}"

    walk(runner, s.RunnerSpec, "spec.runner")
    props = runner["properties"]
    assert props["image"]["pattern"] == s.IMAGE_PATTERN and props["image"]["maxLength"] == s.MAX_IMAGE_CHARS
    assert (
        props["nodeSelector"]["maxProperties"] == s.MAX_SELECTOR_LABELS and props["tolerations"]["maxItems"] == s.MAX_TOLERATIONS
    )
    assert props["nodeSelector"]["additionalProperties"]["pattern"] == s.LABEL_VALUE_PATTERN
    assert props["tolerations"]["items"]["properties"]["key"]["pattern"] == s.LABEL_KEY_PATTERN
    assert props["resources"]["properties"]["limits"]["properties"]["memory"]["pattern"] == s.QUANTITY_PATTERN
    assert props["priorityClassName"]["pattern"] == s.DNS1123_SUBDOMAIN
    terms = props["affinity"]["properties"]["nodeAffinity"]["properties"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["properties"]["nodeSelectorTerms"]["maxItems"] == s.MAX_TERMS
    # what the CRD refuses by CEL, the runner's model refuses too (the operator's check, and `agentfast run`)
    tol_rules = " ".join(r["rule"] for r in props["tolerations"]["items"]["x-kubernetes-validations"])
    assert all(k in tol_rules for k in s.OPERATOR_TOLERATION_KEYS)
    assert "startsWith('system-')" in props["priorityClassName"]["x-kubernetes-validations"][0]["rule"]


def test_spec_runner_is_immutable_like_the_rest_of_spec() -> None:
    [immutable] = [
        r for r in spec_schema()["x-kubernetes-validations"] if r["message"].startswith("spec is immutable after creation")
    ]
    assert "has(self.runner) == has(oldSelf.runner) && (!has(self.runner) || self.runner == oldSelf.runner)" in immutable["rule"]
    # every field of spec but approvals, replies and cancel is in the rule (a field left out would be editable)
    for name in fields(AgentRunSpec) - {"approvals", "replies", "cancel"}:
        assert f"self.{name}" in immutable["rule"], name


def test_max_cost_and_the_scripted_models_prices_are_the_runners() -> None:
    """spec.budget.max_cost (issue 17): a positive number bounded like the runner's, with CEL
    messages naming the field; spec.model.prices mirrors ModelPrices and is the scripted model's only."""
    from agentfast.runner import spec as s

    props = spec_schema()["properties"]
    cost = props["budget"]["properties"]["max_cost"]
    assert (cost["type"], cost["minimum"], cost["exclusiveMinimum"], cost["maximum"]) == ("number", 0, True, s.MAX_COST)
    assert "default" not in cost  # absent: no cost limit
    budget_rules = props["budget"]["x-kubernetes-validations"]
    assert any("max_cost" in r["rule"] and "spec.budget.max_cost" in r["message"] for r in budget_rules)
    prices = props["model"]["properties"]["prices"]
    assert set(prices["properties"]) == fields(ModelPrices)
    assert set(prices["required"]) == {n for n, f in ModelPrices.model_fields.items() if f.is_required()}
    assert prices["properties"] == mc_spec_schema()["properties"]["prices"]["properties"]  # the ModelConfig's own shape
    model_rules = props["model"]["x-kubernetes-validations"]
    assert any(r["rule"] == "!has(self.prices) || has(self.script)" for r in model_rules)
    spec_rules = spec_schema()["x-kubernetes-validations"]
    needs = next(r for r in spec_rules if "max_cost" in r["rule"])
    assert "has(self.model.prices)" in needs["rule"] and needs["message"].startswith("spec.budget.max_cost needs prices")


def test_status_declares_what_the_operator_writes_about_usage_and_cost() -> None:
    """A structural schema prunes undeclared fields: status.usage and status.cost must be declared
    with exactly the keys operator/status.py writes, and the Cost printer column must read one."""
    from agentfast.operator.status import cost_status, usage_status
    from agentfast.runner.snapshot import Budget, Prices, RunContext, Session, Usage

    ctx = RunContext(
        session=Session(run_uid="u"),
        usage=Usage(prompt_tokens=1000, completion_tokens=200, total_tokens=1200),
        budget=Budget(max_cost=1.5),
        prices=Prices(promptPerMillionTokens=2.5, completionPerMillionTokens=10),
    )
    [version] = crd()["spec"]["versions"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["usage"]["properties"]) == set(usage_status(ctx))
    cost = cost_status(ctx)
    assert cost is not None and set(status["cost"]["properties"]) == set(cost)
    column = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Cost")
    assert column["jsonPath"] == ".status.cost.amount" and status["cost"]["properties"]["amount"]["type"] == column["type"]
