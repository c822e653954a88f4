"""Cost (issue 17 item 5): prices, the cost of a run's tokens, and ``spec.budget.max_cost`` (G7).

Unit tier: the budget check, the spec's rules (a cost limit needs prices), the snapshot's
backward compatibility. The runs themselves are in tests/test_cost_runs.py (process tier) and
the operator's ``status.cost`` in tests/test_operator_units.py.
"""

from __future__ import annotations

import pytest

from agentfast.runner.budget import check_budget, heuristic_classifier, keep_cost_limit, no_classifier
from agentfast.runner.snapshot import SCHEMA_VERSION, Budget, Prices, RunContext, Session, StateSnapshot, Usage, format_cost
from agentfast.runner.spec import (
    MAX_COST,
    AgentRun,
    ModelPrices,
    SpecError,
    parse_agentrun,
    parse_modelconfig,
    resolve_model_config,
)

PRICES = Prices(promptPerMillionTokens=10, completionPerMillionTokens=50)  # 900 + 100 tokens: 0.014 USD


def context(prompt: int, completion: int, *, max_cost: float | None, prices: Prices | None = PRICES) -> RunContext:
    return RunContext(
        session=Session(run_uid="u"),
        budget=Budget(max_cost=max_cost),
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
        prices=prices,
    )


def test_the_cost_is_the_tokens_at_the_prices_and_none_without_prices() -> None:
    assert PRICES.cost(1_000_000, 0) == 10 and PRICES.cost(0, 1_000_000) == 50
    assert context(2700, 300, max_cost=None).cost() == pytest.approx(0.042)
    assert context(2700, 300, max_cost=None, prices=None).cost() is None
    # ModelPrices (a document's, with bounds) computes with the same function
    assert ModelPrices(promptPerMillionTokens=10, completionPerMillionTokens=50).cost(2700, 300) == pytest.approx(0.042)


def test_max_cost_ends_the_run_once_reached_saying_the_limit_and_the_cost() -> None:
    assert check_budget(context(1800, 200, max_cost=0.03)) is None  # 0.028 USD
    reason = check_budget(context(2700, 300, max_cost=0.03))  # 0.042 USD
    assert reason == (
        "budget exceeded: max_cost is 0.03 USD and the run has cost 0.042 USD (2700 prompt and 300 completion tokens)"
    )
    assert check_budget(context(0, 600, max_cost=0.03)) is not None  # exactly at the limit: stop, like max_tokens
    assert check_budget(context(100_000, 40_000, max_cost=None)) is None  # 3 USD, but no max_cost: no cost limit


def test_the_other_limits_come_first_and_a_cost_limit_without_prices_is_never_silent() -> None:
    ctx = context(150_000, 0, max_cost=0.01)
    assert (check_budget(ctx) or "").startswith("budget exceeded: max_tokens is 150000")
    reason = check_budget(context(1, 1, max_cost=0.5, prices=None))
    assert reason == "budget cannot be checked: max_cost is 0.5 but the run's model has no prices"


def test_costs_read_as_amounts_of_a_currency() -> None:
    assert format_cost(0.0123, "USD") == "0.0123 USD"
    assert format_cost(0.00015, "USD") == "0.00015 USD"
    assert format_cost(1.5, "EUR") == "1.50 EUR"
    assert format_cost(0, "USD") == "0.00 USD"
    assert format_cost(12.0, "GBP") == "12.00 GBP"


def test_a_classifier_keeps_the_declared_cost_limit() -> None:
    declared = Budget(max_iterations=10, max_cost=0.5)
    assert keep_cost_limit(Budget(max_iterations=6), declared).max_cost == 0.5  # dropped: kept
    assert keep_cost_limit(Budget(max_iterations=6, max_cost=2.0), declared).max_cost == 0.5  # raised: capped
    assert keep_cost_limit(Budget(max_iterations=6, max_cost=0.1), declared).max_cost == 0.1  # lowered: allowed
    assert keep_cost_limit(Budget(max_cost=0.1), Budget()).max_cost == 0.1  # added: a lower limit
    run = _run(budget={"max_iterations": 40, "max_cost": 0.25})
    for classifier in (heuristic_classifier, no_classifier):
        cl = classifier(run.spec)
        assert cl.declared.max_cost == cl.applied.max_cost == 0.25, classifier


# -- the spec: max_cost is a positive amount, and needs prices ------------------------------------------


def _run(*, model: dict | None = None, budget: dict | None = None) -> AgentRun:
    doc = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": "cost"},
        "spec": {"model": model or {"name": "m", "config": "llm"}, "input": "hi", "budget": budget or {}},
    }
    return parse_agentrun(doc, check_imports=False)


def _modelconfig(prices: dict | None) -> dict:
    spec = {"baseURL": "http://llm.example:8000/v1", "models": ["m"], **({"prices": prices} if prices else {})}
    return {"apiVersion": "agentfast.dev/v1alpha1", "kind": "ModelConfig", "metadata": {"name": "llm"}, "spec": spec}


@pytest.mark.parametrize("value", [0, -1, MAX_COST * 2, "a lot"])
def test_max_cost_must_be_a_positive_bounded_number(value: object) -> None:
    with pytest.raises(SpecError, match=r"^spec\.budget\.max_cost: "):
        _run(budget={"max_cost": value})


def test_without_max_cost_there_is_no_cost_limit() -> None:
    run = _run()
    assert run.spec.budget.max_cost is None and run.spec.budget.limits().max_cost is None


