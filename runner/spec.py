"""The AgentRun resource as the runner reads it: the same YAML a user would ``kubectl apply``.

``load_agentrun(path)`` parses and validates a file before anything runs; a bad file raises
:class:`SpecError` whose message names the offending field (``spec.budget.max_tokens: ...``).
The CRD schema in ``manifests/`` mirrors these models; field names are camelCase as Kubernetes
API conventions ask, except the budget keys, which keep the product's names (``max_iterations``,
``max_tokens``, ``max_duration_ms``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .snapshot import Budget
from .storable import storable

API_VERSION = "agentfast.dev/v1alpha1"
KIND = "AgentRun"


class SpecError(ValueError):
    """An AgentRun that cannot run. ``str(err)`` is one line per problem, each naming its field."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SecretKeyRef(_Spec):
    """A key of a Kubernetes Secret in the AgentRun's namespace."""

    name: str = Field(min_length=1)
    key: str = Field(min_length=1)


class ModelSpec(_Spec):
    """Which model to talk to, through an OpenAI-compatible Chat Completions endpoint.

    Exactly one of ``baseURL`` (a real endpoint) or ``script`` (the built-in scripted model,
    served over HTTP on localhost by the runner itself) must be set.
    """

    name: str = Field(min_length=1, description="model name sent to the endpoint")
    baseURL: str | None = Field(None, description="e.g. https://api.openai.com/v1 or http://vllm:8000/v1")
    apiKeyEnv: str = Field("OPENAI_API_KEY", description="environment variable holding the API key (from a Secret in the cluster)")
    apiKeySecretRef: SecretKeyRef | None = Field(None, description="in a cluster: the Secret key the operator exposes to the runner as apiKeyEnv")
    script: str | None = Field(None, description="name of a bundled script or path to a script YAML for the scripted model")
    timeoutSeconds: float = Field(60.0, gt=0)
    maxRetries: int = Field(4, ge=0, description="retries on 429, 5xx and connection errors, with exponential backoff")
    temperature: float | None = None

    @model_validator(mode="after")
    def _one_endpoint(self) -> "ModelSpec":
        if bool(self.baseURL) == bool(self.script):
            raise ValueError("set exactly one of baseURL (a real endpoint) or script (the scripted model)")
        return self


