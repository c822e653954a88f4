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
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .snapshot import Budget
from .storable import storable, storable_text

API_VERSION = "agentfast.dev/v1alpha1"
KIND = "AgentRun"


log = logging.getLogger("agentfast.spec")

#: Largest AgentRun file the CLI reads (a Kubernetes object is capped near 1.5 MiB anyway).
MAX_FILE_BYTES = 1024 * 1024
#: ``module:attr``, both dotted Python identifiers: nothing else is ever imported.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
REF_PATTERN = rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$"
#: The call id a run gives each tool call (``runner/journal.py``): the keys of ``spec.approvals``.
CALL_ID_PATTERN = r"^call-[0-9]+-[0-9]+(-rerun[0-9]+)?$"
#: Decisions one AgentRun can carry in ``spec.approvals`` over its life (the CRD's maxProperties).
MAX_APPROVALS = 128
#: Environment variable names a spec may name for the model key: ``..._API_KEY`` or ``..._TOKEN``,
#: never one of ours (``AGENTFAST_*``): a spec must not be able to set LD_PRELOAD, PYTHONPATH,
#: AGENTFAST_DSN... in the runner pod, nor send one of them to a model endpoint as a key.
API_KEY_ENV_PATTERN = r"^[A-Z][A-Z0-9_]{0,54}_(API_KEY|TOKEN)$"
#: A Secret name: a DNS-1123 subdomain (a bad one would make the runner Job fail for ever).
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: A bundled script's name (``runner/scripts/NAME.yaml``): what a cluster accepts in ``spec.model.script``.
SCRIPT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
#: Module prefixes a cluster allows in refs when its admin configured none (the chart's default).
DEFAULT_ALLOWED_MODULES = ("agentfast.runner.examples",)
ALLOWED_MODULES_ENV = "AGENTFAST_ALLOWED_MODULES"


class SpecError(ValueError):
    """An AgentRun that cannot run. ``str(err)`` is one line per problem, each naming its field."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SecretKeyRef(_Spec):
    """A key of a Kubernetes Secret in the AgentRun's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)
    key: str = Field(min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN)


class ModelSpec(_Spec):
    """Which model to talk to, through an OpenAI-compatible Chat Completions endpoint.

    Exactly one of ``baseURL`` (a real endpoint) or ``script`` (the built-in scripted model,
    served over HTTP on localhost by the runner itself) must be set.
    """

    name: str = Field(min_length=1, description="model name sent to the endpoint")
    baseURL: str | None = Field(None, description="e.g. https://api.openai.com/v1 or http://vllm:8000/v1")
    apiKeyEnv: str = Field("OPENAI_API_KEY", max_length=64, pattern=API_KEY_ENV_PATTERN,
                           description="environment variable holding the API key (from a Secret in the cluster): NAME_API_KEY or NAME_TOKEN, not AGENTFAST_*")
    apiKeySecretRef: SecretKeyRef | None = Field(None, description="in a cluster: the Secret key the operator exposes to the runner as apiKeyEnv")
    script: str | None = Field(None, max_length=4096, description="name of a bundled script (in a cluster, only that) or, locally, path to a script YAML")
    timeoutSeconds: float = Field(60.0, gt=0, le=3600)
    maxRetries: int = Field(4, ge=0, le=20, description="retries on 429, 5xx and connection errors, with exponential backoff")
    temperature: float | None = Field(None, ge=0, le=2)

    @field_validator("apiKeyEnv")
    @classmethod
    def _not_ours(cls, v: str) -> str:
        if v.startswith("AGENTFAST_"):
            raise ValueError(f"{v} is one of agentfast's own variables; name the key's variable e.g. OPENAI_API_KEY")
        return v

    @model_validator(mode="after")
    def _one_endpoint(self) -> "ModelSpec":
        if bool(self.baseURL) == bool(self.script):
            raise ValueError("set exactly one of baseURL (a real endpoint) or script (the scripted model)")
        return self


