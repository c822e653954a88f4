"""The AgentRun and ModelConfig resources as the runner reads them: the same YAML a user would ``kubectl apply``.

``load_agentrun(path)`` parses and validates a file before anything runs; a bad file raises
:class:`SpecError` whose message names the offending field (``spec.budget.max_tokens: ...``).
A run on a real endpoint names a ModelConfig (an admin's: URL, key Secret, models, limits,
prices); :func:`resolve_model_config` copies its non-secret part into the run's ``modelConfig``.
The CRD schemas in ``charts/agentfast/crds/`` mirror these models; field names are camelCase as Kubernetes
API conventions ask, except the budget keys, which keep the product's names (``max_iterations``,
``max_tokens``, ``max_duration_ms``).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The rules of a decision live in .decisions, so that the store (which enforces them) need not import this module.
from . import boundedjson
from .decisions import DECISIONS, REASON_MAX_CHARS, REPLY_MAX_CHARS, RESULT_MAX_CHARS, InvalidDecision, check_decision  # noqa: F401
from .errors import SettingError, missing_extra
from .errors import SpecError as SpecError  # its home is errors.py; raised and imported from here
from .launch import arg_refusal, command_refusal, env_refusal, env_value_refusal
from .names import API_VERSION as API_VERSION  # the Literals below must say the same (tests/test_names.py)
from .names import KIND as KIND
from .names import MODELCONFIG_KIND
from .snapshot import Budget, Prices
from .storable import storable

if TYPE_CHECKING:
    from types import ModuleType

    from agentfast.testing.scripted import Script

log = logging.getLogger("agentfast.spec")

#: Largest AgentRun file the CLI reads (a Kubernetes object is capped near 1.5 MiB anyway).
MAX_FILE_BYTES = 1024 * 1024
#: ``module:attr``, both dotted Python identifiers: nothing else is ever imported.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
REF_PATTERN = rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$"
#: The call id a run gives each tool call (``runner/journal.py``): the keys of ``spec.approvals``.
CALL_ID_PATTERN = r"^call-[0-9]+-[0-9]+(-rerun[0-9]+)?$"
#: Longest retention a run may ask for after it ended (10 years), seconds.
MAX_TTL_S = 315_360_000
#: Longest wall-clock deadline a run may ask for (``spec.activeDeadlineSeconds``): a year, seconds.
MAX_DEADLINE_S = 31_536_000
#: Largest spec.budget.max_cost a run may ask for, in its prices' currency (the CRD's maximum).
MAX_COST = 1_000_000
#: Decisions one AgentRun can carry in ``spec.approvals`` over its life (the CRD's maxProperties).
MAX_APPROVALS = 128
#: At most this many entries in spec.replies (each answers one question of the run).
MAX_REPLIES = 64
#: The runner's variable holding the model key: the operator sets it from the Secret key the run's
#: ModelConfig names (``apiKeySecretRef``), and the local CLI reads it from the environment. No
#: spec names a variable: nothing a run's author writes reaches the runner's environment.
MODEL_API_KEY_ENV = "AGENTFAST_MODEL_API_KEY"
#: Sent as the key to an endpoint whose ModelConfig names no Secret (a local vLLM, Ollama): the
#: ``openai`` client refuses an empty key, and a keyless endpoint ignores the header.
NO_KEY = "none"
#: A model name (``gpt-4o-mini``, ``meta-llama/Llama-3.1-8B-Instruct``, ``llama3:8b``, ``ft:gpt-4o:org:x:id``).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9._:/@+]*$"
#: An endpoint's base URL: http or https, a host name or [IPv6], an optional port and path; no
#: user info, query or fragment. Which hosts a runner may reach is the egress NetworkPolicy's job.
BASE_URL_PATTERN = r"^https?://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[^\s?#]*)?$"
#: Model names one ModelConfig may allow.
MAX_CONFIG_MODELS = 64
#: spec.model fields an AgentRun had before ModelConfig: now an admin's (issue 12 item 4).
MOVED_TO_MODELCONFIG = ("baseURL", "apiKeyEnv", "apiKeySecretRef", "timeoutSeconds", "maxRetries")
#: A Secret name: a DNS-1123 subdomain (a bad one would keep the runner pod from ever starting).
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: A bundled script's name (``testing/scripts/NAME.yaml``): what a cluster accepts in ``spec.model.script``.
SCRIPT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
#: Module prefixes a cluster allows in refs when its admin configured none (the chart's default).
DEFAULT_ALLOWED_MODULES = ("agentfast.runner.examples",)
ALLOWED_MODULES_ENV = "AGENTFAST_ALLOWED_MODULES"
#: The admin's MCP servers (JSON {name: url}) and the programs a stdio MCP server may be (docs/mcp.md).
MCP_SERVERS_ENV = "AGENTFAST_MCP_SERVERS"
MCP_COMMANDS_ENV = "AGENTFAST_MCP_ALLOWED_COMMANDS"
#: The variable names a run may give a stdio MCP server in a cluster (the chart's mcp.allowedEnv).
MCP_ENV_ENV = "AGENTFAST_MCP_ALLOWED_ENV"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SecretKeyRef(_Spec):
    """A key of a Kubernetes Secret in the AgentRun's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)
    key: str = Field(min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN)