class ToolSpec(_Spec):
    """A tool the agent may call: a Python callable importable as ``module:attr``."""

    name: str = Field(min_length=1, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    ref: str = Field(description="module:attr of a function decorated with @agentfast.runner.tools.tool")
    requiresApproval: bool | None = Field(None, description="gate every call on a human decision; default: the tool's own declaration")
    idempotent: bool | None = Field(None, description="safe to re-run with the same idempotency key; default: the tool's own declaration")

    @field_validator("ref")
    @classmethod
    def _ref_shape(cls, v: str) -> str:
        if ":" not in v or not all(v.split(":", 1)):
            raise ValueError(f"must be module:attr, got {v!r}")
        return v


class GraphSpec(_Spec):
    """For the LangGraph adapter: a compiled graph, or a factory returning one."""

    ref: str = Field(description="module:attr of a StateGraph builder or a factory")


REASON_MAX_CHARS = 1024
RESULT_MAX_CHARS = 4096
DECISIONS = ("approve", "deny", "complete")


class InvalidDecision(ValueError):
    """A decision that cannot be recorded as given (``str(err)`` says why and what to give)."""


def _storable(text: str) -> str:
    # Postgres text cannot hold U+0000 and UTF-8 cannot encode a lone surrogate: each becomes U+FFFD.
    return "".join("\ufffd" if ch == "\x00" or "\ud800" <= ch <= "\udfff" else ch for ch in text)


def check_decision(decision: str, reason: str | None, result: str | None) -> tuple[str | None, str | None]:
    """Validate one human decision; returns ``(reason, result)`` as they are to be stored.

    ``approve``: the call runs (``reason`` an optional note). ``deny``: the call does not run and
    the model reads ``reason``, which is required (a denial without one tells the model nothing).
    ``complete``: the call's effect already happened; ``result`` (required, JSON text, kept
    verbatim) is what the model reads as the call's result. ``result`` is refused for the others.
    Limits: reason 1024 characters, result 4096. NUL and lone surrogates become U+FFFD.
    Raises InvalidDecision. The one home of these rules: the store, the CLI, ``spec.approvals``.
    """
    if decision not in DECISIONS:
        raise InvalidDecision(f"decision must be one of {', '.join(DECISIONS)}, got {decision!r}")
    if reason is not None:
        reason = _storable(reason)
        if not reason.strip():
            reason = None
        elif len(reason) > REASON_MAX_CHARS:
            raise InvalidDecision(f"the reason is {len(reason)} characters; at most {REASON_MAX_CHARS}")
    if decision == "deny" and reason is None:
        raise InvalidDecision("a denial needs a reason: the model reads it as the call's result (e.g. --reason 'customer withdrew')")
    if decision == "complete":
        if result is None or not result.strip():
            raise InvalidDecision("complete needs the call's result as JSON text, e.g. --result '{\"voucher\": \"V-100\"}'")
        if len(result) > RESULT_MAX_CHARS:
            raise InvalidDecision(f"the result is {len(result)} characters; at most {RESULT_MAX_CHARS}")
        try:
            json.loads(result)
        except ValueError as err:
            raise InvalidDecision(f"the result must be JSON text (an object, array, string in quotes, number...): {err}") from None
        result = _storable(result)
    elif result is not None:
        raise InvalidDecision(f"a result is given only with complete, not with {decision}")
    return reason, result


class ApprovalDecision(_Spec):
    """One entry of ``spec.approvals`` (the rules of :func:`check_decision`)."""

    decision: Literal["approve", "deny", "complete"]
    reason: str | None = Field(None, max_length=REASON_MAX_CHARS)
    result: str | None = Field(None, max_length=RESULT_MAX_CHARS, description="complete: the call's result as JSON text")

    @model_validator(mode="after")
    def _valid(self) -> "ApprovalDecision":
        check_decision(self.decision, self.reason, self.result)
        return self


class BudgetSpec(Budget):
    model_config = ConfigDict(extra="forbid")
    classifier: str = Field("heuristic", description="'heuristic', 'none', or module:attr of a classifier")


class AgentRunSpec(_Spec):
    adapter: Literal["vanilla", "langgraph"] = "vanilla"
    model: ModelSpec
    systemPrompt: str = Field("", max_length=64 * 1024)
    input: str = Field(min_length=1, max_length=256 * 1024, description="the user's request")
    tools: list[ToolSpec] = Field(default_factory=list)
    graph: GraphSpec | None = None
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    approvals: dict[str, ApprovalDecision] = Field(default_factory=dict)

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ToolSpec]) -> list[ToolSpec]:
        names = [t.name for t in tools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tool names must be unique, repeated: {', '.join(dupes)}")
        return tools

    @model_validator(mode="after")
    def _adapter_needs(self) -> "AgentRunSpec":
        if self.adapter == "langgraph" and self.graph is None:
            raise ValueError("adapter langgraph needs spec.graph.ref")
        return self


class Metadata(_Spec):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    namespace: str = Field("default", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    uid: str | None = None


class AgentRun(_Spec):
    """A whole AgentRun document. ``status`` is ignored when read from a file."""

    model_config = ConfigDict(extra="allow")
    apiVersion: Literal["agentfast.dev/v1alpha1"]
    kind: Literal["AgentRun"]
    metadata: Metadata
    spec: AgentRunSpec


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".") or "(document)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}")
    return "\n".join(lines)


def parse_agentrun(doc: Any, *, check_imports: bool = True) -> AgentRun:
    """Validate one AgentRun document (a dict, as YAML or the API server gives it), its text
    made storable first (:func:`agentfast.runner.storable.storable`).

    With ``check_imports`` every ``spec.tools[i].ref`` (and ``spec.graph.ref``) is imported, so
    an unknown tool fails here, before anything runs. Raises SpecError.
    """
    if not isinstance(doc, dict):
        raise SpecError(f"(document): expected a mapping with apiVersion, kind, metadata, spec; got {type(doc).__name__}")
    # NUL and lone surrogates (a YAML "\0" or "\udcff") become U+FFFD here, as the store would
    # write them (runner/storable.py): pydantic cannot measure a string holding a lone surrogate.
    doc = storable(doc)
    try:
        run = AgentRun.model_validate(doc)
    except ValidationError as err:
        raise SpecError(_format_errors(err)) from None
    if check_imports:
        problems = []
        for i, t in enumerate(run.spec.tools):
            try:
                resolve_ref(t.ref)
            except (ImportError, AttributeError) as err:
                problems.append(f"spec.tools[{i}].ref: unknown tool {t.name!r}: {err}")
        if run.spec.graph is not None:
            try:
                resolve_ref(run.spec.graph.ref)
            except (ImportError, AttributeError) as err:
                problems.append(f"spec.graph.ref: {err}")
        if problems:
            raise SpecError("\n".join(problems))
    return run


def load_agentrun(path: str | Path, *, check_imports: bool = True) -> AgentRun:
    """Read and validate an AgentRun YAML file (one document). Raises SpecError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"{path}: cannot read: {err.strerror}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    if len(docs) != 1:
        raise SpecError(f"{path}: expected exactly one AgentRun document, found {len(docs)}")
    return parse_agentrun(docs[0], check_imports=check_imports)


def resolve_ref(ref: str) -> Any:
    """Import ``module:attr`` (attr may be dotted). Raises ImportError or AttributeError."""
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ImportError(f"cannot import module {module_name!r} ({err.msg})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
