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

from .snapshot import Budget, Classification, RunContext
from .spec import AgentRunSpec, SpecError, resolve_ref

Classifier = Callable[[AgentRunSpec], Classification]


def check_budget(ctx: RunContext) -> str | None:
    """None while within budget; otherwise why the run must stop, in words a user understands."""
    b, c, u = ctx.budget, ctx.counters, ctx.usage
    if c.iterations >= b.max_iterations:
        return f"budget exceeded: max_iterations is {b.max_iterations} and the run has made {c.iterations} iterations without finishing"
    if u.total_tokens >= b.max_tokens:
        return f"budget exceeded: max_tokens is {b.max_tokens} and the run has used {u.total_tokens} tokens"
    if u.duration_ms >= b.max_duration_ms:
        return f"budget exceeded: max_duration_ms is {b.max_duration_ms} and the run has been active for {u.duration_ms} ms"
    return None


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
    the declared value.
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
    declared = Budget(**spec.budget.model_dump(include={"max_iterations", "max_tokens", "max_duration_ms"}))
    f = _TIERS[label]

    def scaled(name: str) -> int:
        limit: int = getattr(declared, name)
        want: int = max(int(limit * f), getattr(_FLOOR, name))
        return min(want, limit)

    applied = Budget(
        max_iterations=scaled("max_iterations"), max_tokens=scaled("max_tokens"), max_duration_ms=scaled("max_duration_ms")
    )
    return Classification(classifier="heuristic", label=label, reason=reason, declared=declared, applied=applied)


def no_classifier(spec: AgentRunSpec) -> Classification:
    """Keep the declared budget as it is."""
    declared = Budget(**spec.budget.model_dump(include={"max_iterations", "max_tokens", "max_duration_ms"}))
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
