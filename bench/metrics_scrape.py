"""What one scrape of the operator's ``/metrics`` costs with many runs (operator/metrics.py).

``python -m bench.metrics_scrape [--runs 1000] [--reps 15]``: starts its own embedded
PostgreSQL, makes one real refund run in-process (the scripted model over real HTTP, a human's
approval, a second runner taking over), copies its rows to ``--runs`` runs in total (every
table the runner writes: the runs, their checkpoints, turns, tool-call journal and messages),
then times

* the scrape: :class:`StoreCollector` collected and rendered in the text format, as the
  endpoint serves it;
* the baseline, measured in the same run against the same server: a bare SELECT of the same rows
  the scrape aggregates (each run with its latest checkpoint's context and pending batch, every
  journal row's timestamps, every turn's) fetched to the client, unaggregated.

Prints the medians and the ratio scrape / baseline as JSON (below 1: aggregating in Postgres
costs less than shipping the rows it reads). Not part of ``python -m bench``'s full report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from agentfast.operator.metrics import StoreCollector
from agentfast.runner.adapters.vanilla import VanillaRunner
from agentfast.runner.examples import EXAMPLES_DSN_ENV, provision
from agentfast.runner.loop import run_id_of
from agentfast.runner.model import model_from_spec
from agentfast.runner.spec import parse_agentrun
from agentfast.runner.store import Store
from agentfast.runner.tools import ToolRegistry
from bench.pg import start_server

REPO = Path(__file__).resolve().parent.parent

#: The same rows the scrape reads, unaggregated: the baseline.
BASELINE_SQL = [
    """SELECT r.run_id, r.epoch, c.phase, c.context, c.pending FROM agentfast_runs r
       LEFT JOIN LATERAL (SELECT phase, context, pending FROM agentfast_checkpoints c WHERE c.run_id = r.run_id
                          ORDER BY checkpoint_id DESC LIMIT 1) c ON true""",
    "SELECT run_id, iteration, tool_name, started_at, finished_at FROM agentfast_tool_calls",
    "SELECT run_id, iteration, created_at FROM agentfast_turns",
]

_TABLES = {  # table -> its columns but run_id (copied as they are; epoch is set by the fence)
    "agentfast_messages": "seq, iteration, message",
    "agentfast_checkpoints": "checkpoint_key, iteration, message_count, phase, schema_version, context, pending, sdk_state, saved_at",
    "agentfast_turns": "iteration, message, prompt_tokens, completion_tokens, created_at",
    "agentfast_tool_calls": "iteration, position, call_id, idempotency_key, tool_call_id, tool_name, arguments, gated, idempotent,"
    " state, attempts, result, started_at, finished_at",
}


def template_run(store: Store) -> str:
    """One real refund run to the end (paused, approved, taken over, finished); its run id."""
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())
    doc["metadata"]["uid"] = str(uuid.uuid4())
    run = parse_agentrun(doc)
    store.create_run(run_id_of(run), run.metadata.uid, run.model_dump(mode="json", exclude_none=True))
    for _ in range(2):
        model = model_from_spec(run.spec.model)
        try:
            outcome = VanillaRunner(store, run, model, ToolRegistry.from_agentrun(run), wait_for_approval=False).run()
        finally:
            model.close()
        if outcome.phase == "WaitingForApproval":
            call_id = store.load_context(run_id_of(run))[1].call_id  # type: ignore[index]
            store.decide(run_id_of(run), call_id, "approve", decided_by="bench")
    assert outcome.phase == "Succeeded", outcome
    return run_id_of(run)


def copy_runs(dsn: str, template: str, copies: int) -> None:
    """``copies`` more runs with the template's rows (new run ids and uids), in one transaction.
    The fence trigger checks each row's epoch against its run's: the copies share the template's."""
    with psycopg.connect(dsn) as conn:
        epoch = conn.execute("SELECT epoch FROM agentfast_runs WHERE run_id = %s", (template,)).fetchone()[0]  # type: ignore[index]
        conn.execute("SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', '', true)", (str(epoch),))
        conn.execute(
            """INSERT INTO agentfast_runs (run_id, run_uid, spec, epoch)
               SELECT %s || '-' || i, gen_random_uuid()::text, spec, epoch FROM agentfast_runs, generate_series(1, %s) i
               WHERE run_id = %s""",
            (template, copies, template),
        )
        for table, cols in _TABLES.items():
            conn.execute(
                f"INSERT INTO {table} (run_id, {cols}, epoch) SELECT %s || '-' || i, {cols}, 0 FROM {table}, generate_series(1, %s) i"  # type: ignore[arg-type]
                " WHERE run_id = %s",
                (template, copies, template),
            )
        conn.execute("ANALYZE")


def timed(fn: Any, reps: int) -> list[float]:
    fn()  # warm: plans cached, pages in memory
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dsn", help="an empty database to use instead of a server of its own")
    args = ap.parse_args(argv)
    server = None
    dsn = args.dsn
    if dsn is None:
        server = start_server()
        dsn = server.create_database("metrics")
    try:
        os.environ.setdefault(EXAMPLES_DSN_ENV, provision(dsn, password=f"bench-{uuid.uuid4().hex}"))
        store = Store(dsn)
        store.migrate()
        template = template_run(store)
        copy_runs(dsn, template, args.runs - 1)
        registry = CollectorRegistry()
        registry.register(StoreCollector(store))

        def scrape() -> None:
            generate_latest(registry)

        def baseline() -> None:
            store.read_together([(q, None) for q in BASELINE_SQL])  # type: ignore[misc]  # literal SQL

        # Interleaved, so a load change on the shared machine hits both alike.
        scrapes, bases = [], []
        for _ in range(args.reps):
            scrapes += timed(scrape, 1)
            bases += timed(baseline, 1)
        rows = sum(len(r) for r in store.read_together([(q, None) for q in BASELINE_SQL]))  # type: ignore[misc]
        text = generate_latest(registry).decode()
        store.close()
        result = {
            "runs": args.runs,
            "rows_read": rows,
            "scrape_ms_median": round(statistics.median(scrapes) * 1000, 2),
            "baseline_ms_median": round(statistics.median(bases) * 1000, 2),
            "ratio_scrape_to_baseline": round(statistics.median(scrapes) / statistics.median(bases), 3),
            "reps": args.reps,
            "succeeded_runs_reported": next(
                float(line.split()[-1]) for line in text.splitlines() if line.startswith('agentfast_runs{phase="Succeeded"}')
            ),
        }
        print(json.dumps(result, indent=2))
        return result
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
