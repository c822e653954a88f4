"""The operator's metrics (operator/metrics.py, issue 18 item 1) against real runs in a real
Postgres: the store collector's figures equal what the runs stored (counters, tokens, cost,
awaited calls, journal latencies), and ``/metrics`` serves them over real HTTP in the text
format Prometheus parses.
"""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid
from typing import Any

import psycopg
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from agentfast.operator import metrics
from agentfast.runner.adapters.vanilla import VanillaRunner
from agentfast.runner.loop import Outcome, run_id_of
from agentfast.runner.model import model_from_spec
from agentfast.runner.spec import AgentRun, parse_agentrun
from agentfast.runner.store import Store
from agentfast.runner.tools import ToolRegistry

from .helpers import EXAMPLES

PRICES = {"promptPerMillionTokens": 3.0, "completionPerMillionTokens": 15.0, "currency": "USD"}


def refund_run(name: str, **spec: Any) -> AgentRun:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["metadata"]["uid"] = str(uuid.uuid4())
    doc["spec"].update(spec)
    return parse_agentrun(doc)


def drive(store: Store, run: AgentRun, *, register: bool = True) -> Outcome:
    """Drive ``run`` in this process with the scripted model over real HTTP until it ends or pauses."""
    if register:
        store.create_run(run_id_of(run), run.metadata.uid, run.model_dump(mode="json", exclude_none=True))
    model = model_from_spec(run.spec.model)
    try:
        return VanillaRunner(store, run, model, ToolRegistry.from_agentrun(run), wait_for_approval=False).run()
    finally:
        model.close()


def scrape(collector: metrics.StoreCollector) -> dict[str, Any]:
    """Every sample the collector yields: ``{name: {labels tuple: value}}`` (labels sorted)."""
    out: dict[str, Any] = {}
    for family in collector.collect():
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def journal_durations(dsn: str) -> dict[str, list[float]]:
    """Each tool's call latencies (s) as the journal's own timestamps say, read independently."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            """SELECT tool_name, extract(epoch FROM finished_at - started_at)::float8 FROM agentfast_tool_calls
               WHERE started_at IS NOT NULL AND finished_at IS NOT NULL"""
        ).fetchall()
    out: dict[str, list[float]] = {}
    for name, d in rows:
        out.setdefault(name, []).append(d)
    return out


def turn_durations(dsn: str) -> tuple[list[float], list[float]]:
    """Model-call and iteration durations (s) computed here, in Python, from the stored rows: an
    iteration ends at its turn or its last tool result, whichever is later; a model call runs from
    the previous iteration's end to its turn; an iteration from the previous end to its own."""
    with psycopg.connect(dsn) as conn:
        turns = conn.execute("SELECT run_id, iteration, created_at FROM agentfast_turns ORDER BY run_id, iteration").fetchall()
        finished = dict(
            ((r, i), f)
            for r, i, f in conn.execute("SELECT run_id, iteration, max(finished_at) FROM agentfast_tool_calls GROUP BY 1, 2")
        )
    model, iteration, previous = [], [], {}
    for run_id, it, created in turns:
        end = max(created, finished.get((run_id, it)) or created)
        if run_id in previous:
            model.append((created - previous[run_id]).total_seconds())
            iteration.append((end - previous[run_id]).total_seconds())
        previous[run_id] = end
    return model, iteration


