"""The operator's Prometheus metrics (issue 18 item 1): ``/metrics`` on ``AGENTFAST_METRICS_PORT``.

Two kinds of figures, every name prefixed ``agentfast_``:

* the operator process's own (ordinary prometheus_client metrics, updated where it works):
  reconcile durations and errors by handler, status lag (a runner's commit, as Postgres
  notified it, to the status patch that shows it), Postgres errors, whether this replica leads;
* the runs' figures, read from the store at each scrape by :class:`StoreCollector`: runs by
  phase, calls awaiting a human and the oldest one's age, iterations, model and tool calls,
  tokens, cost, resumes, takeovers, and latency histograms of model calls, tool calls and
  iterations derived from the rows the runner writes anyway (turns, the tool-call journal).
  A runner pod that lived a second loses nothing: what it did is in Postgres, and every scrape
  reads it there. Four read-only statements in one transaction, one round trip, aggregated by
  Postgres (bench/metrics_scrape.py measures a scrape with 1,000 runs).

The store-derived ``_total`` figures sum over the runs the store holds: deleting a run's rows
(``ttlSecondsAfterFinished``, ``agentfast delete``) lowers them, which Prometheus reads as a
counter reset. docs/observability.md lists every metric with its meaning and unit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..runner.names import TERMINAL_PHASES, Phase
from ..runner.store import Store

log = logging.getLogger("agentfast.operator.metrics")

#: Environment variable naming the port of ``/metrics``; unset or empty: no endpoint.
PORT_ENV = "AGENTFAST_METRICS_PORT"

#: Upper bounds (seconds) of the latency histograms' buckets. Model calls and iterations take
#: seconds to minutes; tool calls milliseconds to minutes.
MODEL_BUCKETS_S: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOOL_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
RECONCILE_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# -- the operator process's own ----------------------------------------------------------------

RECONCILE_SECONDS = Histogram(
    "agentfast_reconcile_duration_seconds",
    "Time one reconcile handler took, seconds, by handler (create/update/resume, pod event, resync, ...)",
    ["handler"],
    buckets=RECONCILE_BUCKETS_S,
)
RECONCILE_ERRORS = Counter(
    "agentfast_reconcile_errors_total", "Reconcile handler calls that raised (kopf retries them), by handler", ["handler"]
)
STATUS_LAG_SECONDS = Histogram(
    "agentfast_status_lag_seconds",
    "From a runner's commit (Postgres NOTIFY received) to the AgentRun status patch that shows it, seconds",
    buckets=RECONCILE_BUCKETS_S,
)
POSTGRES_ERRORS = Counter(
    "agentfast_postgres_errors_total",
    "Operator work that failed because Postgres was unreachable or refused, by where (reconcile, publish, scrape)",
    ["where"],
)
LEADER = Gauge(
    "agentfast_operator_leader", "1 when this operator replica acts (holds the lease, serves the store figures), else 0"
)


def _is_postgres_error(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is a Postgres failure. The reconcile turns
    StoreUnavailable into kopf.TemporaryError("Postgres unavailable: ...") without a cause."""
    import psycopg

    from ..runner.store import StoreError

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, psycopg.Error | StoreError) or str(seen).startswith("Postgres unavailable"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def count_postgres_error(where: str, err: BaseException) -> None:
    """Count ``err`` under ``agentfast_postgres_errors_total{where}`` if it is a Postgres failure."""
    if _is_postgres_error(err):
        POSTGRES_ERRORS.labels(where).inc()


@contextmanager
def reconciling(handler: str) -> Iterator[None]:
    """Time the block as one call of ``handler`` and count it as an error (and a Postgres error
    when it is one) if it raises; the exception propagates unchanged."""
    start = time.perf_counter()
    try:
        yield
    except BaseException as err:
        RECONCILE_ERRORS.labels(handler).inc()
        count_postgres_error("reconcile", err)
        raise
    finally:
        RECONCILE_SECONDS.labels(handler).observe(time.perf_counter() - start)


F = TypeVar("F", bound=Callable[..., Any])


def timed(handler: str) -> Callable[[F], F]:
    """Decorator form of :func:`reconciling` for a handler function."""

    def wrap(fn: F) -> F:
        import functools

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with reconciling(handler):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]  # same signature: functools.wraps

    return wrap


# -- the runs' figures, from the store -----------------------------------------------------------

