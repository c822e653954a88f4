"""The checkpoint model: what one committed iteration of a run holds.

Names follow the product text (shared/seeds/durable-execution.txt): ``StateSnapshot``,
``RunContext`` (counters, budget, usage, session), ``Message``, ``PendingToolCall`` with
``executed_sibling_results``. Messages use the OpenAI Chat Completions shape, so a transcript can
be sent to any compatible endpoint as it is.

Every model is pydantic v2. ``StateSnapshot.schema_version`` records the shape a snapshot was
written with; :func:`upgrade_snapshot_dict` lifts an older dict to the current shape before
validation, so a snapshot written by an older release still loads.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Version of the snapshot shape written by this release. Bump it and add a step to
#: ``_UPGRADES`` whenever a field is renamed or its meaning changes.
SCHEMA_VERSION = 2

#: Cancelled: its AgentRun was deleted before the run ended (written by the operator; issue 13).
#: The values of runner/names.py's Phase, in its order (a Literal, for pydantic and mypy;
#: tests/test_names.py keeps the two equal).
Phase = Literal["Pending", "Running", "WaitingForApproval", "WaitingForInput", "Succeeded", "Failed", "Cancelled"]


def now_ms() -> int:
    """Wall-clock time in milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


class _Model(BaseModel):
    # Unknown keys are kept, not dropped: a newer release's field survives a round trip
    # through an older one (the opposite of langgraph#7066, "unknown types dropped silently").
    model_config = ConfigDict(extra="allow")


class ToolCall(_Model):
    """One tool call as the model asked for it.

    ``id`` is the provider's tool-call id. It is *not* unique within a run (some providers reuse
    one across turns), so the runtime keys calls by ``(iteration, position)`` instead.
    ``arguments`` is the raw JSON text the model produced; it may be malformed. An id the
    provider repeated (within a response or across turns) or left empty is replaced before it is
    stored or sent back (:func:`agentfast.runner.model.distinct_tool_call_ids`); ``provider_id``
    then keeps the provider's.
    """

    id: str
    name: str
    arguments: str = "{}"
    provider_id: str | None = Field(None, description="the id as the provider sent it, when the runtime had to make it unique")


class Message(_Model):
    """A Chat Completions message: ``role`` plus content, tool calls or a tool result."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    refusal: str | None = Field(
        None, description="an assistant's refusal as the provider sent it (also its content when it said nothing else)"
    )

    def answer_text(self) -> str:
        """Every text part of this message as one string, for a one-line summary of a final answer
        (the run's outcome line, ``status``, the AgentRun's ``status.message``/``result``).

        The content, then the refusal on its own line when there is one the content does not
        already say (``"Sure.\nrefusal: I will not ..."``); ``""`` when the message has neither.
        """
        text = self.content or ""
        if self.refusal and self.refusal != self.content:
            text = f"{text}\nrefusal: {self.refusal}" if text else f"refusal: {self.refusal}"
        return text

    def to_openai(self) -> dict[str, Any]:
        """Shape for the ``messages`` parameter of ``chat.completions.create``."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


class Budget(_Model):
    """Limits checked at the top of every iteration (guarantee G7). Key names are the seed's;
    ``max_cost`` (issue 17) is ours: absent (None) means no cost limit, and a snapshot written
    before it existed loads as one without it."""

    max_iterations: int = Field(50, gt=0, description="model calls allowed in the run")
    max_tokens: int = Field(150_000, gt=0, description="prompt + completion tokens allowed")
    max_duration_ms: int = Field(
        300_000, gt=0, description="active run time allowed, ms; time spent waiting for a human is not counted"
    )
    max_cost: float | None = Field(
        None, gt=0, description="cost allowed, in the currency of the run's prices (RunContext.prices); None: no limit"
    )


class Prices(_Model):
    """What a model's tokens cost, per million, in ``currency`` (an ISO 4217 code such as USD).

    A ModelConfig's ``spec.prices`` (``spec.ModelPrices``, the same fields with bounds) or, for the
    scripted model, ``spec.model.prices``. Copied into ``RunContext.prices`` when a run starts (and
    at each takeover, from the run's registered document).
    """

    promptPerMillionTokens: float = Field(ge=0)
    completionPerMillionTokens: float = Field(ge=0)
    currency: str = "USD"

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """What ``prompt_tokens`` and ``completion_tokens`` (counts of tokens) cost at these
        prices, in ``currency``. The one place a cost is computed; it raises nothing."""
        return (prompt_tokens * self.promptPerMillionTokens + completion_tokens * self.completionPerMillionTokens) / 1_000_000