class ModelSpec(_Spec):
    """Which model a run talks to: ``name`` and exactly one of ``config`` or ``script``.

    ``config`` names a ModelConfig in the run's namespace (:class:`ModelConfig`, owned by an
    admin): the endpoint, the Secret holding its key, the model names it allows and the request
    limits are its, never the AgentRun's, so a run's author cannot choose a URL or a Secret.
    ``script`` is the bundled scripted model, served over HTTP on localhost by the runner itself.
    """

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=MODEL_NAME_PATTERN,
        description="model name sent to the endpoint; with config, one of the ModelConfig's models",
    )
    config: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="name of a ModelConfig in the run's namespace (its endpoint, key and limits)",
    )
    script: str | None = Field(
        None, max_length=4096, description="name of a bundled script (in a cluster, only that) or, locally, path to a script YAML"
    )
    temperature: float | None = Field(None, ge=0, le=2)
    prices: ModelPrices | None = Field(
        None,
        description="with script only: what the scripted model's tokens count as, per million (cost and"
        " spec.budget.max_cost in tests and demos); a real endpoint's prices are its ModelConfig's",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if bool(self.config) == bool(self.script):
            raise ValueError("set exactly one of config (a ModelConfig's name: a real endpoint) or script (the scripted model)")
        if self.config and self.prices is not None:
            raise ValueError(
                "spec.model.prices: only for the scripted model (spec.model.script); a real endpoint's prices are"
                f" its ModelConfig's (spec.prices of ModelConfig {self.config!r}), which an admin sets"
            )
        return self


class ModelPrices(Prices):
    """What a model's tokens cost, per million, in ``currency`` (cost accounting: ``status.cost``,
    ``spec.budget.max_cost``). The snapshot's :class:`~agentfast.runner.snapshot.Prices` with the
    bounds a document may ask for (the CRD's); its ``cost`` is the one computation of a cost."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    promptPerMillionTokens: float = Field(ge=0, le=1_000_000)
    completionPerMillionTokens: float = Field(ge=0, le=1_000_000)
    currency: str = Field("USD", min_length=3, max_length=3, pattern=r"^[A-Z]{3}$")


class ModelConfigSpec(_Spec):
    """An OpenAI-compatible Chat Completions endpoint, as an admin configures it.

    ``baseURL``: the API root (``https://api.openai.com/v1``, ``http://vllm.models:8000/v1``).
    ``apiKeySecretRef``: the Secret key (in the ModelConfig's namespace) the operator mounts in
    the runner as ``AGENTFAST_MODEL_API_KEY``; absent for an endpoint without a key.
    ``models``: the model names an AgentRun may ask for (1 to 64, distinct). Limits per request:
    ``timeoutSeconds`` (one HTTP attempt), ``maxRetries`` (on 408/409/429/5xx and connection
    errors, with backoff), ``maxTokensPerRequest`` (sent as ``max_completion_tokens``).
    ``prices``: per million tokens, carried into each run's registered document.
    """

    baseURL: str = Field(min_length=1, max_length=2048, description="pattern: BASE_URL_PATTERN")
    apiKeySecretRef: SecretKeyRef | None = None
    models: list[str] = Field(min_length=1, max_length=MAX_CONFIG_MODELS)
    timeoutSeconds: float = Field(60.0, gt=0, le=3600)
    maxRetries: int = Field(4, ge=0, le=20)
    maxTokensPerRequest: int | None = Field(None, ge=1, le=1_000_000)
    prices: ModelPrices | None = None

    @field_validator("baseURL")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.fullmatch(BASE_URL_PATTERN, v):
            shown = v if len(v) <= 80 else v[:80] + "..."
            raise ValueError(
                f"must be an http or https URL with a host, no user info, query or fragment (e.g. https://api.openai.com/v1), not {shown!r}"
            )
        return v

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: list[str]) -> list[str]:
        bad = [m for m in models if not (0 < len(m) <= 256 and re.match(MODEL_NAME_PATTERN, m))]
        if bad:
            raise ValueError(
                f"model names are 1 to 256 characters of letters, digits and -._:/@+ (first a letter or digit), not {bad[0][:64]!r}"
            )
        dupes = sorted({m for m in models if models.count(m) > 1})
        if dupes:
            raise ValueError(f"model names must be distinct, repeated: {', '.join(dupes)}")
        return models


class ResolvedModelConfig(ModelConfigSpec):
    """The ModelConfig a run was registered with: its spec (no secret: the Secret's name and key,
    never its value) and which object and version it came from. Written into the run's document
    in Postgres by whoever registers the run (the operator, ``agentfast run``), so a resumed run
    talks to the endpoint it started with; never accepted from an AgentRun file."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)
    uid: str | None = Field(None, max_length=128)
    resourceVersion: str | None = Field(None, max_length=128)
    generation: int | None = Field(None, ge=0)


class ToolSpec(_Spec):
    """A tool the agent may call: a Python callable importable as ``module:attr``."""

    name: str = Field(min_length=1, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    ref: str = Field(max_length=512, description="module:attr of a function decorated with @agentfast.runner.tools.tool")
    requiresApproval: bool | None = Field(
        None,
        description="gate every call on a human decision; default: the tool's own declaration. A spec can add a gate, never remove one",
    )
    idempotent: bool | None = Field(
        None,
        description="safe to re-run with the same idempotency key; default: the tool's own declaration. false can be added, "
        "true on a tool declared idempotent=False is refused",
    )

    @field_validator("ref")
    @classmethod
    def _ref_shape(cls, v: str) -> str:
        return _check_ref_shape(v)


#: An MCP server's name in ``spec.mcpServers`` (the prefix of its tools' names: ``NAME_tool``).
MCP_SERVER_NAME_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9-]{0,31}$"
#: Most MCP servers one run may use, and most arguments of a stdio command.
MAX_MCP_SERVERS = 8
MAX_MCP_ARGS = 32
#: Most variables a spec may add to one stdio MCP server's environment.
MAX_MCP_ENV = 32


class McpToolOverride(_Spec):
    """``spec.mcpServers[i].tools.NAME``: one MCP tool's declarations, over its annotations'
    defaults (docs/mcp.md): ``requiresApproval`` true or false (an annotation is a hint from the
    server, not a gate of agentfast's: a spec may lift the gate ``destructiveHint`` gave), and
    ``idempotent`` false only (true on a tool the server does not mark idempotent or read-only is
    refused: a blind re-run could repeat its effect)."""

    requiresApproval: bool | None = None
    idempotent: bool | None = None


class McpServerSpec(_Spec):
    """``spec.mcpServers[i]``: an MCP server whose tools the agent may call (docs/mcp.md), through
    exactly one of ``command`` (a stdio server: argv of a program in the runner image, started
    by the tool host; in a cluster allowed by the chart's ``mcp.allowedCommands``; ``env`` never
    names a variable that changes what it loads or runs, runner/launch.py, and in a cluster only
    the chart's ``mcp.allowedEnv``),
    ``serverRef`` (a streamable HTTP server an admin named: the chart's ``mcp.servers``, or
    locally ``AGENTFAST_MCP_SERVERS``) or ``url`` (streamable HTTP, local runs only: a cluster
    refuses it). Its tools are named ``NAME_TOOL`` for the model."""

    name: str = Field(pattern=MCP_SERVER_NAME_PATTERN, description="the server's name here; its tools are NAME_tool")
    command: list[str] | None = Field(
        None, min_length=1, max_length=MAX_MCP_ARGS, description="stdio: argv of a program in the runner image"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_MCP_ENV,
        description="stdio: variables added to the server's environment (never one that changes what it loads or runs: docs/mcp.md)",
    )
    serverRef: str | None = Field(
        None, pattern=MCP_SERVER_NAME_PATTERN, description="streamable HTTP: a server the cluster's admin named (mcp.servers)"
    )
    url: str | None = Field(None, max_length=2048, description="streamable HTTP URL; local runs only")
    tools: dict[str, McpToolOverride] = Field(default_factory=dict, max_length=64)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        given = [k for k in ("command", "serverRef", "url") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of command (stdio), serverRef or url (streamable HTTP); got {given or 'none'}")
        if self.env and self.command is None:
            raise ValueError("env is for a stdio server (command) only")
        for i, arg in enumerate(self.command or []):
            why = arg_refusal(arg)
            if why is not None:
                raise ValueError(f"command[{i}]: {why}")
        # Built in, whatever an admin allows: no variable that makes the program load or run
        # other code (runner/launch.py); a cluster also asks for the admin's list (check_cluster_policy).
        for name, value in self.env.items():
            why = env_refusal(name) or env_value_refusal(value)
            if why is not None:
                raise ValueError(f"env.{name[:64]}: {why}")
        if any(len(k) > 128 for k in self.tools):
            raise ValueError("tools: MCP tool names are at most 128 characters")
        if self.url is not None and not re.fullmatch(BASE_URL_PATTERN, self.url):
            raise ValueError(
                f"url: must be an http or https URL with a host, no user info, query or fragment, not {self.url[:80]!r}"
            )
        return self


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


class ApprovalDecision(_Spec):
    """One entry of ``spec.approvals`` (the rules of :func:`check_decision`)."""

    decision: Literal["approve", "deny", "complete"]
    reason: str | None = Field(None, max_length=REASON_MAX_CHARS)
    result: str | None = Field(None, max_length=RESULT_MAX_CHARS, description="complete: the call's result, JSON or plain text")
    decidedBy: str = Field(
        min_length=1,
        max_length=512,
        description="the decider's own user name; in a cluster the admission policy checks it against the requesting user",
    )
    argumentsDigest: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="the digest of the arguments the decider was shown (status.pendingApprovals[].argumentsDigest; G13)",
    )

    @model_validator(mode="after")
    def _valid(self) -> ApprovalDecision:
        check_decision(self.decision, self.reason, self.result)
        return self


class UserReply(_Spec):
    """One entry of ``spec.replies``: the user's answer to the model's question ``callId`` (an
    ``ask_user`` call that ``status.pendingApprovals`` lists; docs/conversation.md). The list is
    append-only (CRD rule) and each question takes one reply (write-once, like a decision)."""

    callId: str = Field(pattern=CALL_ID_PATTERN, max_length=64, description="the question's call id, e.g. call-3-0")
    text: str | None = Field(None, min_length=1, max_length=REPLY_MAX_CHARS, description="the reply; the model reads it verbatim")
    end: bool = Field(
        False,
        description="true instead of text: the person ends the conversation at this question; the run ends"
        " Succeeded (reason EndedByUser) and the model is not asked again",
    )
    repliedBy: str = Field(
        min_length=1,
        max_length=512,
        description="your own user name; in a cluster the admission policy checks it against the requesting user",
    )

    @model_validator(mode="after")
    def _valid(self) -> UserReply:
        if self.end:
            if self.text is not None:
                raise ValueError("a reply either has text or ends the conversation (end: true), not both")
            return self
        if self.text is None:
            raise ValueError("a reply needs its text (or end: true to end the conversation)")
        check_decision("reply", None, self.text)
        return self


class BudgetSpec(Budget):
    model_config = ConfigDict(extra="forbid")
    # The same limits as Budget, with maxima (the CRD's): a spec cannot ask for an unbounded run.
    max_iterations: int = Field(50, gt=0, le=10_000, description="model calls allowed in the run")
    max_tokens: int = Field(150_000, gt=0, le=100_000_000, description="prompt + completion tokens allowed")
    max_duration_ms: int = Field(300_000, gt=0, le=604_800_000, description="active run time allowed, ms (at most 7 days)")
    max_cost: float | None = Field(
        None,
        gt=0,
        le=MAX_COST,
        description="cost allowed, in the currency of the model's prices (its ModelConfig's spec.prices, or"
        " spec.model.prices for the scripted model); unset: no cost limit. A model without prices cannot have one",
    )
    classifier: str = Field(
        "none",
        max_length=512,
        description="'none' (the declared budget applies), 'heuristic' (may lower it for a short request), or module:attr"
        " of a classifier",
    )

    @field_validator("classifier")
    @classmethod
    def _classifier_shape(cls, v: str) -> str:
        return v if v in ("heuristic", "none") else _check_ref_shape(v)

    def limits(self) -> Budget:
        """The limits alone, as the snapshot keeps them (without ``classifier``)."""
        return Budget(**self.model_dump(include=set(Budget.model_fields)))


#: A label key (``kubernetes.io/os``, ``pool``): an optional DNS-subdomain prefix and ``/``, then a name of 1-63 characters.
LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
#: A CPU or memory quantity in the plain forms (``500m``, ``2``, ``0.5``, ``128Mi``, ``1G``): no exponent, no sign.
QUANTITY_PATTERN = r"^[0-9]{1,9}(\.[0-9]{1,6})?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$"
#: A container image reference: [registry[:port]/]path[:tag][@sha256:digest], path components in
#: lower case (the grammar of github.com/distribution/reference, sha256 digests only). ``..`` and
#: empty components cannot occur, so a prefix match on ``/`` boundaries means what it says.
_IMG_DOMAIN = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]{1,5})?"
_IMG_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_PATTERN = (
    rf"^(?:{_IMG_DOMAIN}/)?{_IMG_COMPONENT}(?:/{_IMG_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)
#: An allow-list entry that is a path prefix (``registry.example.com/team-a/``): it ends with ``/``.
IMAGE_PREFIX_PATTERN = rf"^{_IMG_DOMAIN}(?:/{_IMG_COMPONENT})*/$"
MAX_IMAGE_CHARS = 512
#: Tolerations the operator itself sets on every runner pod (a lost node is detected in 20 s): a run cannot restate them.
OPERATOR_TOLERATION_KEYS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
#: Bounds of spec.runner (the CRD's maxItems/maxProperties): enough to place a pod, small enough
#: that the CEL immutability check stays cheap and the AgentRun small (G9).
MAX_SELECTOR_LABELS = 32
MAX_TOLERATIONS = 32
MAX_TERMS = 8
MAX_EXPRESSIONS = 8
MAX_VALUES = 32

_LabelKey = Field(min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN)


class ResourceList(_Spec):
    """CPU and memory quantities of a runner container (``cpu: 500m``, ``memory: 1Gi``)."""

    cpu: str | None = Field(None, max_length=32, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(None, max_length=32, pattern=QUANTITY_PATTERN)


class RunnerResources(_Spec):
    """A run's requests and limits, cpu and memory only (no GPUs, no ephemeral storage: an admin's)."""

    requests: ResourceList | None = None
    limits: ResourceList | None = None


class Toleration(_Spec):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = Field(None, max_length=317, pattern=LABEL_KEY_PATTERN)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63, pattern=LABEL_VALUE_PATTERN)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = Field(None, ge=0, le=31_536_000)

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists has no value")
        if self.tolerationSeconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds is given only with effect NoExecute")
        return self


class SelectorRequirement(_Spec):
    """One ``matchExpressions`` entry of a node selector: In/NotIn take values, Exists/DoesNotExist
    none, Gt/Lt one integer (the API server's own rules: a pod breaking them would be refused)."""

    key: str = _LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] = Field(default_factory=list, max_length=MAX_VALUES)

    @model_validator(mode="after")
    def _values(self) -> SelectorRequirement:
        if any(len(v) > 253 for v in self.values):
            raise ValueError("values are at most 253 characters")
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        if self.operator in ("Gt", "Lt") and (len(self.values) != 1 or not re.fullmatch(r"-?[0-9]{1,18}", self.values[0])):
            raise ValueError(f"operator {self.operator} takes exactly one integer value")
        return self


class LabelSelectorRequirement(SelectorRequirement):
    """One ``matchExpressions`` entry of a label selector (no Gt/Lt)."""

    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]