#: Each run with its latest checkpoint's phase, context and pending batch (the store's own
#: "latest checkpoint" lateral join; the (run_id, checkpoint_id) primary key serves it).
_LATEST = """WITH latest AS (
    SELECT r.run_id, r.epoch, c.phase, c.context, c.pending FROM agentfast_runs r
    LEFT JOIN LATERAL (SELECT phase, context, pending FROM agentfast_checkpoints c WHERE c.run_id = r.run_id
                       ORDER BY checkpoint_id DESC LIMIT 1) c ON true)
"""

#: Runs and their counters, by phase and cost currency ('' for a run without prices).
RUNS_SQL = (
    _LATEST
    + """SELECT coalesce(phase, 'Pending') AS phase, coalesce(context->'prices'->>'currency', '') AS currency,
       count(*) AS runs,
       coalesce(sum((context->'counters'->>'iterations')::bigint), 0) AS iterations,
       coalesce(sum((context->'counters'->>'model_calls')::bigint), 0) AS model_calls,
       coalesce(sum((context->'counters'->>'tool_calls')::bigint), 0) AS tool_calls,
       coalesce(sum((context->'counters'->>'tool_errors')::bigint), 0) AS tool_errors,
       coalesce(sum((context->'counters'->>'approvals_requested')::bigint), 0) AS approvals_requested,
       coalesce(sum((context->'counters'->>'resumes')::bigint), 0) AS resumes,
       coalesce(sum((context->'usage'->>'prompt_tokens')::bigint + lost.p), 0) AS prompt_tokens,
       coalesce(sum((context->'usage'->>'completion_tokens')::bigint + lost.q), 0) AS completion_tokens,
       coalesce(sum(greatest(epoch - 1, 0)), 0) AS takeovers,
       coalesce(sum((((context->'usage'->>'prompt_tokens')::bigint + lost.p)::float8
                     * (context->'prices'->>'promptPerMillionTokens')::float8
                   + ((context->'usage'->>'completion_tokens')::bigint + lost.q)::float8
                     * (context->'prices'->>'completionPerMillionTokens')::float8)
                  / 1e6), 0) AS cost
FROM latest
-- replies the endpoint answered whose turn a crash lost: paid for, counted (migration 17)
CROSS JOIN LATERAL (SELECT coalesce(sum(m.prompt_tokens), 0) AS p, coalesce(sum(m.completion_tokens), 0) AS q
                    FROM agentfast_model_replies m WHERE m.run_id = latest.run_id AND NOT m.kept) lost
GROUP BY 1, 2"""
)

#: Calls awaiting a human now, by reason, and the oldest one's request time (ms since the epoch):
#: the awaited calls of each unfinished run's latest checkpoint not decided yet. A checkpoint
#: written before schema 2 has no ``awaiting``: it awaits its own top-level call.
AWAITING_SQL = (
    _LATEST
    + """SELECT coalesce(a->>'reason', 'requires_approval') AS reason, count(*) AS calls,
       min((a->>'requested_at')::bigint) AS oldest_ms
FROM latest l, jsonb_array_elements(CASE WHEN jsonb_typeof(l.pending->'awaiting') = 'array'
                                              AND jsonb_array_length(l.pending->'awaiting') > 0
                                         THEN l.pending->'awaiting' ELSE jsonb_build_array(l.pending) END) a
WHERE jsonb_typeof(l.pending) = 'object' AND NOT (coalesce(l.phase, 'Pending') = ANY(%s))
  AND NOT EXISTS (SELECT 1 FROM agentfast_approvals d WHERE d.run_id = l.run_id AND d.call_id = a->>'call_id')
GROUP BY 1"""
)

#: Tool-call latency from the journal: started_at (the intent marked started) to finished_at (the
#: result recorded), both set by Postgres (now()), by tool; width_bucket counts per bucket.
TOOL_SQL = """SELECT tool_name, width_bucket(d, %s::float8[]) AS bucket, count(*) AS n, sum(d) AS total
FROM (SELECT tool_name, extract(epoch FROM finished_at - started_at)::float8 AS d FROM agentfast_tool_calls
      WHERE started_at IS NOT NULL AND finished_at IS NOT NULL AND finished_at >= started_at) t
GROUP BY 1, 2"""