def format_cost(amount: float, currency: str) -> str:
    """``amount`` of ``currency`` as people read it: at least two decimals, at most six, no
    trailing zeros beyond two (``0.0123 USD``, ``0.00015 USD``, ``1.50 EUR``)."""
    text = f"{amount:.6f}".rstrip("0")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')} {currency}"


def spend_summary(ctx: RunContext) -> str:
    """The run's spend against its budget in one line, for the approval prompt, ``agentfast
    status`` and the inbox: ``tokens 3000 / 8000, cost 0.042 / 0.03 USD`` (``ctx.usage`` as
    given: pass a counted context to include lost replies). The cost is ``ctx.cost()`` formatted
    by :func:`format_cost`; without ``max_cost`` it reads ``cost 0.042 USD (no max_cost)``,
    without prices ``cost not counted (no prices)``. Here, not in runner/budget.py (which
    re-exports it), so that readers (status, the inbox) import no spec. Raises nothing."""
    b, u = ctx.budget, ctx.usage
    line = f"tokens {u.total_tokens} / {b.max_tokens}"
    cost = ctx.cost()
    if cost is None or ctx.prices is None:
        return line + ", cost not counted (no prices)"
    currency = ctx.prices.currency
    if b.max_cost is None:
        return line + f", cost {format_cost(cost, currency)} (no max_cost)"
    limit = format_cost(b.max_cost, currency).removesuffix(f" {currency}")
    return line + f", cost {format_cost(cost, currency).removesuffix(f' {currency}')} / {limit} {currency}"


class Counters(_Model):
    """Monotonic counters of one run."""

    iterations: int = 0  # committed iterations (one model call + its tool calls each)
    model_calls: int = 0
    tool_calls: int = 0  # tool executions that returned (ok or error)
    tool_errors: int = 0  # tools that raised, plus calls that could not be made
    malformed_tool_calls: int = 0  # unknown tool or unparseable JSON arguments from the model
    approvals_requested: int = 0
    resumes: int = 0  # times a new process took the run over


class Usage(_Model):
    """Resources consumed so far: tokens as the provider reported them, active time in ms."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    duration_ms: int = 0
    # A reader's figure, never a checkpoint's (always 0 there): of the tokens above, how many
    # model replies were answered and paid for but lost to a crash before their turn was saved
    # (``Store.load_context`` adds their tokens; issue 30 item 4).
    lost_replies: int = Field(
        0, ge=0, exclude=True, description="model replies counted above whose turn a crash lost (readers only; never stored)"
    )

    def plus(self, prompt_tokens: int, completion_tokens: int, replies: int = 0) -> Usage:
        """This usage with ``prompt_tokens`` and ``completion_tokens`` (counts of tokens) added
        and ``replies`` more lost replies among them; ``duration_ms`` as it is. Raises nothing."""
        return self.model_copy(
            update={
                "prompt_tokens": self.prompt_tokens + prompt_tokens,
                "completion_tokens": self.completion_tokens + completion_tokens,
                "total_tokens": self.total_tokens + prompt_tokens + completion_tokens,
                "lost_replies": self.lost_replies + replies,
            }
        )


class Classification(_Model):
    """What the complexity classifier decided, recorded once before the first model call."""

    classifier: str
    label: str
    reason: str
    declared: Budget
    applied: Budget


class Session(_Model):
    """Identity of the run and where it runs."""

    run_uid: str
    adapter: Literal["vanilla", "langgraph"] = "vanilla"
    model: str = ""
    started_at: int = Field(default_factory=now_ms, description="ms since epoch")


class RunStatus(_Model):
    """The run's phase and, when it ended, why."""

    phase: Phase = "Pending"
    reason: str = ""
    message: str = ""


class AttemptTrace(_Model):
    """The span of one runner process's attempt at a run, as its takeover commit recorded it:
    enough for the next attempt to record it, should the process die before it could
    (``runner/tracing.py``). ``span_id``: 16 hex digits (W3C); ``started_at_ns``: ns since the
    Unix epoch; ``runner_id``: the claim's (``runner/liveness.py``), to tell its left-behind
    heartbeat row; ``iteration``: the iteration whose span was open when the checkpoint was
    committed (a pause inside it), 0 when none was."""

    span_id: str
    started_at_ns: int
    resume: int = 0
    epoch: int = 0
    runner_id: str = ""
    iteration: int = Field(0, description="the iteration open at this checkpoint (0: none), and since when (ns)")
    iteration_started_at_ns: int = 0