class NodeSelectorTerm(_Spec):
    """Node selector terms are ORed; the requirements inside one are ANDed. ``matchFields`` takes
    only ``metadata.name`` with In or NotIn."""

    matchExpressions: list[SelectorRequirement] = Field(default_factory=list, max_length=MAX_EXPRESSIONS)
    matchFields: list[SelectorRequirement] = Field(default_factory=list, max_length=MAX_EXPRESSIONS)

    @field_validator("matchFields")
    @classmethod
    def _fields(cls, reqs: list[SelectorRequirement]) -> list[SelectorRequirement]:
        if any(r.key != "metadata.name" or r.operator not in ("In", "NotIn") for r in reqs):
            raise ValueError("matchFields takes key metadata.name with operator In or NotIn only")
        return reqs


class NodeSelector(_Spec):
    nodeSelectorTerms: list[NodeSelectorTerm] = Field(min_length=1, max_length=MAX_TERMS)


class PreferredSchedulingTerm(_Spec):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(_Spec):
    requiredDuringSchedulingIgnoredDuringExecution: NodeSelector | None = None
    preferredDuringSchedulingIgnoredDuringExecution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=MAX_TERMS
    )


class LabelSelector(_Spec):
    matchLabels: dict[str, str] = Field(default_factory=dict, max_length=MAX_SELECTOR_LABELS)
    matchExpressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=MAX_EXPRESSIONS)

    @field_validator("matchLabels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        return _check_labels(labels)


class PodAffinityTerm(_Spec):
    labelSelector: LabelSelector | None = None
    namespaceSelector: LabelSelector | None = None
    namespaces: list[str] = Field(default_factory=list, max_length=16)
    topologyKey: str = _LabelKey

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, names: list[str]) -> list[str]:
        if any(not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", n) or len(n) > 63 for n in names):
            raise ValueError("namespaces are DNS labels of at most 63 characters")
        return names


class WeightedPodAffinityTerm(_Spec):
    weight: int = Field(ge=1, le=100)
    podAffinityTerm: PodAffinityTerm


class PodAffinity(_Spec):
    requiredDuringSchedulingIgnoredDuringExecution: list[PodAffinityTerm] = Field(default_factory=list, max_length=MAX_TERMS)
    preferredDuringSchedulingIgnoredDuringExecution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=MAX_TERMS
    )