def test_max_cost_on_a_model_config_without_prices_is_refused_naming_the_field() -> None:
    run = _run(budget={"max_cost": 1})
    with pytest.raises(SpecError) as err:
        resolve_model_config(run, parse_modelconfig(_modelconfig(None)))
    assert str(err.value) == (
        "spec.budget.max_cost: ModelConfig 'llm' has no prices (its spec.prices), so the run's cost cannot be"
        " counted; ask its admin to set prices, or remove max_cost"
    )
    priced = resolve_model_config(
        run, parse_modelconfig(_modelconfig({"promptPerMillionTokens": 1, "completionPerMillionTokens": 2}))
    )
    assert priced.prices() == ModelPrices(promptPerMillionTokens=1, completionPerMillionTokens=2)
    assert _run().prices() is None  # not resolved yet: no prices known


def test_max_cost_on_the_scripted_model_needs_its_prices() -> None:
    with pytest.raises(SpecError) as err:
        _run(model={"name": "m", "script": "endless"}, budget={"max_cost": 0.1})
    assert str(err.value).startswith("spec.budget.max_cost: the scripted model has no prices")
    prices = {"promptPerMillionTokens": 3, "completionPerMillionTokens": 6, "currency": "EUR"}
    run = _run(model={"name": "m", "script": "endless", "prices": prices}, budget={"max_cost": 0.1})
    assert run.prices() == ModelPrices(**prices) and run.prices().currency == "EUR"


def test_prices_in_the_spec_are_the_scripted_models_only() -> None:
    prices = {"promptPerMillionTokens": 3, "completionPerMillionTokens": 6}
    with pytest.raises(SpecError, match=r"^spec\.model\.prices: only for the scripted model"):
        _run(model={"name": "m", "config": "llm", "prices": prices})
    with pytest.raises(SpecError, match=r"spec\.model\.prices\.currency"):
        _run(model={"name": "m", "script": "endless", "prices": {**prices, "currency": "dollars"}})


# -- the snapshot: prices and max_cost are new, optional fields --------------------------------------------


def test_a_snapshot_written_before_cost_existed_loads_without_prices_or_a_cost_limit() -> None:
    """Written by the release before issue 17: schema 2, no ``prices``, no ``budget.max_cost``.
    Both are optional fields with a default (no schema bump: nothing was renamed or changed meaning)."""
    old = {
        "schema_version": 2,
        "run_id": "default/r",
        "context": {
            "session": {"run_uid": "u"},
            "budget": {"max_iterations": 5, "max_tokens": 100, "max_duration_ms": 1000},
            "usage": {"prompt_tokens": 70, "completion_tokens": 30, "total_tokens": 100, "duration_ms": 5},
        },
    }
    snap = StateSnapshot.model_validate(old)
    assert snap.schema_version == SCHEMA_VERSION
    assert snap.context.prices is None and snap.context.budget.max_cost is None and snap.context.cost() is None
    assert check_budget(snap.context) == "budget exceeded: max_tokens is 100 and the run has used 100 tokens"


def test_prices_and_max_cost_survive_a_round_trip_and_the_cost_is_not_stored() -> None:
    snap = StateSnapshot(run_id="default/r", context=context(2700, 300, max_cost=0.03))
    data = snap.model_dump(mode="json")
    assert data["context"]["prices"] == {"promptPerMillionTokens": 10.0, "completionPerMillionTokens": 50.0, "currency": "USD"}
    assert data["context"]["budget"]["max_cost"] == 0.03
    assert "cost" not in data["context"]  # computed from usage and prices when read
    assert StateSnapshot.model_validate(data).context.cost() == pytest.approx(0.042)


def test_spend_is_one_line_against_the_budget_and_a_lowered_limit_says_so() -> None:
    """Issue 31 item 3: the spend line the prompt, status and inbox show, from the one cost
    function; and a reason on a limit the classifier lowered names the declared one."""
    from agentfast.runner.budget import check_spend, spend_summary
    from agentfast.runner.snapshot import Classification

    ctx = context(2700, 300, max_cost=0.03)
    ctx.budget.max_tokens = 8000
    assert spend_summary(ctx) == "tokens 3000 / 8000, cost 0.042 / 0.03 USD"
    assert check_spend(ctx) == (
        "budget exceeded: max_cost is 0.03 USD and the run has cost 0.042 USD (2700 prompt and 300 completion tokens)"
    )
    assert (
        spend_summary(context(2700, 300, max_cost=None)) == f"tokens 3000 / {Budget().max_tokens}, cost 0.042 USD (no max_cost)"
    )
    assert spend_summary(context(2700, 300, max_cost=None, prices=None)).endswith("cost not counted (no prices)")
    assert check_spend(context(10, 0, max_cost=0.03)) is None
    # Lowered by a classifier: the declared value, the applied one, the way back.
    declared = Budget(max_iterations=12, max_tokens=2_000_000, max_cost=0.5)
    applied = Budget(max_iterations=6, max_tokens=1_000_000, max_cost=0.03)
    lowered = context(2700, 300, max_cost=0.03)
    lowered.budget = applied
    lowered.classification = Classification(classifier="mine", label="l", reason="r", declared=declared, applied=applied)
    assert check_spend(lowered) == (
        "budget exceeded: max_cost is 0.03 USD (lowered from the declared 0.50 USD by the mine classifier;"
        " set spec.budget.classifier: none to keep yours) and the run has cost 0.042 USD (2700 prompt and 300 completion tokens)"
    )
    lowered.usage = Usage(prompt_tokens=1_000_000, completion_tokens=0, total_tokens=1_000_000)
    lowered.prices = None
    assert check_spend(lowered).startswith(
        "budget exceeded: max_tokens is 1000000 (lowered from the declared 2000000 by the mine classifier;"
    )
    # As declared (classifier none): no note.
    same = context(2700, 300, max_cost=0.03)
    same.classification = Classification(classifier="none", label="u", reason="r", declared=same.budget, applied=same.budget)
    assert "lowered" not in (check_budget(same) or "x")