class TraceContext(_Model):
    """The run's one trace across process deaths (W3C hex ids: ``trace_id`` 32 digits,
    ``root_span_id`` 16): chosen once, by the first runner that traced the run, kept in every
    checkpoint after. ``attempt``: the attempt that committed this checkpoint (None when none did)."""

    trace_id: str
    root_span_id: str
    started_at_ns: int = Field(0, description="ns since the Unix epoch: the first traced attempt's start, the root span's")
    attempt: AttemptTrace | None = None


class TraceLink(_Model):
    """A span of another trace that a run's spans link to (an OpenTelemetry span link; W3C hex
    ids: ``trace_id`` 32 digits, ``span_id`` 16). A fork's: its source's root span, so the fork
    has a trace of its own that names where it came from (``Store.fork_run``)."""

    trace_id: str
    span_id: str
    #: What the link is: ``forked_from`` (the only kind so far).
    kind: str = "forked_from"
    #: The run linked to (``NAMESPACE/NAME``) and the iteration the fork was made at.
    run_id: str = ""
    iteration: int = 0


class RunContext(_Model):
    """Counters, budget, usage and session (the seed's ``RunContext``), plus the run's status.

    ``prices``: what the run's model charges, copied from the run's document when it starts and
    at every takeover (its ModelConfig's ``spec.prices``, or the scripted model's
    ``spec.model.prices``; a fork's are its own model's, never its source's); None when the
    model has none. Kept here so the checkpoint alone says what the run has cost (:meth:`cost`)
    to every reader: the budget check, the operator's ``status.cost``, ``agentfast status``.
    The cost itself is not stored: it is ``usage`` times ``prices``, computed when read.
    ``trace``: the run's trace ids when it is traced (:class:`TraceContext`), else None.
    ``trace_link``: a fork's link to its source's trace (:class:`TraceLink`; None when not a
    fork or the source was not traced): the fork's spans are in a trace of its own, linked to it.
    """

    session: Session
    budget: Budget = Field(default_factory=Budget)
    counters: Counters = Field(default_factory=Counters)
    usage: Usage = Field(default_factory=Usage)
    classification: Classification | None = None
    status: RunStatus = Field(default_factory=RunStatus)
    turns_accounted: int = Field(0, description="last iteration whose model tokens are in usage")
    prices: Prices | None = None
    # Optional with a default: a checkpoint without it (tracing off, or an older release) loads as
    # one without a trace, so no schema version bump (a new optional field changes no old meaning).
    trace: TraceContext | None = None
    trace_link: TraceLink | None = None

    def cost(self) -> float | None:
        """What the run's tokens so far (``usage``) cost at ``prices``, in ``prices.currency``;
        None when the run has no prices (its cost is not known). Raises nothing."""
        if self.prices is None:
            return None
        return self.prices.cost(self.usage.prompt_tokens, self.usage.completion_tokens)


class ToolResult(_Model):
    """A finished tool call, as the journal persisted it."""

    call_id: str  # the run-unique call id, "call-<iteration>-<position>"
    position: int
    tool_call_id: str  # the provider's id, echoed back in the tool message
    tool_name: str
    content: str
    is_error: bool = False
    error_kind: Literal["tool_raised", "malformed", "denied"] | None = None
    idempotency_key: str
    # Who settled the call when its tool body did not (or not knowingly) produce the result:
    # "human:<who>" (``agentfast complete``), "recovery_check" (the tool's own check). None: the tool ran.
    recorded_by: str | None = None

    def to_message(self) -> Message:
        return Message(role="tool", content=self.content, tool_call_id=self.tool_call_id, name=self.tool_name)


class AwaitedCall(_Model):
    """One call that awaits a human decision: a gated call, a non-idempotent call that was in
    flight when a runner died, or the model's question to the user (``ask_user``: awaits a
    reply) (``reason``). ``call_id`` is the id a human decides under: the
    journal's call id, or ``<call id>-rerun<n>`` for an in-flight re-run."""

    call_id: str
    iteration: int
    position: int
    tool_call: ToolCall
    idempotency_key: str
    reason: Literal["requires_approval", "in_flight_not_idempotent", "awaiting_input"] = "requires_approval"
    requested_at: int = Field(default_factory=now_ms)