class Affinity(_Spec):
    """A pod's affinity (core/v1 Affinity), with bounded lists."""

    nodeAffinity: NodeAffinity | None = None
    podAffinity: PodAffinity | None = None
    podAntiAffinity: PodAffinity | None = None


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    for k, v in labels.items():
        if len(k) > 317 or not re.match(LABEL_KEY_PATTERN, k):
            raise ValueError(f"{k[:64]!r} is not a label key (e.g. kubernetes.io/os)")
        if len(v) > 63 or not re.match(LABEL_VALUE_PATTERN, v):
            raise ValueError(f"the value of {k[:64]!r} is not a label value (at most 63 letters, digits, -_.)")
    return labels


class RunnerSpec(_Spec):
    """Where and in what the run's runner pod runs: the fields a team may set on its own runs.

    Each field replaces the chart's ``runner.*`` default of the same name, per key (see
    ``operator/workload.py``, ``runner_settings``): ``resources`` per requests/limits entry,
    ``nodeSelector`` per label, ``tolerations`` are added to the chart's, ``affinity``,
    ``priorityClassName`` and ``image`` replace the chart's. Nothing here reaches the pod's
    environment, volumes, security context, command or service account. The image must be one
    the admin allows (the chart's ``runner.allowedImages``; checked by the operator by name only,
    never pulled or read: G12).
    """

    image: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_IMAGE_CHARS,
        pattern=IMAGE_PATTERN,
        description="the runner image: one of the cluster's runner.allowedImages",
    )
    resources: RunnerResources | None = None
    nodeSelector: dict[str, str] = Field(default_factory=dict, max_length=MAX_SELECTOR_LABELS)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_TOLERATIONS)
    affinity: Affinity | None = None
    priorityClassName: str | None = Field(None, min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)

    @field_validator("nodeSelector")
    @classmethod
    def _node_selector(cls, labels: dict[str, str]) -> dict[str, str]:
        return _check_labels(labels)

    @field_validator("tolerations")
    @classmethod
    def _tolerations(cls, tolerations: list[Toleration]) -> list[Toleration]:
        for t in tolerations:
            if not t.key:
                raise ValueError(
                    "a run's toleration names a key: one without tolerates every taint (only an admin's chart may say so)"
                )
            if t.key in OPERATOR_TOLERATION_KEYS:
                raise ValueError(
                    f"{t.key} is the operator's own toleration (a lost node is detected in 20 s); a run cannot change it"
                )
        return tolerations

    @field_validator("priorityClassName")
    @classmethod
    def _priority(cls, name: str | None) -> str | None:
        if name is not None and name.startswith("system-"):
            raise ValueError(f"{name!r}: the system- priority classes are the cluster's own, not a run's")
        return name


class ForkFrom(_Spec):
    """``spec.forkFrom``: start this run from another run's state at one of its committed
    iterations (docs/fork.md): its transcript, journal and budget state up to ``iteration``; tool
    results up to there are reused, never re-executed. ``run``: the source's name, in this run's
    namespace (``NAME``, or ``NAMESPACE/NAME`` with this run's own namespace: another namespace is
    refused). Honoured once, where the run is registered (``agentfast run FILE``, the operator)."""

    run: str = Field(
        min_length=1,
        max_length=317,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="the source run's name (same namespace)",
    )
    iteration: int = Field(ge=0, le=10_000, description="the source's committed iteration to start from")


def _repeated(names: list[str]) -> list[str]:
    """The names that occur more than once in ``names``, sorted."""
    return sorted({n for n in names if names.count(n) > 1})


