"""A fork's cost (issue 30 item 6): counted at the prices of its own model, never its source's.

The attack: a source run on a ModelConfig priced at 0 with ``spec.budget.max_cost``; a fork of it
onto a paid ModelConfig. Before, the fork kept the source's prices (copied with its checkpoint):
it reported cost 0 and ``max_cost`` never stopped it. Now its prices are resolved from the
ModelConfig in force for the fork (or its scripted model's own), its cost counts at them, and
``max_cost`` stops it. A fork whose cost limit could not be checked (no prices, or prices in
another currency than the limit's) is refused before anything is registered.

Real parts: Postgres (the fixtures), ``agentfast run/fork/resume`` as OS processes, the models
served over HTTP by the scripted model server, each counting the requests it answered.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.names import ExitCode
from agentfast.runner.snapshot import Prices
from agentfast.runner.spec import parse_agentrun, parse_modelconfig, resolve_model_config
from agentfast.runner.store import ForkRefused, Store
from agentfast.testing.scripted import ScriptedModelServer, load_script

from .helpers import run_cli

pytestmark = pytest.mark.process

ECHO = {"name": "echo", "ref": "agentfast.testing.tools:echo"}
FREE = {"promptPerMillionTokens": 0, "completionPerMillionTokens": 0}
# endless: 900 prompt + 100 completion tokens a turn; at 10 and 50 per million, 0.014 USD a turn.
PAID = {"promptPerMillionTokens": 10, "completionPerMillionTokens": 50}
# Iterations 1 and 2 copied from the source cost 0.028 USD at PAID: one more turn (0.042) passes it.
BUDGET = {"max_cost": 0.03, "max_iterations": 4, "classifier": "none"}
SOURCE = "default/src"


def _modelconfig(name: str, base_url: str, prices: dict | None) -> dict:
    spec: dict = {"baseURL": base_url, "models": ["scripted-endless"], "maxRetries": 0, "timeoutSeconds": 20}
    if prices is not None:
        spec["prices"] = prices
    return {"apiVersion": "agentfast.dev/v1alpha1", "kind": "ModelConfig", "metadata": {"name": name}, "spec": spec}


def _agentrun(name: str, model: dict, budget: dict = BUDGET, **spec: object) -> dict:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "uid": str(uuid.uuid4())},
        "spec": {"model": model, "input": "echo until told to stop", "tools": [ECHO], "budget": budget, **spec},
    }


def _write(path: Path, *docs: dict) -> str:
    path.write_text(yaml.safe_dump_all(list(docs)))
    return str(path)


def _run_source(tmp_path: Path, dsn: str, store: Store) -> None:
    """The source: on ModelConfig ``free`` (prices 0) with max_cost, to max_iterations (4 turns):
    its cost stays 0, so only the iteration limit ends it."""
    with ScriptedModelServer(load_script("endless")) as free:
        path = _write(
            tmp_path / "src.yaml",
            _modelconfig("free", free.base_url, FREE),
            _agentrun("src", {"name": "scripted-endless", "config": "free"}),
        )
        got = run_cli("run", path, "--no-wait", dsn=dsn, timeout=90)
        assert got.returncode == ExitCode.FAILED, got.stdout
        assert len(free.requests) == 4
    ctx = store.load_context(SOURCE)[0]
    assert ctx.status.reason == "BudgetExceeded" and "max_iterations is 4" in ctx.status.message
    assert ctx.cost() == 0 and ctx.budget.max_cost == 0.03


def _assert_stopped_by_max_cost(store: Store, run_id: str, paid: ScriptedModelServer, got: object) -> None:
    """The fork asked the paid model once (iteration 3), then its cost stopped it."""
    assert got.returncode == ExitCode.FAILED, got.stdout  # type: ignore[attr-defined]
    assert len(paid.requests) == 1
    ctx = store.load_context(run_id)[0]
    reason = "budget exceeded: max_cost is 0.03 USD and the run has cost 0.042 USD (2700 prompt and 300 completion tokens)"
    assert (ctx.status.phase, ctx.status.reason, ctx.status.message) == ("Failed", "BudgetExceeded", reason)
    assert ctx.prices == Prices(**PAID) and ctx.cost() == pytest.approx(0.042)
    assert store.load_context(SOURCE)[0].cost() == 0  # the source is unchanged


def test_agentfast_fork_onto_a_paid_model_counts_its_prices_and_max_cost_stops_it(tmp_path: Path, dsn: str, store: Store) -> None:
    _run_source(tmp_path, dsn, store)
    with ScriptedModelServer(load_script("endless")) as paid:
        overrides = _write(
            tmp_path / "to-paid.yaml",
            {"spec": {"model": {"name": "scripted-endless", "config": "paid"}}},
            _modelconfig("paid", paid.base_url, PAID),
        )
        got = run_cli("fork", SOURCE, "--at", "2", "--name", "paid-fork", "-f", overrides, dsn=dsn)
        assert got.returncode == 0, got.stdout
        # Registered with the paid ModelConfig and its prices: its cost so far is already counted at them.
        ctx = store.load_context("default/paid-fork")[0]
        assert ctx.prices == Prices(**PAID) and ctx.cost() == pytest.approx(0.028)
        shown = json.loads(run_cli("status", "paid-fork", "-o", "json", dsn=dsn).stdout)
        assert shown["cost"]["amount"] == pytest.approx(0.028) and shown["modelConfig"]["name"] == "paid"
        got = run_cli("resume", "default/paid-fork", dsn=dsn, timeout=90)
        _assert_stopped_by_max_cost(store, "default/paid-fork", paid, got)


def test_spec_fork_from_onto_a_paid_model_counts_its_prices_and_max_cost_stops_it(tmp_path: Path, dsn: str, store: Store) -> None:
    """The same fork written as an AgentRun (``spec.forkFrom``) beside its ModelConfig: registered
    where runs are (``agentfast run``; the operator's ``_register`` calls the same code)."""
    _run_source(tmp_path, dsn, store)
    with ScriptedModelServer(load_script("endless")) as paid:
        fork = _agentrun("from-file", {"name": "scripted-endless", "config": "paid"}, forkFrom={"run": "src", "iteration": 2})
        path = _write(tmp_path / "from-file.yaml", _modelconfig("paid", paid.base_url, PAID), fork)
        got = run_cli("run", path, "--no-wait", dsn=dsn, timeout=90)
        _assert_stopped_by_max_cost(store, "default/from-file", paid, got)


def test_a_fork_registered_with_its_sources_prices_is_counted_at_its_own_when_it_resumes(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    """A fork an earlier release registered, its checkpoint holding the source's prices (0): the
    runner takes its prices from the run's registered document at every takeover, not from the
    checkpoint, so max_cost stops it all the same."""
    _run_source(tmp_path, dsn, store)
    with ScriptedModelServer(load_script("endless")) as paid:
        overrides = _write(
            tmp_path / "to-paid.yaml",
            {"spec": {"model": {"name": "scripted-endless", "config": "paid"}}},
            _modelconfig("paid", paid.base_url, PAID),
        )
        assert run_cli("fork", SOURCE, "--at", "2", "--name", "old-fork", "-f", overrides, dsn=dsn).returncode == 0
        # As the owner, under the run's lease settings (the fence): what the earlier release wrote.
        with psycopg.connect(dsn) as conn, conn.transaction():
            conn.execute(
                "SELECT set_config('agentfast.epoch', epoch::text, true), set_config('agentfast.run_uid', run_uid, true)"
                " FROM agentfast_runs WHERE run_id = %s",
                ("default/old-fork",),
            )
            conn.execute(
                "UPDATE agentfast_checkpoints SET context = jsonb_set(context, '{prices}', %s::jsonb) WHERE run_id = %s",
                (json.dumps(FREE | {"currency": "USD"}), "default/old-fork"),
            )
        assert store.load_context("default/old-fork")[0].cost() == 0
        got = run_cli("resume", "default/old-fork", dsn=dsn, timeout=90)
        _assert_stopped_by_max_cost(store, "default/old-fork", paid, got)


def test_a_fork_whose_cost_limit_cannot_be_checked_is_refused_and_nothing_is_registered(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    _run_source(tmp_path, dsn, store)
    before = [r.run_id for r, _ in store.list_runs()]

    def refused(name: str, *docs: dict) -> str:
        got = run_cli("fork", SOURCE, "--at", "2", "--name", name, "-f", _write(tmp_path / f"{name}.yaml", *docs), dsn=dsn)
        assert got.returncode == ExitCode.BAD_INPUT, got.stdout
        assert "Traceback" not in got.stdout
        return got.stdout

    model = {"name": "scripted-endless", "config": "other"}
    # onto a ModelConfig without prices: the source's max_cost could never be checked
    said = refused("unpriced", {"spec": {"model": model}}, _modelconfig("other", "http://127.0.0.1:9/v1", None))
    assert "spec.budget.max_cost: ModelConfig 'other' has no prices" in said
    # onto the scripted model without prices
    said = refused("scripted", {"spec": {"model": {"name": "scripted-endless", "config": None, "script": "endless"}}})
    assert "spec.budget.max_cost: the scripted model has no prices" in said
    # onto prices in another currency: max_cost 0.03 is an amount of USD
    eur = _modelconfig("other", "http://127.0.0.1:9/v1", PAID | {"currency": "EUR"})
    said = refused("in-euros", {"spec": {"model": model}}, eur)
    assert "the fork's prices are in EUR, but the max_cost 0.03 it goes on with (default/src's budget) is in USD" in said
    # another ModelConfig than the source's, not given: refused, never counted at the source's
    said = refused("not-given", {"spec": {"model": model}})
    assert "the fork names ModelConfig 'other', the source 'free': put the ModelConfig 'other' document in the -f file" in said
    # spec.forkFrom declaring another budget than the source's (one it would never go on with)
    fork = _agentrun("other-budget", {"name": "scripted-endless", "config": "free"}, BUDGET | {"max_cost": 0.01})
    fork["spec"]["forkFrom"] = {"run": "src", "iteration": 2}
    got = run_cli("run", _write(tmp_path / "ob.yaml", _modelconfig("free", "http://127.0.0.1:9/v1", FREE), fork), dsn=dsn)
    assert got.returncode == ExitCode.BAD_INPUT and "spec.budget differs from the source's (default/src)" in got.stdout
    assert [r.run_id for r, _ in store.list_runs()] == before


def test_the_store_refuses_a_fork_without_prices_of_a_source_with_a_cost_limit(tmp_path: Path, dsn: str, store: Store) -> None:
    """The store's own rule, whoever calls it: the budget a fork goes on with is its source's
    (copied), so its max_cost needs the fork's prices, in the source's currency."""
    _run_source(tmp_path, dsn, store)
    with pytest.raises(ForkRefused, match="the fork's model has no prices, but the budget it goes on with"):
        store.fork_run(SOURCE, 2, "default/no-prices", str(uuid.uuid4()), {}, prices=None)
    with pytest.raises(ForkRefused, match="the fork's prices are in JPY"):
        store.fork_run(SOURCE, 2, "default/yen", str(uuid.uuid4()), {}, prices=Prices(**PAID, currency="JPY"))
    assert store.get_run("default/no-prices") is None and store.get_run("default/yen") is None


def test_the_operators_registration_of_a_fork_takes_its_modelconfigs_prices(
    tmp_path: Path, dsn: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator registers a ``spec.forkFrom`` run with the ModelConfig it resolved for it (as
    ``_with_model_config`` does from the API server); its checkpoint holds that one's prices."""
    from agentfast.operator import main

    _run_source(tmp_path, dsn, store)
    monkeypatch.setattr(main.STATE, "store", store)
    fork = _agentrun("in-cluster", {"name": "scripted-endless", "config": "paid"}, forkFrom={"run": "src", "iteration": 2})
    fork["metadata"] |= {"namespace": "default", "uid": "uid-in-cluster"}
    config = parse_modelconfig(
        _modelconfig("paid", "http://127.0.0.1:9/v1", PAID) | {"metadata": {"name": "paid", "namespace": "default"}}
    )
    doc = resolve_model_config(parse_agentrun(fork, check_imports=False), config).model_dump(mode="json", exclude_none=True)
    main._register({"metadata": fork["metadata"]}, "default/in-cluster", doc)
    ctx = store.load_context("default/in-cluster")[0]
    assert ctx.prices == Prices(**PAID) and ctx.cost() == pytest.approx(0.028)


CLASSIFIER = """
from agentfast.runner.snapshot import Classification


def classify(spec):
    declared = spec.budget.limits()
    applied = declared.model_copy(update={"max_cost": 1.0})
    return Classification(classifier="cost_adding:classify", label="capped", reason="adds one", declared=declared, applied=applied)
"""


def test_a_cost_limit_a_classifier_adds_to_a_run_without_prices_is_refused_before_the_model_is_asked(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    """A declared ``max_cost`` on a model without prices is refused with the spec
    (tests/test_cost_runs.py); one a classifier adds (it may add a cost limit) ends the run
    ``Failed``/``InvalidSpec`` before its first model call, never a run whose limit is never checked."""
    (tmp_path / "cost_adding.py").write_text(CLASSIFIER)
    with ScriptedModelServer(load_script("endless")) as server:
        run = _agentrun("added", {"name": "scripted-endless", "config": "free"}, {"classifier": "cost_adding:classify"})
        path = _write(tmp_path / "added.yaml", _modelconfig("free", server.base_url, None), run)
        got = run_cli("run", path, "--no-wait", dsn=dsn, timeout=90, env={"PYTHONPATH": str(tmp_path)})
        assert len(server.requests) == 0
    assert got.returncode == ExitCode.BAD_INPUT, got.stdout
    ctx = store.load_context("default/added")[0]
    assert (ctx.status.phase, ctx.status.reason) == ("Failed", "InvalidSpec")
    assert "cost_adding:classify set max_cost 1, but the run's model has no prices" in ctx.status.message