class PendingToolCall(AwaitedCall):
    """The batch a paused run waits on (the seed's shape), and its siblings that already ran (G5).

    ``awaiting``: every call of the batch that awaits a human, in the model's order; all are
    decidable at once, in any order, and the run goes on when each is decided. The top-level
    call fields repeat ``awaiting[0]`` (the seed's single pending call). A pending dict written
    before schema 2 has no ``awaiting``: it awaited exactly its own call, and loads that way.
    """

    executed_sibling_results: list[ToolResult] = Field(default_factory=list)
    awaiting: list[AwaitedCall] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _one_awaited_call(cls, data: Any) -> Any:
        return _with_awaiting(data) if isinstance(data, dict) else data

    @classmethod
    def of(cls, awaiting: list[AwaitedCall], executed_sibling_results: list[ToolResult]) -> PendingToolCall:
        """The pending record of a batch whose calls ``awaiting`` (non-empty, model order) wait."""
        if not awaiting:
            raise ValueError("a pending batch awaits at least one call")
        return cls(**awaiting[0].model_dump(), awaiting=awaiting, executed_sibling_results=executed_sibling_results)

    @property
    def call_ids(self) -> list[str]:
        """The ids of every awaited call, in the model's order."""
        return [a.call_id for a in self.awaiting]


def _with_awaiting(pending: dict[str, Any]) -> dict[str, Any]:
    # Schema 1 (one pending call) to 2 (``awaiting``, every call of the batch): the old record
    # awaited exactly its own call. Copied first: validating must not rewrite the caller's data.
    if pending.get("awaiting") or "call_id" not in pending:
        return pending
    own = {k: pending[k] for k in AwaitedCall.model_fields if k in pending}
    return {**pending, "awaiting": [own]}


class StateSnapshot(_Model):
    """One checkpoint: everything needed to continue a run at the exact step.

    ``messages`` is authoritative for loop-owning adapters; ``sdk_state`` is opaque (G8): the
    runtime stores and returns a graph-native SDK's own state without reading it.
    ``saved_at`` is ms since the Unix epoch.
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str
    context: RunContext
    messages: list[Message] = Field(default_factory=list)
    sdk_state: dict[str, Any] = Field(default_factory=dict)
    pending: PendingToolCall | None = None
    saved_at: int = Field(default_factory=now_ms)

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        return upgrade_snapshot_dict(data) if isinstance(data, dict) else data


def _upgrade_0_to_1(d: dict[str, Any]) -> dict[str, Any]:
    # Version 0 (pre-release) had no schema_version, kept the budget at the top level and named
    # the gated call's sibling results ``sibling_results``.
    # Nested dicts are copied before they change: validating must not rewrite the caller's data.
    ctx = d["context"] = dict(d.get("context") or {})
    if "budget" in d:
        ctx.setdefault("budget", d.pop("budget"))
    pending = d.get("pending")
    if isinstance(pending, dict) and "sibling_results" in pending:
        pending = d["pending"] = dict(pending)
        pending.setdefault("executed_sibling_results", pending.pop("sibling_results"))
    return d


def _upgrade_1_to_2(d: dict[str, Any]) -> dict[str, Any]:
    # Version 1 paused on one call at a time; version 2 lists every awaited call of the batch.
    if isinstance(d.get("pending"), dict):
        d["pending"] = _with_awaiting(d["pending"])
    return d


_UPGRADES = {0: _upgrade_0_to_1, 1: _upgrade_1_to_2}


def upgrade_snapshot_dict(data: dict[str, Any]) -> dict[str, Any]:
    """Lift a snapshot dict written by an older release to ``SCHEMA_VERSION``.

    Raises ValueError for a snapshot newer than this release (it cannot be read safely).
    """
    version = int(data.get("schema_version", 0))
    if version > SCHEMA_VERSION:
        raise ValueError(f"snapshot schema_version {version} is newer than this release reads ({SCHEMA_VERSION})")
    data = dict(data)
    while version < SCHEMA_VERSION:
        data = _UPGRADES[version](data)
        version += 1
    data["schema_version"] = SCHEMA_VERSION
    return data


def call_id(iteration: int, position: int) -> str:
    """The run-unique id of a tool call: the key of ``spec.approvals`` and of the journal."""
    return f"call-{iteration}-{position}"


def idempotency_key(run_uid: str, iteration: int, position: int) -> str:
    """The key passed to a tool (G4): unique to one call of one run, stable across resumes."""
    return f"{run_uid}:{iteration}:{position}"
