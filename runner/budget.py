"""Budgets (G7) and the complexity classifier.

:func:`check_budget` runs at the top of every iteration and returns a readable reason when a limit
is reached. The classifier runs once, before the first model call, and may lower the declared
budget for a simple request ("a simple question doesn't carry a research budget"); it never
raises one above what the AgentRun declared. What it decided is recorded in
``RunContext.classification``.

Pluggable: ``spec.budget.classifier`` is ``none`` (default: the declared budget is the one that
applies), ``heuristic`` (opt-in), or ``module:attr`` of a callable ``(AgentRunSpec) -> Classification``.
When a classifier lowered the limit a run fails on, the reason says so: the declared value, the
applied one and how to keep one's own (:func:`check_budget`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .snapshot import Budget, Classification, RunContext, format_cost
from .snapshot import spend_summary as spend_summary  # the spend line, where readers (status, the inbox) find it without the spec
from .spec import AgentRunSpec, SpecError, resolve_ref

Classifier = Callable[[AgentRunSpec], Classification]


def check_budget(ctx: RunContext) -> str | None:
    """None while within budget; otherwise why the run must stop, in words a user understands.

    Limits: ``max_iterations`` (iterations), ``max_tokens`` (prompt + completion tokens),
    ``max_duration_ms`` (active time, ms) and ``max_cost`` (``ctx.cost()``: the tokens so far at
    ``ctx.prices``, in their currency); ``ctx.usage`` as counted (:meth:`RunnerBase.counted_context`:
    replies lost to crashes included, and named in the reason). A ``max_cost`` without prices cannot be checked: the spec
    refuses it, and a context that has it anyway (written by hand) stops the run rather than run
    without its limit. A limit a classifier lowered below the declared one is named as such
    (:func:`lowered_note`). Raises nothing.
    """
    b, c, u = ctx.budget, ctx.counters, ctx.usage
    if c.iterations >= b.max_iterations:
        return (
            f"budget exceeded: max_iterations is {b.max_iterations}{lowered_note(ctx, 'max_iterations')} and the run has"
            f" made {c.iterations} iterations without finishing"
        )
    tokens = _tokens_exceeded(ctx)
    if tokens:
        return tokens
    if u.duration_ms >= b.max_duration_ms:
        return (
            f"budget exceeded: max_duration_ms is {b.max_duration_ms}{lowered_note(ctx, 'max_duration_ms')} and the run has"
            f" been active for {u.duration_ms} ms"
        )
    return _cost_exceeded(ctx)


def check_spend(ctx: RunContext) -> str | None:
    """None while the run's spend is within ``max_tokens`` and ``max_cost``; otherwise why the run
    must stop, in the words of :func:`check_budget`. ``ctx.usage`` as counted (the reply just
    received and replies lost to crashes included). The runner asks it before it would ask a
    person to decide on a call: a run already over either never asks, it ends ``Failed`` with
    this reason first. Raises nothing."""
    return _tokens_exceeded(ctx) or _cost_exceeded(ctx)


def _lost(ctx: RunContext) -> str:
    # Replies a crash lost before their turn was saved were paid for: counted, and said so.
    n = ctx.usage.lost_replies
    return f", {n} of them in model replies lost to crashes" if n else ""


def _tokens_exceeded(ctx: RunContext) -> str | None:
    b, u = ctx.budget, ctx.usage
    if u.total_tokens < b.max_tokens:
        return None
    return (
        f"budget exceeded: max_tokens is {b.max_tokens}{lowered_note(ctx, 'max_tokens')} and the run has used"
        f" {u.total_tokens} tokens{_lost(ctx)}"
    )


def _cost_exceeded(ctx: RunContext) -> str | None:
    b, u = ctx.budget, ctx.usage
    if b.max_cost is None:
        return None
    cost = ctx.cost()
    if cost is None or ctx.prices is None:
        return f"budget cannot be checked: max_cost is {b.max_cost:g} but the run's model has no prices"
    if cost < b.max_cost:
        return None
    currency = ctx.prices.currency
    return (
        f"budget exceeded: max_cost is {format_cost(b.max_cost, currency)}{lowered_note(ctx, 'max_cost')} and the run"
        f" has cost {format_cost(cost, currency)} ({u.prompt_tokens} prompt and {u.completion_tokens} completion"
        f" tokens{_lost(ctx)})"
    )


def lowered_note(ctx: RunContext, limit: str) -> str:
    """`` (lowered from the declared 12 by the heuristic classifier; set spec.budget.classifier:
    none to keep yours)`` when the classifier recorded in ``ctx.classification`` lowered
    ``limit`` (a :class:`Budget` field name) below what the AgentRun declared and ``ctx.budget``
    still holds that lowered value; else ``""``. Raises nothing."""
    cl = ctx.classification
    if cl is None:
        return ""
    applied, declared = getattr(ctx.budget, limit), getattr(cl.declared, limit)
    if declared is None or applied is None or applied >= declared or applied != getattr(cl.applied, limit, applied):
        return ""
    if limit == "max_cost":
        shown = format_cost(declared, ctx.prices.currency) if ctx.prices is not None else f"{declared:g}"
    else:
        shown = str(declared)  # a count: 1000000, never 1e+06
    return (
        f" (lowered from the declared {shown} by the {cl.classifier} classifier; set spec.budget.classifier: none to keep yours)"
    )


def keep_cost_limit(applied: Budget, declared: Budget) -> Budget:
    """``applied`` (a classifier's budget) with the declared ``max_cost`` kept: a classifier may
    lower a cost limit (or add one), never raise or drop it; the heuristic one leaves it as declared."""
    if declared.max_cost is None or (applied.max_cost is not None and applied.max_cost <= declared.max_cost):
        return applied
    return applied.model_copy(update={"max_cost": declared.max_cost})


# Tiers of the heuristic: the fraction of the declared budget kept, and floors below which a
# budget is never cut (so a short request still has room for a tool round trip or two).
_TIERS = {"simple": 0.25, "standard": 0.5, "complex": 1.0}
_FLOOR = Budget(max_iterations=6, max_tokens=8_000, max_duration_ms=60_000)
_COMPLEX_WORDS = re.compile(r"\b(research|investigate|analy[sz]e|compare|plan|audit|migrate|refactor|step[- ]by[- ]step)\b", re.I)


def heuristic_classifier(spec: AgentRunSpec) -> Classification:
    """Classify by the request's size, its wording and the number of tools.

    - complex: over 150 words, more than 8 tools, or words such as research/analyze/compare/plan;
      keeps the declared budget.
    - simple: at most 40 words and at most 3 tools; keeps a quarter of it.
    - standard: the rest; keeps half.
    Each limit is then raised to the floor (6 iterations, 8,000 tokens, 60,000 ms) and capped at
    the declared value. ``max_cost`` is kept as declared (a money limit is the author's).
    """
    words = len(spec.input.split())
    tools = len(spec.tools)
    if words > 150 or tools > 8 or _COMPLEX_WORDS.search(spec.input):
        label, reason = (
            "complex",
            f"{words} words, {tools} tools" + (", research wording" if _COMPLEX_WORDS.search(spec.input) else ""),
        )
    elif words <= 40 and tools <= 3:
        label, reason = "simple", f"{words} words and {tools} tools"
    else:
        label, reason = "standard", f"{words} words and {tools} tools"
    declared = spec.budget.limits()
    f = _TIERS[label]

    def scaled(name: str) -> int:
        limit: int = getattr(declared, name)
        want: int = max(int(limit * f), getattr(_FLOOR, name))
        return min(want, limit)

    applied = Budget(
        max_iterations=scaled("max_iterations"),
        max_tokens=scaled("max_tokens"),
        max_duration_ms=scaled("max_duration_ms"),
        max_cost=declared.max_cost,  # not scaled: a cost limit is the author's to set
    )
    return Classification(classifier="heuristic", label=label, reason=reason, declared=declared, applied=applied)


def no_classifier(spec: AgentRunSpec) -> Classification:
    """Keep the declared budget as it is."""
    declared = spec.budget.limits()
    return Classification(
        classifier="none", label="unclassified", reason="classifier disabled", declared=declared, applied=declared
    )


def get_classifier(name: str) -> Classifier:
    """Resolve ``spec.budget.classifier``. Raises SpecError naming the field."""
    if name == "heuristic":
        return heuristic_classifier
    if name == "none":
        return no_classifier
    try:
        fn = resolve_ref(name)
    except (ImportError, AttributeError, ValueError) as err:
        raise SpecError(f"spec.budget.classifier: {err}") from None
    if not callable(fn):
        raise SpecError(f"spec.budget.classifier: {name} is not callable")
    classifier: Classifier = fn
    return classifier
