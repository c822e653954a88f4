"""End to end: the operator's ``/metrics`` (operator/metrics.py) on a real cluster, scraped through
the API server's pod proxy (``kubectl get --raw .../pods/POD:PORT/proxy/metrics``), checked
against a refund run this test makes and against Postgres itself.

Every operator replica answers; exactly one (the leader) adds the runs' figures. The figures are
over every run the store holds (other tests' runs too), so the run's own contribution is checked
as a difference, and the totals against the same sums computed in Postgres at a quiet moment.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .helpers import Kube
from .test_operator import apply_refund, approve, assert_succeeded_once, release, sql, status, wait_awaiting  # noqa: F401 (release is a fixture)

METRICS_PORT = 8081  # the chart's metrics.port default

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def operator_pods(k: Kube) -> list[str]:
    out = k.run("get", "pods", "-l", "app.kubernetes.io/component=operator", "-o", "json").stdout
    return [
        p["metadata"]["name"]
        for p in json.loads(out)["items"]
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def scrape_pod(k: Kube, pod: str) -> Samples:
    """One scrape of ``pod``'s /metrics through the API server, parsed as Prometheus parses it."""
    text = k.run(
        "get", "--raw", f"/api/v1/namespaces/{k.namespace}/pods/{pod}:{METRICS_PORT}/proxy/metrics", namespaced=False
    ).stdout
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def scrape_leader(k: Kube) -> Samples:
    """The scrape of the one replica that serves the runs' figures (agentfast_operator_leader 1).
    Waits (60 s) while a replica just started does not answer yet or the lease changes hands."""

    def attempt() -> dict[str, Samples] | None:
        try:
            scrapes = {pod: scrape_pod(k, pod) for pod in operator_pods(k)}
        except AssertionError:  # a replica not listening yet
            return None
        leaders = [s for s in scrapes.values() if s.get(("agentfast_operator_leader", ())) == 1]
        return scrapes if len(leaders) == 1 else None

    scrapes = k.wait_for("exactly one operator replica serving the runs' figures", attempt, timeout=60)
    (leader,) = [s for s in scrapes.values() if s.get(("agentfast_operator_leader", ())) == 1]
    for s in scrapes.values():  # a standby serves its process figures only: the runs are never counted twice
        assert (("agentfast_store_up", ()) in s) == (s is leader)
    return leader


def value(s: Samples, name: str, **labels: str) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


TOTALS_SQL = """
SELECT coalesce(sum((c.context->'usage'->>'prompt_tokens')::bigint), 0),
       coalesce(sum((c.context->'usage'->>'completion_tokens')::bigint), 0),
       count(*) FILTER (WHERE c.phase = 'Succeeded')
FROM agentfast_runs r LEFT JOIN LATERAL (SELECT phase, context FROM agentfast_checkpoints c WHERE c.run_id = r.run_id
                                         ORDER BY checkpoint_id DESC LIMIT 1) c ON true"""


def test_metrics_follow_a_refund_run(release: Kube) -> None:
    k = release
    before = scrape_leader(k)
    assert value(before, "agentfast_store_up") == 1
    name, uid = apply_refund(k)
    wait_awaiting(k, name)

    waiting = scrape_leader(k)
    assert value(waiting, "agentfast_runs", phase="WaitingForApproval") >= 1
    assert value(waiting, "agentfast_approvals_waiting", reason="requires_approval") >= 1
    assert value(waiting, "agentfast_approval_oldest_wait_seconds", reason="requires_approval") > 0
    # The runner pod's work is read from the store: lookup_order ran in iteration 1.
    assert (
        value(waiting, "agentfast_tool_call_duration_seconds_count", tool="lookup_order")
        >= value(before, "agentfast_tool_call_duration_seconds_count", tool="lookup_order") + 1
    )

    approve(k, name, "call-2-0")
    assert_succeeded_once(k, name, uid, min_restarts=0)
    st = status(k, name)
    after = scrape_leader(k)
    assert value(after, "agentfast_runs", phase="Succeeded") >= value(before, "agentfast_runs", phase="Succeeded") + 1
    tokens = value(after, "agentfast_tokens_total", kind="prompt") + value(after, "agentfast_tokens_total", kind="completion")
    tokens_before = value(before, "agentfast_tokens_total", kind="prompt") + value(
        before, "agentfast_tokens_total", kind="completion"
    )
    assert st["tokensUsed"] == 182 + 291 + 402 + 21 + 68 + 63  # the scripted conversation's usage
    assert tokens - tokens_before >= st["tokensUsed"]
    assert (
        value(after, "agentfast_tool_call_duration_seconds_count", tool="issue_refund")
        >= value(before, "agentfast_tool_call_duration_seconds_count", tool="issue_refund") + 1
    )
    assert (
        value(after, "agentfast_model_call_duration_seconds_count")
        >= value(before, "agentfast_model_call_duration_seconds_count") + 2
    )
    # The operator's own figures: it reconciled this AgentRun and published its progress.
    reconciles = sum(v for (n, labels), v in after.items() if n == "agentfast_reconcile_duration_seconds_count")
    assert reconciles > 0
    assert value(after, "agentfast_status_lag_seconds_count") > 0

    # The totals are Postgres's own sums: compared at a moment no run moved between two scrapes.
    for _ in range(10):
        first = scrape_leader(k)
        prompt, completion, succeeded = sql(k, TOTALS_SQL)[0]
        second = scrape_leader(k)
        keys = [("agentfast_tokens_total", (("kind", "prompt"),)), ("agentfast_tokens_total", (("kind", "completion"),))]
        keys.append(("agentfast_runs", (("phase", "Succeeded"),)))
        if all(first.get(key) == second.get(key) for key in keys):
            assert value(second, "agentfast_tokens_total", kind="prompt") == int(prompt)
            assert value(second, "agentfast_tokens_total", kind="completion") == int(completion)
            assert value(second, "agentfast_runs", phase="Succeeded") == int(succeeded)
            break
    else:
        pytest.fail("the store's runs kept changing between scrapes; no quiet moment to compare in")