@pytest.mark.store
def test_the_collector_reads_a_paused_then_finished_run_and_a_failed_one(store: Store, dsn: str) -> None:
    paused = refund_run("refund-metrics", model={"name": "scripted-refund", "script": "refund", "prices": PRICES})
    collector = metrics.StoreCollector(store)
    assert scrape(collector)["agentfast_runs"][(("phase", "Pending"),)] == 0

    before = time.time()
    assert drive(store, paused).phase == "WaitingForApproval"
    waiting = scrape(collector)
    assert waiting["agentfast_store_up"][()] == 1
    assert waiting["agentfast_runs"][(("phase", "WaitingForApproval"),)] == 1
    assert waiting["agentfast_runs"][(("phase", "Succeeded"),)] == 0
    assert waiting["agentfast_approvals_waiting"][(("reason", "requires_approval"),)] == 1
    assert waiting["agentfast_approvals_waiting"][(("reason", "awaiting_input"),)] == 0
    age = waiting["agentfast_approval_oldest_wait_seconds"][(("reason", "requires_approval"),)]
    assert 0 <= age <= time.time() - before + 1

    # A decision recorded but not yet taken up by a runner is no longer awaited.
    call_id = store.load_context(run_id_of(paused))[1].call_id
    store.decide(run_id_of(paused), call_id, "approve", decided_by="test")
    assert scrape(collector)["agentfast_approvals_waiting"][(("reason", "requires_approval"),)] == 0

    # A second runner takes the run over (epoch 2: one takeover, one resume) and finishes it.
    assert drive(store, paused, register=False).phase == "Succeeded"
    failed = refund_run("refund-metrics-fails", budget={"max_iterations": 1, "max_tokens": 20000, "max_duration_ms": 120000})
    assert drive(store, failed).phase == "Failed"

    got = scrape(collector)
    ctx_a = store.load_context(run_id_of(paused))[0]
    ctx_b = store.load_context(run_id_of(failed))[0]
    assert got["agentfast_runs"][(("phase", "Succeeded"),)] == 1
    assert got["agentfast_runs"][(("phase", "Failed"),)] == 1
    assert got["agentfast_runs"][(("phase", "WaitingForApproval"),)] == 0
    assert got["agentfast_approvals_waiting"][(("reason", "requires_approval"),)] == 0
    assert (("reason", "requires_approval"),) not in got.get("agentfast_approval_oldest_wait_seconds", {})
    for counter, field in [
        ("agentfast_iterations_total", "iterations"),
        ("agentfast_model_calls_total", "model_calls"),
        ("agentfast_tool_calls_total", "tool_calls"),
        ("agentfast_tool_errors_total", "tool_errors"),
        ("agentfast_approvals_requested_total", "approvals_requested"),
        ("agentfast_resumes_total", "resumes"),
    ]:
        assert got[counter][()] == getattr(ctx_a.counters, field) + getattr(ctx_b.counters, field), counter
    assert ctx_a.counters.resumes == 1 and got["agentfast_takeovers_total"][()] == 1
    assert got["agentfast_tokens_total"][(("kind", "prompt"),)] == ctx_a.usage.prompt_tokens + ctx_b.usage.prompt_tokens
    assert (
        got["agentfast_tokens_total"][(("kind", "completion"),)] == ctx_a.usage.completion_tokens + ctx_b.usage.completion_tokens
    )
    assert ctx_a.usage.prompt_tokens == 182 + 291 + 402  # the script's usage: the figures are the run's, not zero
    # Only the priced run has a cost, in its currency.
    assert got["agentfast_cost_total"] == {(("currency", "USD"),): pytest.approx(ctx_a.cost())}

    # Tool latencies: per tool, as many observations as journal rows, summing to their durations.
    durations = journal_durations(dsn)
    assert set(durations) == {"lookup_order", "issue_refund", "add_case_note"}
    for tool, ds in durations.items():
        labels = (("tool", tool),)
        assert got["agentfast_tool_call_duration_seconds_count"][labels] == len(ds)
        assert got["agentfast_tool_call_duration_seconds_sum"][labels] == pytest.approx(sum(ds))
        inf = got["agentfast_tool_call_duration_seconds_bucket"][(("le", "+Inf"), *labels)]
        assert inf == len(ds)
        assert got["agentfast_tool_call_duration_seconds_bucket"][(("le", "60.0"), *labels)] == len(ds)  # none takes a minute
    # Model calls: every iteration after a run's first (3 turns in the finished run, 1 in the failed one).
    model, iteration = turn_durations(dsn)
    assert len(model) == len(iteration) == 2
    assert got["agentfast_model_call_duration_seconds_count"][()] == 2
    assert got["agentfast_model_call_duration_seconds_sum"][()] == pytest.approx(sum(model), abs=1e-6)
    assert got["agentfast_iteration_duration_seconds_count"][()] == 2
    assert got["agentfast_iteration_duration_seconds_sum"][()] == pytest.approx(sum(iteration), abs=1e-6)
    # An iteration is its model call and then its tools: iteration 2 ran its tools (the approved refund) after its turn.
    assert got["agentfast_iteration_duration_seconds_sum"][()] > got["agentfast_model_call_duration_seconds_sum"][()]