class AgentRunSpec(_Spec):
    adapter: Literal["vanilla", "langgraph"] = "vanilla"
    model: ModelSpec
    systemPrompt: str = Field("", max_length=64 * 1024)
    input: str = Field(min_length=1, max_length=256 * 1024, description="the user's request")
    tools: list[ToolSpec] = Field(default_factory=list)
    mcpServers: list[McpServerSpec] = Field(
        default_factory=list, max_length=MAX_MCP_SERVERS, description="MCP servers whose tools the agent may call (docs/mcp.md)"
    )
    graph: GraphSpec | None = None
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    ttlSecondsAfterFinished: int | None = Field(
        None,
        ge=0,
        le=MAX_TTL_S,
        description="once the run ended and its AgentRun is gone, delete its rows after this many seconds"
        " (0: keep them; default: the cluster's operator.ttlSecondsAfterFinished)",
    )
    suspendAfter: int | None = Field(
        None,
        ge=0,
        le=30 * 86400,
        description="seconds a run waiting for a human keeps its runner pod; then the pod exits and a"
        " decision starts a new runner (0: keep it; default: the chart's runner.suspendAfterSeconds)",
    )
    activeDeadlineSeconds: int | None = Field(
        None,
        ge=1,
        le=MAX_DEADLINE_S,
        description="wall-clock limit, s, counted from the run's registration, waiting for humans"
        " included; past it the run ends Failed (DeadlineExceeded). Unset: none",
    )
    cancel: bool = Field(
        False,
        description="true: stop the run at its next safe point (no new tool call), keep everything"
        " done, end it Cancelled. Can be set once the run exists, never taken back",
    )
    approvals: dict[str, ApprovalDecision] = Field(default_factory=dict, max_length=MAX_APPROVALS)
    conversation: bool = Field(
        False,
        description="a human in the conversation (docs/conversation.md): the model may call ask_user and"
        " end_conversation, and every message of the model that calls no tool ends its turn: the run is"
        " WaitingForInput until the person replies or ends the conversation",
    )
    conversationIdleTimeout: int | None = Field(
        None,
        ge=1,
        le=30 * 86400,
        description="seconds the run waits for the person's reply in a conversation; past it the conversation"
        " ends and the run ends Succeeded (reason IdleTimeout). Unset: it waits as long as it takes",
    )
    replies: list[UserReply] = Field(default_factory=list, max_length=MAX_REPLIES)
    forkFrom: ForkFrom | None = Field(
        None, description="start from another run's state at one of its iterations (docs/fork.md); immutable"
    )
    runner: RunnerSpec | None = Field(
        None, description="the runner pod's image, resources and placement (chart defaults otherwise)"
    )

    @field_validator("approvals")
    @classmethod
    def _call_ids(cls, approvals: dict[str, ApprovalDecision]) -> dict[str, ApprovalDecision]:
        bad = [k for k in approvals if not re.match(CALL_ID_PATTERN, k)]
        if bad:
            shown = ", ".join(repr(k[:48]) for k in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise ValueError(
                f"keys must be call ids as status.pendingApprovals shows them (e.g. call-2-0, call-1-0-rerun1), not {shown}"
            )
        return approvals

    @field_validator("replies")
    @classmethod
    def _one_reply_each(cls, replies: list[UserReply]) -> list[UserReply]:
        dupes = _repeated([r.callId for r in replies])
        if dupes:
            raise ValueError(f"each question takes one reply; answered twice: {', '.join(dupes)}")
        return replies

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ToolSpec]) -> list[ToolSpec]:
        dupes = _repeated([t.name for t in tools])
        if dupes:
            raise ValueError(f"tool names must be unique, repeated: {', '.join(dupes)}")
        return tools

    @field_validator("mcpServers")
    @classmethod
    def _unique_servers(cls, servers: list[McpServerSpec]) -> list[McpServerSpec]:
        dupes = _repeated([m.name for m in servers])
        if dupes:
            raise ValueError(f"MCP server names must be unique, repeated: {', '.join(dupes)}")
        return servers

    @model_validator(mode="after")
    def _adapter_needs(self) -> AgentRunSpec:
        if self.adapter == "langgraph" and self.graph is None:
            raise ValueError("adapter langgraph needs spec.graph.ref")
        if self.conversation and any(t.name in ("ask_user", "end_conversation") for t in self.tools):
            taken = next(t.name for t in self.tools if t.name in ("ask_user", "end_conversation"))
            raise ValueError(f"spec.tools: {taken} is a built-in tool of spec.conversation; give yours another name")
        if self.conversationIdleTimeout is not None and not self.conversation:
            raise ValueError("spec.conversationIdleTimeout needs spec.conversation: true")
        if self.model.script and self.budget.max_cost is not None and self.model.prices is None:
            raise ValueError(
                "spec.budget.max_cost: the scripted model has no prices, so the run's cost cannot be counted;"
                " set spec.model.prices (per million tokens) or remove max_cost"
            )
        return self