class ToolSpec(_Spec):
    """A tool the agent may call: a Python callable importable as ``module:attr``."""

    name: str = Field(min_length=1, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    ref: str = Field(max_length=512, description="module:attr of a function decorated with @agentfast.runner.tools.tool")
    requiresApproval: bool | None = Field(
        None, description="gate every call on a human decision; default: the tool's own declaration. A spec can add a gate, never remove one")
    idempotent: bool | None = Field(
        None, description="safe to re-run with the same idempotency key; default: the tool's own declaration. false can be added, "
                          "true on a tool declared idempotent=False is refused")

    @field_validator("ref")
    @classmethod
    def _ref_shape(cls, v: str) -> str:
        return _check_ref_shape(v)


class GraphSpec(_Spec):
    """For the LangGraph adapter: a compiled graph, or a factory returning one."""

    ref: str = Field(max_length=512, description="module:attr of a StateGraph builder or a factory")

    @field_validator("ref")
    @classmethod
    def _ref_shape(cls, v: str) -> str:
        return _check_ref_shape(v)


def _check_ref_shape(v: str) -> str:
    if not re.match(REF_PATTERN, v):
        shown = v if len(v) <= 80 else v[:80] + "..."
        raise ValueError(f"must be module:attr, both dotted Python names (e.g. pkg.tools:refund), got {shown!r}")
    return v


REASON_MAX_CHARS = 1024
RESULT_MAX_CHARS = 4096
DECISIONS = ("approve", "deny", "complete")


class InvalidDecision(ValueError):
    """A decision that cannot be recorded as given (``str(err)`` says why and what to give)."""


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
        reason = storable_text(reason)
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
        result = storable_text(result)
    elif result is not None:
        raise InvalidDecision(f"a result is given only with complete, not with {decision}")
    return reason, result


class ApprovalDecision(_Spec):
    """One entry of ``spec.approvals`` (the rules of :func:`check_decision`)."""

    decision: Literal["approve", "deny", "complete"]
    reason: str | None = Field(None, max_length=REASON_MAX_CHARS)
    result: str | None = Field(None, max_length=RESULT_MAX_CHARS, description="complete: the call's result as JSON text")
    decidedBy: str = Field(min_length=1, max_length=512, description="the decider's own user name; in a cluster the admission policy checks it against the requesting user")

    @model_validator(mode="after")
    def _valid(self) -> "ApprovalDecision":
        check_decision(self.decision, self.reason, self.result)
        return self


class BudgetSpec(Budget):
    model_config = ConfigDict(extra="forbid")
    # The same limits as Budget, with maxima (the CRD's): a spec cannot ask for an unbounded run.
    max_iterations: int = Field(50, gt=0, le=10_000, description="model calls allowed in the run")
    max_tokens: int = Field(150_000, gt=0, le=100_000_000, description="prompt + completion tokens allowed")
    max_duration_ms: int = Field(300_000, gt=0, le=604_800_000, description="active run time allowed, ms (at most 7 days)")
    classifier: str = Field("heuristic", max_length=512, description="'heuristic', 'none', or module:attr of a classifier")

    @field_validator("classifier")
    @classmethod
    def _classifier_shape(cls, v: str) -> str:
        return v if v in ("heuristic", "none") else _check_ref_shape(v)


class AgentRunSpec(_Spec):
    adapter: Literal["vanilla", "langgraph"] = "vanilla"
    model: ModelSpec
    systemPrompt: str = Field("", max_length=64 * 1024)
    input: str = Field(min_length=1, max_length=256 * 1024, description="the user's request")
    tools: list[ToolSpec] = Field(default_factory=list)
    graph: GraphSpec | None = None
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    approvals: dict[str, ApprovalDecision] = Field(default_factory=dict, max_length=MAX_APPROVALS)

    @field_validator("approvals")
    @classmethod
    def _call_ids(cls, approvals: dict[str, ApprovalDecision]) -> dict[str, ApprovalDecision]:
        bad = [k for k in approvals if not re.match(CALL_ID_PATTERN, k)]
        if bad:
            shown = ", ".join(repr(k[:48]) for k in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise ValueError(f"keys must be call ids as status.pendingApprovals shows them (e.g. call-2-0, call-1-0-rerun1), not {shown}")
        return approvals

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

    With ``check_imports`` every ``spec.tools[i].ref`` (and ``spec.graph.ref``) is imported
    (:func:`import_refs`), so an unknown tool fails here, before anything runs. The operator
    passes False: it checks refs only syntactically and against the admin's allow-list
    (:func:`check_cluster_policy`). Raises SpecError.
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
        import_refs(run)
    return run


def import_refs(run: AgentRun) -> None:
    """Import every ``spec.tools[i].ref`` and ``spec.graph.ref``, so an unknown tool fails before
    anything runs. User code runs here: never call it in the operator (G12). Raises SpecError."""
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


def load_agentrun(path: str | Path, *, check_imports: bool = True) -> AgentRun:
    """Read and validate an AgentRun YAML file (one document). Raises SpecError.

    Refused before parsing (:mod:`agentfast.runner.safeyaml`): a file over 1 MiB
    (:data:`MAX_FILE_BYTES`) and YAML anchors or aliases (an alias bomb never expands).
    """
    from .safeyaml import UnsafeYaml, load_all, read_text

    try:
        docs = load_all(read_text(path, max_bytes=MAX_FILE_BYTES), str(path))
    except UnsafeYaml as err:
        raise SpecError(str(err)) from None
    if len(docs) != 1:
        raise SpecError(f"{path}: expected exactly one AgentRun document, found {len(docs)}")
    return parse_agentrun(docs[0], check_imports=check_imports)


def resolve_ref(ref: str) -> Any:
    """Import ``module:attr`` (attr may be dotted). Raises ImportError or AttributeError.

    Called only where user code may run (the CLI, the runner pod), never in the operator (G12).
    Anything the module raises while it is imported or an attribute is read, BaseException
    included (SystemExit, KeyboardInterrupt, GeneratorExit...), becomes an ImportError whose
    message names the module and the exception's type only (its text, which may quote files or
    remote answers, goes to the log): the run fails with InvalidSpec, the process lives on.
    """
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ImportError(f"cannot import module {module_name!r} ({err.msg})") from None
    except BaseException as err:  # noqa: BLE001 - user code: nothing it raises may end the process
        log.warning("importing %s raised %s", module_name, type(err).__name__, exc_info=True)
        raise ImportError(f"importing module {module_name!r} raised {type(err).__name__}") from None
    for part in attr.split("."):
        try:
            found = hasattr(obj, part)
            if found:
                obj = getattr(obj, part)
        except BaseException as err:  # noqa: BLE001 - a module __getattr__ or a property is user code too
            log.warning("reading %s from %s raised %s", attr, module_name, type(err).__name__, exc_info=True)
            raise ImportError(f"reading {attr!r} of module {module_name!r} raised {type(err).__name__}") from None
        if not found:
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
    return obj


def allowed_modules_from_env(env: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """The admin's allow-list of module prefixes (``AGENTFAST_ALLOWED_MODULES``, comma-separated),
    or None when the variable is unset (the local CLI: no list). Set but empty: nothing allowed."""
    value = (os.environ if env is None else env).get(ALLOWED_MODULES_ENV)
    if value is None:
        return None
    return tuple(p.strip() for p in value.split(",") if p.strip())


def module_allowed(module: str, allowed: tuple[str, ...]) -> bool:
    """True when ``module`` is one of ``allowed`` or inside one (``a.b`` allows ``a.b.c``, not ``a.bc``)."""
    return any(module == p or module.startswith(p + ".") for p in allowed)


def check_cluster_policy(run: AgentRun, allowed_modules: tuple[str, ...], bundled_scripts: list[str]) -> None:
    """The checks a cluster makes on an AgentRun without importing or reading anything it names (G12).

    Every ref (tools, graph, classifier) must already have the ``module:attr`` shape (the model
    checks that) and its module must be inside ``allowed_modules`` (the chart's
    ``runner.allowedModules``); ``spec.model.script`` must be one of ``bundled_scripts`` (names,
    never paths: file paths are a local-CLI feature). Whether a ref resolves is learned only in
    the runner pod. Raises SpecError, one line per problem.
    """
    problems = []
    refs = [(f"spec.tools[{i}].ref", t.ref) for i, t in enumerate(run.spec.tools)]
    if run.spec.graph is not None:
        refs.append(("spec.graph.ref", run.spec.graph.ref))
    if run.spec.budget.classifier not in ("heuristic", "none"):
        refs.append(("spec.budget.classifier", run.spec.budget.classifier))
    allowed_text = ", ".join(allowed_modules) or "none"
    for where, ref in refs:
        module = ref.partition(":")[0]
        if not module_allowed(module, allowed_modules):
            problems.append(f"{where}: module {module!r} is not in the modules this cluster allows (runner.allowedModules: {allowed_text})")
    script = run.spec.model.script
    if script is not None and (not re.match(SCRIPT_NAME_PATTERN, script) or script not in bundled_scripts):
        shown = script if len(script) <= 64 else script[:64] + "..."
        problems.append(f"spec.model.script: {shown!r} is not a bundled script; in a cluster only these are: {', '.join(bundled_scripts) or 'none'}")
    if problems:
        raise SpecError("\n".join(problems))