@pytest.mark.store
def test_a_scrape_with_the_store_down_says_so_and_counts_a_postgres_error(dsn: str) -> None:
    store = Store(dsn, retry_for_s=0.5)
    store.migrate()
    collector = metrics.StoreCollector(store)
    store.close()
    before = metrics.POSTGRES_ERRORS.labels("scrape")._value.get()
    got = scrape(collector)
    assert got == {"agentfast_store_up": {(): 0}}
    assert metrics.POSTGRES_ERRORS.labels("scrape")._value.get() == before + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.store
def test_metrics_are_served_over_http_in_the_prometheus_text_format(store: Store) -> None:
    assert drive(store, refund_run("refund-http")).phase == "WaitingForApproval"
    registry = CollectorRegistry()
    metrics.collect_store(store, registry=registry)
    # The process figures are ordinary prometheus_client metrics; here one of our own registry.
    errors = metrics.Counter("agentfast_reconcile_errors_total", "test", ["handler"], registry=registry)
    errors.labels("agentrun").inc()
    port = metrics.serve(_free_port(), registry=registry)
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["agentfast_runs"].type == "gauge"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("agentfast_runs", (("phase", "WaitingForApproval"),))] == 1
    assert samples[("agentfast_approvals_waiting", (("reason", "requires_approval"),))] == 1
    assert samples[("agentfast_store_up", ())] == 1
    assert samples[("agentfast_reconcile_errors_total", (("handler", "agentrun"),))] == 1
    assert families["agentfast_tool_call_duration_seconds"].type == "histogram"
    assert samples[("agentfast_tool_call_duration_seconds_count", (("tool", "lookup_order"),))] == 1
    assert families["agentfast_tokens"].type == "counter"
    assert samples[("agentfast_tokens_total", (("kind", "prompt"),))] == 182 + 291


def test_the_port_comes_from_the_environment_and_none_means_no_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(metrics.PORT_ENV, raising=False)
    assert metrics.serve() is None
    port = _free_port()
    monkeypatch.setenv(metrics.PORT_ENV, str(port))
    assert metrics.serve(registry=CollectorRegistry()) == port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200


def test_a_reconcile_is_timed_and_a_postgres_failure_counted() -> None:
    handler = f"test-{uuid.uuid4().hex[:6]}"
    errors_before = metrics.POSTGRES_ERRORS.labels("reconcile")._value.get()
    with metrics.reconciling(handler):
        pass
    with pytest.raises(psycopg.OperationalError), metrics.reconciling(handler):
        raise psycopg.OperationalError("connection refused")
    with pytest.raises(KeyError), metrics.reconciling(handler):
        raise KeyError("not Postgres")
    assert metrics.RECONCILE_ERRORS.labels(handler)._value.get() == 2
    assert metrics.POSTGRES_ERRORS.labels("reconcile")._value.get() == errors_before + 1
    count = [
        s.value
        for s in metrics.RECONCILE_SECONDS.collect()[0].samples
        if s.name.endswith("_count") and s.labels["handler"] == handler
    ]
    assert count == [3]


def test_buckets_are_cumulative_with_an_inf_bucket() -> None:
    # width_bucket indexes: 0 below 0.1, 1 in [0.1, 0.5), 2 at or above 0.5 (the last bound).
    assert metrics._buckets((0.1, 0.5), {0: 2, 1: 3, 2: 4}) == [("0.1", 2.0), ("0.5", 5.0), ("+Inf", 9.0)]
    assert metrics._buckets((0.1, 0.5), {}) == [("0.1", 0.0), ("0.5", 0.0), ("+Inf", 0.0)]