class Metadata(_Spec):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    namespace: str = Field("default", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    uid: str | None = None


class AgentRun(_Spec):
    """A whole AgentRun document. ``status`` is ignored when read from a file.

    ``modelConfig`` is not the author's: it is the ModelConfig ``spec.model.config`` named, as it
    was when the run was registered (:func:`resolve_model_config`), kept in the run's document in
    Postgres. A file or a custom resource never carries it (:func:`load_agentrun` refuses it; the
    operator builds the document from ``spec`` alone).
    """

    model_config = ConfigDict(extra="allow")
    apiVersion: Literal["agentfast.dev/v1alpha1"]
    kind: Literal["AgentRun"]
    metadata: Metadata
    spec: AgentRunSpec
    modelConfig: ResolvedModelConfig | None = None

    @model_validator(mode="after")
    def _config_matches(self) -> AgentRun:
        fork = self.spec.forkFrom
        if fork is not None and "/" in fork.run and fork.run.split("/", 1)[0] != self.metadata.namespace:
            raise ValueError(
                f"spec.forkFrom.run: {fork.run!r} is in another namespace; a run forks only from a run of its own"
                f" namespace ({self.metadata.namespace})"
            )
        if self.modelConfig is not None:
            check_model_allowed(self.spec.model, self.modelConfig)
            check_cost_budget(self.spec, self.modelConfig)
        return self

    def fork_source(self) -> str | None:
        """The run id (``NS/NAME``) of ``spec.forkFrom.run``, or None without ``forkFrom``."""
        fork = self.spec.forkFrom
        if fork is None:
            return None
        return fork.run if "/" in fork.run else f"{self.metadata.namespace}/{fork.run}"

    def prices(self) -> ModelPrices | None:
        """The prices this run's tokens are charged at: its ModelConfig's ``spec.prices`` (as
        registered) or, for the scripted model, ``spec.model.prices``; None when there are none
        (or when the ModelConfig is not resolved yet)."""
        if self.modelConfig is not None:
            return self.modelConfig.prices
        return self.spec.model.prices


class ModelConfig(_Spec):
    """A whole ModelConfig document (``kind: ModelConfig``), as ``kubectl apply`` takes it."""

    model_config = ConfigDict(extra="allow")
    apiVersion: Literal["agentfast.dev/v1alpha1"]
    kind: Literal["ModelConfig"]
    metadata: Metadata
    spec: ModelConfigSpec


def check_model_allowed(model: ModelSpec, config: ModelConfigSpec | ResolvedModelConfig, config_name: str | None = None) -> None:
    """Raise ValueError unless ``model`` (an AgentRun's ``spec.model``) may use ``config``: it names
    that ModelConfig (``spec.model.config``) and asks for one of its ``models``. The message names
    both the run's field and the ModelConfig. ``config_name``: the ModelConfig's name when ``config``
    is a bare spec."""
    name = config_name or getattr(config, "name", None)
    if model.config != name:
        raise ValueError(f"spec.model.config: names {model.config!r}, but the run's ModelConfig is {name!r}")
    if model.name not in config.models:
        shown = ", ".join(config.models[:10]) + (f" and {len(config.models) - 10} more" if len(config.models) > 10 else "")
        raise ValueError(
            f"spec.model.name: model {model.name!r} is not one ModelConfig {name!r} allows (its spec.models: {shown})"
        )


def check_cost_budget(spec: AgentRunSpec, config: ModelConfigSpec | ResolvedModelConfig, config_name: str | None = None) -> None:
    """Raise ValueError (its message starts ``spec.budget.max_cost:``) when ``spec`` asks for a
    cost limit (``spec.budget.max_cost``) and ``config``, the ModelConfig its model uses, has no
    ``prices``: its cost could not be counted, and a limit that is never checked would be a silent
    one. The scripted model's rule (``spec.model.prices``) is :class:`AgentRunSpec`'s own."""
    if spec.budget.max_cost is not None and config.prices is None:
        name = config_name or getattr(config, "name", None)
        raise ValueError(
            f"spec.budget.max_cost: ModelConfig {name!r} has no prices (its spec.prices), so the run's cost cannot"
            " be counted; ask its admin to set prices, or remove max_cost"
        )


def resolve_model_config(run: AgentRun, config: ModelConfig) -> AgentRun:
    """``run`` with ``modelConfig`` set from ``config``, the ModelConfig its ``spec.model.config``
    names (same name and namespace): its spec and ``metadata.uid``, ``resourceVersion``,
    ``generation`` when present. Only data is copied: nothing it names is read or fetched.

    Raises SpecError naming the field when the names differ, ``spec.model.name`` is not one of
    the ModelConfig's ``models`` (``spec.model.name: model 'x' is not one ModelConfig 'y' allows ...``)
    or the run sets ``spec.budget.max_cost`` and the ModelConfig has no ``prices``
    (:func:`check_cost_budget`).
    """
    meta = config.metadata.model_extra or {}
    if config.metadata.namespace != run.metadata.namespace:
        raise SpecError(
            f"spec.model.config: ModelConfig {config.metadata.name!r} is in namespace {config.metadata.namespace!r},"
            f" the run in {run.metadata.namespace!r}: a run uses a ModelConfig of its own namespace"
        )
    try:
        resolved = ResolvedModelConfig(
            **config.spec.model_dump(),
            name=config.metadata.name,
            uid=config.metadata.uid,
            resourceVersion=meta.get("resourceVersion"),
            generation=meta.get("generation"),
        )
        check_model_allowed(run.spec.model, resolved)
        check_cost_budget(run.spec, resolved)
    except ValidationError as err:
        raise SpecError(_format_errors(err, prefix=f"ModelConfig {config.metadata.name!r}: ")) from None
    except ValueError as err:
        raise SpecError(str(err)) from None
    return run.model_copy(update={"modelConfig": resolved})


def parse_modelconfig(doc: Any) -> ModelConfig:
    """Validate one ModelConfig document (a dict, as YAML or the API server gives it). Raises
    SpecError whose lines start ``ModelConfig 'NAME': `` and name the field (``spec.baseURL: ...``)."""
    if not isinstance(doc, dict):
        raise SpecError(f"(document): expected a ModelConfig mapping, got {type(doc).__name__}")
    doc = storable(doc)
    try:
        return ModelConfig.model_validate(doc)
    except ValidationError as err:
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
        raise SpecError(_format_errors(err, prefix=f"ModelConfig {str(name)[:64]!r}: ")) from None


def _format_errors(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".") or "(document)"
        msg = e["msg"].removeprefix("Value error, ")
        if (
            e["type"] == "extra_forbidden"
            and tuple(e["loc"][-3:-1]) == ("spec", "model")
            and e["loc"][-1] in MOVED_TO_MODELCONFIG
        ):
            msg = (
                "not a field of an AgentRun: the endpoint, the Secret holding its key and the request limits belong to a"
                " ModelConfig, which an admin owns; name one in spec.model.config"
            )
        if msg.startswith(("spec.model", "spec.budget")):  # such a message names its field itself
            where, _, msg = msg.partition(": ")
        lines.append(f"{prefix}{where}: {msg}")
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


def import_refs(run: AgentRun, *, tools: bool = True) -> None:
    """Import every ``spec.tools[i].ref`` (unless ``tools`` is False) and ``spec.graph.ref``, so an
    unknown tool fails before anything runs. User code runs here: never call it in the operator
    (G12); a runner leaves the tools to its tool host (``runner/toolhost.py``, G11). Raises SpecError."""
    problems = []
    for i, t in enumerate(run.spec.tools if tools else []):
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


@dataclass(frozen=True)
class ResolvedRun:
    """An AgentRun checked, once, for what :func:`parse_agentrun` leaves to run time, with what the
    checks loaded: ``run``; ``script``, the scripted model's parsed script (``scripted.Script``), or
    None for a run on an endpoint. Made by :func:`resolve`; the CLI checks a run once and hands this
    to the model client (``model.model_from_spec(..., script=)``) instead of loading it again.
    The tools are not in it: only the tool host imports them (``runner/toolhost.py``, G11)."""

    run: AgentRun
    script: Script | None


def resolve(run: AgentRun) -> ResolvedRun:
    """Check ``run`` for what ``parse_agentrun`` leaves to run time, before it is registered or
    started: the classifier resolves, the model script loads. Without these a bad file was found
    only after ``create_run``: a traceback and a run record left behind. Raises SpecError naming
    the field.

    Here, beside ``parse_agentrun``, so a caller checks a run without importing the runner's loop;
    what it uses is imported only when it is called (``budget`` imports this module).
    """
    from .budget import get_classifier

    get_classifier(run.spec.budget.classifier)
    script: Script | None = None
    if run.spec.model.script:  # only then: an endpoint's run never imports the scripted server
        scripted = scripted_module()
        try:
            script = scripted.load_script(run.spec.model.script)
        except ValueError as e:
            raise SpecError(f"spec.model.script: {e}") from None
    return ResolvedRun(run, script)


NO_SCRIPTED_MODEL = (
    "spec.model.script: this install has no scripted model: it is test support (agentfast.testing),"
    " which the production image leaves out; name a ModelConfig (spec.model.config) instead, or run"
    " an image with test support (the Dockerfile's testing target)"
)


def scripted_module() -> ModuleType:
    """:mod:`agentfast.testing.scripted` (the scripted model's server, loader and bundled scripts),
    imported on first use: the runtime's one way to it, so a run on an endpoint, and the production
    image, never need test support. Raises SpecError (:data:`NO_SCRIPTED_MODEL`) where it is not
    installed."""
    try:
        from agentfast.testing import scripted
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("agentfast.testing"):
            raise
        raise SpecError(NO_SCRIPTED_MODEL) from None
    return scripted


def bundled_scripts() -> list[str]:
    """Names of the scripted model's bundled scripts (``testing/scripts/*.yaml``); empty where
    test support is not installed."""
    try:
        names: list[str] = scripted_module().bundled_scripts()
    except SpecError:
        return []
    return names


def load_agentrun(path: str | Path, *, check_imports: bool = True) -> AgentRun:
    """Read and validate an AgentRun file: one AgentRun document and, beside it, the ModelConfig
    documents its ``spec.model.config`` may name (the local single-file form). Raises SpecError.

    Refused before parsing (:mod:`agentfast.runner.safeyaml`, every document): a file over 1 MiB
    (:data:`MAX_FILE_BYTES`) and YAML anchors or aliases (an alias bomb never expands). Then: a
    document of another kind (a Secret: locally the key comes from ``AGENTFAST_MODEL_API_KEY``),
    other than exactly one AgentRun, an AgentRun carrying ``modelConfig`` (agentfast writes it),
    a ``spec.model.config`` naming no ModelConfig of the file, a model its ModelConfig does not
    allow. The AgentRun returned has ``modelConfig`` resolved (:func:`resolve_model_config`).
    """
    from .safeyaml import UnsafeYaml, load_all, read_text

    try:
        docs = load_all(read_text(path, max_bytes=MAX_FILE_BYTES), str(path))
    except UnsafeYaml as err:
        raise SpecError(str(err)) from None
    kinds = [d.get("kind") if isinstance(d, dict) else None for d in docs]
    if len(docs) > 1:
        others = [f"document {i + 1} (kind {k!r})" for i, k in enumerate(kinds) if k not in (KIND, MODELCONFIG_KIND)]
        if others:
            raise SpecError(
                f"{path}: {', '.join(others[:3])}: an AgentRun file holds one AgentRun and the ModelConfigs it names,"
                f" nothing else (locally the model key comes from the environment variable {MODEL_API_KEY_ENV})"
            )
    runs = [d for d, k in zip(docs, kinds) if k == KIND] if len(docs) > 1 else docs
    if len(runs) != 1:
        raise SpecError(f"{path}: expected exactly one AgentRun document, found {len(runs)}")
    doc = runs[0]
    if isinstance(doc, dict) and "modelConfig" in doc:
        raise SpecError(
            "modelConfig: not a field of an AgentRun file: agentfast copies it from the ModelConfig spec.model.config names"
        )
    run = parse_agentrun(doc, check_imports=check_imports)
    if run.spec.model.config is None:
        return run
    configs = [parse_modelconfig(d) for d, k in zip(docs, kinds) if k == MODELCONFIG_KIND]
    return resolve_from_file(run, configs, str(path))


def resolve_from_file(run: AgentRun, configs: list[ModelConfig], path: str) -> AgentRun:
    """``run`` with ``modelConfig`` resolved (:func:`resolve_model_config`) from the one of
    ``configs`` (the ModelConfig documents of the file ``path``) its ``spec.model.config`` names
    in its namespace; ``run`` itself for the scripted model. Raises SpecError when the file holds
    none or several of that name, and as :func:`resolve_model_config` does."""
    wanted = run.spec.model.config
    if wanted is None:
        return run
    found = [c for c in configs if c.metadata.name == wanted and c.metadata.namespace == run.metadata.namespace]
    if not found:
        have = ", ".join(repr(c.metadata.name) for c in configs) or "none"
        raise SpecError(
            f"spec.model.config: names ModelConfig {wanted!r}, but {path} holds no ModelConfig of that name in"
            f" namespace {run.metadata.namespace!r} (it holds: {have}); put the ModelConfig document beside the AgentRun"
        )
    if len(found) > 1:
        raise SpecError(f"spec.model.config: {path} holds {len(found)} ModelConfigs named {wanted!r}; keep one")
    return resolve_model_config(run, found[0])


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
        hint = missing_extra(err)  # e.g. a LangGraph graph without the langgraph extra: say which to install
        raise ImportError(
            f"cannot import module {module_name!r}: {hint}" if hint else f"cannot import module {module_name!r} ({err.msg})"
        ) from None
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


def mcp_servers_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The MCP servers an admin named (``AGENTFAST_MCP_SERVERS``: JSON ``{"NAME": "URL"}``; the
    operator sets it in a runner pod from the chart's ``mcp.servers``, for the run's own refs; a
    local user may set it for ``serverRef``), {} when unset or empty. Raises SettingError on a
    value that is not such an object of http(s) URLs."""
    raw = ((os.environ if env is None else env).get(MCP_SERVERS_ENV) or "").strip()
    if not raw:
        return {}
    try:
        doc = boundedjson.loads(raw, what=MCP_SERVERS_ENV)
    except ValueError as err:
        raise SettingError(f"{MCP_SERVERS_ENV} is not JSON: {err}") from None
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and re.match(MCP_SERVER_NAME_PATTERN, k) and isinstance(v, str) and re.fullmatch(BASE_URL_PATTERN, v)
        for k, v in doc.items()
    ):
        raise SettingError(f'{MCP_SERVERS_ENV}: expected a JSON object {{"NAME": "http(s)://host:port/path"}} of server names')
    return doc


def mcp_commands_from_env(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The programs a stdio MCP server may be started with in a cluster
    (``AGENTFAST_MCP_ALLOWED_COMMANDS``, comma-separated argv[0] values; the chart's
    ``mcp.allowedCommands``); () when unset."""
    value = (os.environ if env is None else env).get(MCP_COMMANDS_ENV, "")
    return tuple(" ".join(p.split()) for p in value.split(",") if p.strip())


def mcp_env_from_env(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The variable names a run may give a stdio MCP server in a cluster
    (``AGENTFAST_MCP_ALLOWED_ENV``, comma-separated; the chart's ``mcp.allowedEnv``); () when
    unset: no variable. Raises SettingError naming a listed name no run may ever set
    (:func:`agentfast.runner.launch.env_refusal`: the built-in list wins over the admin's)."""
    value = (os.environ if env is None else env).get(MCP_ENV_ENV, "")
    names = tuple(p.strip() for p in value.split(",") if p.strip())
    for name in names:
        why = env_refusal(name)
        if why is not None:
            raise SettingError(f"{MCP_ENV_ENV} (mcp.allowedEnv): {name[:64]!r}: {why}")
    return names


def mcp_policy_problems(
    run: AgentRun, servers: Mapping[str, str], mcp_commands: tuple[str, ...], mcp_env: tuple[str, ...]
) -> list[str]:
    """The ``spec.mcpServers`` part of :func:`check_cluster_policy`, one line per problem ([] when
    none): also checked by the tool host itself before it starts any server (runner/mcp.py)."""
    problems = []
    for i, m in enumerate(run.spec.mcpServers):
        where = f"spec.mcpServers[{i}]"
        if m.url is not None:
            problems.append(
                f"{where}.url: a cluster takes an MCP server's URL from its admin, not from the AgentRun: name one of"
                f" mcp.servers with serverRef ({', '.join(sorted(servers)) or 'none configured'})"
            )
        if m.serverRef is not None and m.serverRef not in servers:
            problems.append(
                f"{where}.serverRef: {m.serverRef!r} is not an MCP server this cluster names (mcp.servers:"
                f" {', '.join(sorted(servers)) or 'none'})"
            )
        why = command_refusal(m.command, mcp_commands) if m.command is not None else None
        if why is not None:
            problems.append(f"{where}.command: {why}")
        for name, value in m.env.items():
            # The built-in refusals again (a run built without validation), then the admin's list.
            why = env_refusal(name) or env_value_refusal(value)
            if why is None and name not in mcp_env:
                why = f"not a variable this cluster lets a run set (mcp.allowedEnv: {', '.join(mcp_env) or 'none'})"
            if why is not None:
                problems.append(f"{where}.env.{name[:64]}: {why}")
    return problems


def check_cluster_policy(
    run: AgentRun,
    allowed_modules: tuple[str, ...],
    bundled_scripts: list[str],
    *,
    mcp_servers: Mapping[str, str] | None = None,
    mcp_commands: tuple[str, ...] = (),
    mcp_env: tuple[str, ...] = (),
) -> None:
    """The checks a cluster makes on an AgentRun without importing or reading anything it names (G12).

    Every ref (tools, graph, classifier) must already have the ``module:attr`` shape (the model
    checks that) and its module must be inside ``allowed_modules`` (the chart's
    ``runner.allowedModules``); ``spec.model.script`` must be one of ``bundled_scripts`` (names,
    never paths: file paths are a local-CLI feature). Whether a ref resolves is learned only in
    the runner pod. Each ``spec.mcpServers[i]``: a ``serverRef`` must name one of ``mcp_servers``
    (the chart's ``mcp.servers``: the URL is the admin's), a ``command`` must be allowed by one
    of ``mcp_commands`` (the chart's ``mcp.allowedCommands``: a program, or a program with its
    leading arguments, compared word by word as written; an interpreter only with the script its
    entry names, a launcher only exactly as written: :func:`agentfast.runner.launch.command_refusal`),
    each name of its ``env`` must be one of ``mcp_env`` (the chart's ``mcp.allowedEnv``; the
    built-in refusals of runner/launch.py were applied when the spec was read), and ``url`` is
    refused (a run's author never chooses where a runner pod connects). Raises SpecError, one
    line per problem.
    """
    problems = mcp_policy_problems(run, mcp_servers or {}, mcp_commands, mcp_env)
    refs = [(f"spec.tools[{i}].ref", t.ref) for i, t in enumerate(run.spec.tools)]
    if run.spec.graph is not None:
        refs.append(("spec.graph.ref", run.spec.graph.ref))
    if run.spec.budget.classifier not in ("heuristic", "none"):
        refs.append(("spec.budget.classifier", run.spec.budget.classifier))
    allowed_text = ", ".join(allowed_modules) or "none"
    for where, ref in refs:
        module = ref.partition(":")[0]
        if not module_allowed(module, allowed_modules):
            problems.append(
                f"{where}: module {module!r} is not in the modules this cluster allows (runner.allowedModules: {allowed_text})"
            )
    script = run.spec.model.script
    if script is not None and not bundled_scripts:
        problems.append(NO_SCRIPTED_MODEL)
    elif script is not None and (not re.match(SCRIPT_NAME_PATTERN, script) or script not in bundled_scripts):
        shown = script if len(script) <= 64 else script[:64] + "..."
        problems.append(
            f"spec.model.script: {shown!r} is not a bundled script; in a cluster only these are: {', '.join(bundled_scripts) or 'none'}"
        )
    if problems:
        raise SpecError("\n".join(problems))


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``(repository, tag, digest)`` of an image reference (``reg.io:5000/a/b:1.2@sha256:...``):
    the tag is after the last ``:`` that follows the last ``/`` (a registry's port is not a tag)."""
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1 :], digest or None
    return rest, None, digest or None


def image_allowed(image: str, allowed: tuple[str, ...], own_image: str) -> bool:
    """True when ``image`` may run a runner: it is the cluster's own runner image (``own_image``,
    the chart's ``image``), or it matches an entry of ``allowed`` (the chart's
    ``runner.allowedImages``). An entry ending with ``/`` allows every image under that path
    (``reg.io/team-a/`` allows ``reg.io/team-a/tools:1``, not ``reg.io/team-a-x/tools``); an entry
    with a tag or a digest allows exactly that reference; an entry without either allows that
    repository at any tag or digest (``reg.io/team-a/tools`` allows ``reg.io/team-a/tools:2``,
    not ``reg.io/team-a/tools-x``). Strings are compared as written, never resolved or pulled
    (``agentfast:dev`` and ``docker.io/library/agentfast:dev`` are different entries): an image
    that is not well-formed (:data:`IMAGE_PATTERN`) is never allowed."""
    if len(image) > MAX_IMAGE_CHARS or not re.match(IMAGE_PATTERN, image):
        return False
    if image == own_image:
        return True
    repository, _, _ = split_image(image)
    for entry in allowed:
        if entry.endswith("/"):
            if image.startswith(entry):
                return True
        elif split_image(entry)[1:] != (None, None):
            if image == entry:
                return True
        elif repository == entry:
            return True
    return False


def check_allowed_images(entries: Any, where: str) -> tuple[str, ...]:
    """``entries`` (an admin's allow-list) as a tuple, each entry an image reference or a path
    prefix ending with ``/``. Raises ValueError naming ``where`` and the bad entry."""
    if not isinstance(entries, list) or len(entries) > 256:
        raise ValueError(f"{where}: expected a list of at most 256 image references or prefixes ending with /")
    for i, entry in enumerate(entries):
        ok = (
            isinstance(entry, str)
            and len(entry) <= MAX_IMAGE_CHARS
            and (re.match(IMAGE_PREFIX_PATTERN, entry) if entry.endswith("/") else re.match(IMAGE_PATTERN, entry))
        )
        if not ok:
            raise ValueError(
                f"{where}[{i}]: {str(entry)[:80]!r} is neither an image reference (reg.io/team/tools:1.0,"
                " reg.io/team/tools) nor a path prefix ending with / (reg.io/team/)"
            )
    return tuple(entries)


def check_runner_image(run: AgentRun, allowed_images: tuple[str, ...], own_image: str) -> None:
    """Raise SpecError unless the run's ``spec.runner.image`` (when set) is allowed
    (:func:`image_allowed`). Only the name is compared: nothing is pulled or read (G12)."""
    image = run.spec.runner.image if run.spec.runner is not None else None
    if image is not None and not image_allowed(image, allowed_images, own_image):
        listed = ", ".join([own_image, *allowed_images][:8])
        raise SpecError(
            f"spec.runner.image: {image[:128]!r} is not an image this cluster allows for runners (runner.allowedImages: {listed})"
        )