#: Model-call and iteration latencies from the turns (created_at: when the model's reply was
#: stored) and the journal. An iteration ends at its turn or its last tool result, whichever is
#: later; the model call of iteration i took from the end of iteration i-1 to turn i; iteration
#: i took from the end of i-1 to its own end. The first iteration of a run has no measured start.
TURN_SQL = """WITH ends AS (
    SELECT t.run_id, t.iteration, t.created_at AS turn_at,
           greatest(t.created_at, (SELECT max(k.finished_at) FROM agentfast_tool_calls k
                                   WHERE k.run_id = t.run_id AND k.iteration = t.iteration)) AS end_at
    FROM agentfast_turns t),
d AS (
    SELECT extract(epoch FROM turn_at - lag(end_at) OVER w)::float8 AS model_s,
           extract(epoch FROM end_at - lag(end_at) OVER w)::float8 AS iteration_s
    FROM ends WINDOW w AS (PARTITION BY run_id ORDER BY iteration))
SELECT 'model' AS kind, width_bucket(model_s, %s::float8[]) AS bucket, count(*) AS n, sum(model_s) AS total
    FROM d WHERE model_s >= 0 GROUP BY 2
UNION ALL
SELECT 'iteration', width_bucket(iteration_s, %s::float8[]), count(*), sum(iteration_s)
    FROM d WHERE iteration_s >= 0 GROUP BY 2"""


