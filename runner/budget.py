"""Budgets (G7) and the complexity classifier.

:func:`check_budget` runs at the top of every iteration and returns a readable reason when a limit
is reached. The classifier runs once, before the first model call, and may lower the declared
budget for a simple request ("a simple question doesn't carry a research budget"); it never
raises one above what the AgentRun declared. What it decided is recorded in
``RunContext.classification``.

Pluggable: ``spec.budget.classifier`` is ``heuristic`` (default), ``none``, or ``module:attr`` of a
callable ``(AgentRunSpec) -> Classification``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .snapshot import Budget, Classification, RunContext, format_cost
from .spec import AgentRunSpec, SpecError, resolve_ref

Classifier = Callable[[AgentRunSpec], Classification]


def check_budget(ctx: RunContext) -> str | None:
    """None while within budget; otherwise why the run must stop, in words a user understands.

    Limits: ``max_iterations`` (iterations), ``max_tokens`` (prompt + completion tokens),
    ``max_duration_ms`` (active time, ms) and ``max_cost`` (``ctx.cost()``: the tokens so far at
    ``ctx.prices``, in their currency); ``ctx.usage`` as counted (:meth:`RunnerBase.counted_context`:
    replies lost to crashes included, and named in the reason). A ``max_cost`` without prices cannot be checked: the spec
    refuses it, and a context that has it anyway (written by hand) stops the run rather than run
    without its limit. Raises nothing.
    """
    b, c, u = ctx.budget, ctx.counters, ctx.usage
    # Replies a crash lost before their turn was saved were paid for: counted, and said so.
    lost = f", {u.lost_replies} of them in model replies lost to crashes" if u.lost_replies else ""
    if c.iterations >= b.max_iterations:
        return f"budget exceeded: max_iterations is {b.max_iterations} and the run has made {c.iterations} iterations without finishing"
    if u.total_tokens >= b.max_tokens:
        return f"budget exceeded: max_tokens is {b.max_tokens} and the run has used {u.total_tokens} tokens{lost}"
    if u.duration_ms >= b.max_duration_ms:
        return f"budget exceeded: max_duration_ms is {b.max_duration_ms} and the run has been active for {u.duration_ms} ms"
    if b.max_cost is not None:
        cost = ctx.cost()
        if cost is None or ctx.prices is None:
            return f"budget cannot be checked: max_cost is {b.max_cost:g} but the run's model has no prices"
        if cost >= b.max_cost:
            currency = ctx.prices.currency
            return (
                f"budget exceeded: max_cost is {format_cost(b.max_cost, currency)} and the run has cost"
                f" {format_cost(cost, currency)} ({u.prompt_tokens} prompt and {u.completion_tokens} completion tokens{lost})"
            )
    return None


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