def _buckets(bounds: tuple[float, ...], counts: dict[int, int]) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets from ``counts`` (width_bucket index -> rows): index 0 is
    below the first bound, i lies in [bounds[i-1], bounds[i]), len(bounds) is at or above the last."""
    out, seen = [], 0
    for i, le in enumerate(bounds):
        seen += counts.get(i, 0)
        out.append((repr(le), float(seen)))
    out.append(("+Inf", float(sum(counts.values()))))
    return out


class StoreCollector(Collector):
    """Reads the runs' figures from ``store`` at every collect (a scrape). A failed read yields
    only ``agentfast_store_up 0`` and counts a Postgres error; it never raises to the scraper."""

    def __init__(self, store: Store, *, now: Callable[[], float] = time.time):
        self.store = store
        self._now = now

    def describe(self) -> list[Any]:
        return []  # nothing at registration: a describe would cost a query

    def read(self) -> list[list[Any]]:
        """The four statements' rows (runs, awaiting, tool latencies, turn latencies), one
        transaction. Raises StoreUnavailable."""
        terminal = [str(p) for p in TERMINAL_PHASES]
        return self.store.read_together(
            [
                (RUNS_SQL, None),
                (AWAITING_SQL, (terminal,)),
                (TOOL_SQL, (list(TOOL_BUCKETS_S),)),
                (TURN_SQL, (list(MODEL_BUCKETS_S), list(MODEL_BUCKETS_S))),
            ]
        )

    def collect(self) -> Iterator[Any]:
        start = time.perf_counter()
        up = GaugeMetricFamily("agentfast_store_up", "1 when the last scrape read the store, 0 when it failed")
        try:
            runs, awaiting, tools, turns = self.read()
        except Exception as err:  # never fail the whole scrape: the process figures still count
            count_postgres_error("scrape", err)
            log.warning("metrics: reading the store failed: %s", err)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from self._runs(runs)
        yield from self._awaiting(awaiting)
        yield from self._histograms(tools, turns)
        took = GaugeMetricFamily("agentfast_store_scrape_duration_seconds", "Time the last scrape's store read took, seconds")
        took.add_metric([], time.perf_counter() - start)
        yield took

    def _runs(self, rows: list[Any]) -> Iterator[Any]:
        by_phase = {str(p): 0 for p in Phase}
        totals: dict[str, int] = {}
        names = ("iterations", "model_calls", "tool_calls", "tool_errors", "approvals_requested", "resumes", "takeovers")
        cost: dict[str, float] = {}
        tokens = {"prompt": 0, "completion": 0}
        for r in rows:
            by_phase[r["phase"]] = by_phase.get(r["phase"], 0) + int(r["runs"])
            for n in names:
                totals[n] = totals.get(n, 0) + int(r[n])
            tokens["prompt"] += int(r["prompt_tokens"])
            tokens["completion"] += int(r["completion_tokens"])
            if r["currency"]:
                cost[r["currency"]] = cost.get(r["currency"], 0.0) + float(r["cost"])
        phases = GaugeMetricFamily(
            "agentfast_runs", "Runs the store holds, by phase (their latest checkpoint's)", labels=["phase"]
        )
        for phase, count in by_phase.items():
            phases.add_metric([phase], count)
        yield phases
        helps = {
            "iterations": "Committed iterations (a model call and its tool calls) of the stored runs",
            "model_calls": "Model calls of the stored runs",
            "tool_calls": "Tool executions that returned (ok or error) in the stored runs",
            "tool_errors": "Tool calls that raised or could not be made in the stored runs",
            "approvals_requested": "Calls that went to a human (approval, in-flight re-run, question) in the stored runs",
            "resumes": "Times a new runner process took a stored run over and went on from its checkpoint",
            "takeovers": "Fencing epochs issued beyond each run's first lease (takeovers, plus the operator fencing an ended run)",
        }
        for name in names:
            total = CounterMetricFamily(f"agentfast_{name}", helps[name])
            total.add_metric([], totals.get(name, 0))
            yield total
        t = CounterMetricFamily("agentfast_tokens", "Tokens the model reported for the stored runs, by kind", labels=["kind"])
        for kind, v in tokens.items():
            t.add_metric([kind], v)
        yield t
        money = CounterMetricFamily(
            "agentfast_cost", "What the stored runs' tokens cost at their model's prices, by currency", labels=["currency"]
        )
        for cur, amount in sorted(cost.items()):
            money.add_metric([cur], amount)
        yield money

    def _awaiting(self, rows: list[Any]) -> Iterator[Any]:
        now = self._now()
        calls = GaugeMetricFamily(
            "agentfast_approvals_waiting", "Calls awaiting a human decision or reply now, by reason", labels=["reason"]
        )
        age = GaugeMetricFamily(
            "agentfast_approval_oldest_wait_seconds",
            "Age of the oldest call awaiting a human now, seconds, by reason (absent when none waits)",
            labels=["reason"],
        )
        seen = {"requires_approval": 0, "in_flight_not_idempotent": 0, "awaiting_input": 0}
        for r in rows:
            seen[r["reason"]] = int(r["calls"])
            if r["oldest_ms"] is not None:
                age.add_metric([r["reason"]], max(0.0, now - int(r["oldest_ms"]) / 1000))
        for reason, n in seen.items():
            calls.add_metric([reason], n)
        yield calls
        yield age

    def _histograms(self, tools: list[Any], turns: list[Any]) -> Iterator[Any]:
        by_tool: dict[str, tuple[dict[int, int], list[float]]] = {}
        for r in tools:
            counts, total = by_tool.setdefault(r["tool_name"], ({}, [0.0]))
            counts[int(r["bucket"])] = int(r["n"])
            total[0] += float(r["total"])
        h = HistogramMetricFamily(
            "agentfast_tool_call_duration_seconds",
            "Tool-call latency from the journal (started to result recorded), seconds, by tool",
            labels=["tool"],
        )
        for name, (counts, total) in sorted(by_tool.items()):
            h.add_metric([name], _buckets(TOOL_BUCKETS_S, counts), total[0])
        yield h
        kinds: dict[str, tuple[dict[int, int], list[float]]] = {"model": ({}, [0.0]), "iteration": ({}, [0.0])}
        for r in turns:
            counts, total = kinds[r["kind"]]
            counts[int(r["bucket"])] = int(r["n"])
            total[0] += float(r["total"])
        for kind, what in (("model", "model_call"), ("iteration", "iteration")):
            counts, total = kinds[kind]
            desc = {
                "model": "Model-call latency (end of the previous iteration to the reply stored), seconds; a run's first call is not measured",
                "iteration": "Iteration duration (end of the previous iteration to this one's last result), seconds; a run's first is not measured",
            }[kind]
            m = HistogramMetricFamily(f"agentfast_{what}_duration_seconds", desc)
            m.add_metric([], _buckets(MODEL_BUCKETS_S, counts), total[0])
            yield m


_COLLECTOR: list[StoreCollector] = []


def serve(port: int | None = None, *, registry: CollectorRegistry = REGISTRY) -> int | None:
    """Start the ``/metrics`` HTTP endpoint (a daemon thread) on ``port``, or on
    ``AGENTFAST_METRICS_PORT`` when None; returns the port, or None when neither names one.
    Raises OSError when the port is taken, ValueError for a port that is not a number."""
    if port is None:
        text = os.environ.get(PORT_ENV, "").strip()
        if not text:
            return None
        port = int(text)
    LEADER.set(0)
    start_http_server(port, registry=registry)
    log.info("metrics on :%d/metrics", port)
    return port


def collect_store(store: Store, *, registry: CollectorRegistry = REGISTRY) -> StoreCollector:
    """Serve ``store``'s run figures from now on (the acting replica: a standby serves only its
    process figures, so the runs are never counted twice); replaces an earlier store's collector."""
    for old in _COLLECTOR:
        registry.unregister(old)
    _COLLECTOR.clear()
    collector = StoreCollector(store)
    registry.register(collector)
    _COLLECTOR.append(collector)
    LEADER.set(1)
    return collector
