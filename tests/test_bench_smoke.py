"""The benchmark's code runs (bench/, issue 6), at a tiny size against the test server.

Not a performance assertion: a bench that silently broke would publish stale or empty figures.
Full runs: ``bash bench/run.sh`` (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import checkpoint, payloads, report, throughput  # noqa: E402
from bench.pg import pgbench_tps  # noqa: E402


@pytest.mark.process
def test_checkpoint_part_measures_every_subject(dsn: str) -> None:
    cfg = checkpoint.CheckpointConfig(lengths=[10, 100], reps=1, samples=3, heavy_samples=2, bytes_samples=2)
    res = checkpoint.run(dsn, cfg, lambda _: None)
    for s in cfg.subjects:
        for n in cfg.lengths:
            assert res.samples[s][n] and all(x > 0 for x in res.samples[s][n][0]), (s, n)
            assert res.wal_bytes[s][n] > 0 and res.row_bytes[s][n] > 0, (s, n)
            client, server = res.cpu_us(s, n)
            assert client > 0 and server > 0, (s, n)
    # The store appends three messages per checkpoint whatever the length: its rows do not grow.
    assert res.row_bytes["store"][100] < 1.5 * res.row_bytes["store"][10]
    # LangGraph's saver stores the whole message list again: its rows do.
    assert res.row_bytes["lg_saver"][100] > 2 * res.row_bytes["lg_saver"][10]
    load = checkpoint.measure_load(dsn, 100, 3)
    assert not math.isnan(load["load_snapshot"].median)
    text = report.render(
        {
            "mode": "test",
            "machine": {"cores": "2"},
            "duration_s": 1.0,
            "load": (0.0, 0.0),
            "checkpoint": res,
            "load_snapshot": load,
        }
    )
    assert "Store.commit_checkpoint" in text and "| checkpoint p50" in text


@pytest.mark.process
def test_payloads_part_measures_every_subject(pg_server) -> None:
    import uuid

    made: list[str] = []

    def new_database(prefix: str) -> str:
        made.append(f"{prefix}_{uuid.uuid4().hex[:8]}")
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{made[-1]}"')
        return pg_server.dsn_for(made[-1])

    try:
        res = payloads.run(new_database, payloads.PayloadsConfig(iterations=2, reps=1), lambda _: None)
    finally:
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            for name in made:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    # Stored once, out of the hot rows: what the Targets row's verdict reads.
    assert res.hot_ratio() < 1.5 and res.growth_ratio("large").median < 1.3 and res.growth_ratio("inline").median > 1.7
    assert "cannot be stored" in res.ceiling_message
    text = report.render({"mode": "test", "machine": {"cores": "2"}, "duration_s": 1.0, "load": (0.0, 0.0), "payloads": res})
    assert "| large payloads" in text and "### Large payloads" in text


def test_throughput_workers_and_pgbench(dsn: str, tmp_path: Path) -> None:
    from agentfast.runner.store import Store
    from bench.checkpoint import FLOOR_PAYLOAD
    from bench.workload import Prefiller

    with Store(dsn, pool_max=1) as store:
        store.migrate()
        runs = [Prefiller(store, dsn).make_run(10) for _ in range(2)]
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE bench_floor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, run_id text NOT NULL, payload jsonb NOT NULL)"
        )
    rate = throughput._run_procs(throughput._store_worker, lambda i: (dsn, runs[i][0], runs[i][1]), 2, 0.5)
    assert rate > 0
    script = tmp_path / "insert.sql"
    script.write_text(f"INSERT INTO bench_floor (run_id, payload) VALUES ('pgbench', '{FLOOR_PAYLOAD}');\n")
    tps, _ = pgbench_tps(dsn, script, 2, 1)
    assert tps > 0


class _Recorder:
    """A real Store whose public calls are recorded by name."""

    def __init__(self, store) -> None:  # noqa: ANN001
        self._store, self.calls = store, []

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self._store, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls.append(name)
            return attr(*args, **kwargs)

        return recorded


def test_iteration_subject_makes_the_loops_store_calls(dsn: str, tmp_path: Path) -> None:
    """The bench's "all store calls of one vanilla iteration" is what the real loop asks of the
    store in a steady iteration of two idempotent calls: no more, no fewer, in the same order."""
    import uuid

    import yaml

    from agentfast.runner.adapters.vanilla import VanillaRunner
    from agentfast.runner.model import model_from_spec
    from agentfast.runner.spec import parse_agentrun
    from agentfast.runner.store import Store
    from agentfast.runner.tools import ToolRegistry
    from bench.workload import Prefiller

    turns = [
        {"tool_calls": [{"id": f"c{i}{p}", "name": "echo", "arguments": {"text": f"{i}.{p}"}} for p in range(2)]}
        for i in range(3)
    ] + [{"content": "done"}]
    script = tmp_path / "two-calls.yaml"
    script.write_text(yaml.safe_dump({"model": "scripted-two", "turns": turns}))
    run = parse_agentrun(
        {
            "apiVersion": "agentfast.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": "bench-pin", "uid": str(uuid.uuid4())},
            "spec": {
                "model": {"name": "scripted-two", "script": str(script)},
                "input": "go",
                "tools": [{"name": "echo", "ref": "agentfast.testing.tools:echo"}],
            },
        }
    )
    with Store(dsn) as store:
        store.migrate()
        store.create_run("default/bench-pin", run.metadata.uid, run.model_dump(mode="json", exclude_none=True))
        loop = _Recorder(store)
        with model_from_spec(run.spec.model) as model:
            outcome = VanillaRunner(loop, run, model, ToolRegistry.from_agentrun(run), wait_for_approval=False).run()
        assert outcome.phase == "Succeeded"
        # Iteration 2 (steady: neither the takeover nor the last): between the 2nd and 3rd checkpoints.
        marks = [i for i, c in enumerate(loop.calls) if c.startswith("commit_checkpoint")]
        steady = loop.calls[marks[1] + 1 : marks[2] + 1]

        bench = _Recorder(store)
        lease, snap = Prefiller(store, dsn).make_run(10)
        checkpoint.Bench.iteration_step(bench, lease, snap, checkpoint.Bench.iteration_inputs(snap))
    assert bench.calls == steady, f"the bench makes {bench.calls}, the loop {steady}"


@pytest.mark.process
def test_model_part_measures_every_path_and_renders_its_target(tmp_path: Path) -> None:
    from bench import model as model_part

    cfg = model_part.ModelCallConfig(lengths=[10, 40], rounds=2, calls=2)
    res = model_part.run(tmp_path, cfg, lambda _: None)
    for path in ("new", "old", "post", "floor"):
        for n in cfg.lengths:
            assert len(res.cpu_ms[path][n]) == 2 and all(x > 0 for x in res.cpu_ms[path][n]), (path, n)
            assert all(w >= 0 for w in res.wall_ms[path][n]), (path, n)
        assert res.growth(path).n == 2
    assert res.body_bytes[40] > 3 * res.body_bytes[10]
    text = report.render({"mode": "test", "machine": {"cores": "2"}, "duration_s": 1.0, "load": (0.0, 0.0), "model": res})
    assert "| model call: client CPU at 40 messages ≤ 1.5× that at 10 |" in text and "SDK create() CPU ms" in text


def test_import_self_ms_sums_own_times_by_package() -> None:
    from bench.procs import import_self_ms

    trace = (
        "import time: self [us] | cumulative | imported package\n"
        "import time:      1500 |       1500 |     psycopg.pq\n"
        "import time:       500 |       2000 |   psycopg\n"
        "import time:      3000 |       3000 | pydantic\n"
        "status output line\n"
    )
    assert import_self_ms(trace) == {"pydantic": 3.0, "psycopg": 2.0}


@pytest.mark.process
def test_langgraph_part_measures_every_subject_and_renders_its_targets(dsn: str, tmp_path: Path) -> None:
    from bench import lg

    cfg = lg.LgConfig(lengths=[10, 300], reps=1, samples=2, bytes_samples=2, big_outputs=1, big_bytes=200_000)
    res = lg.run(dsn, tmp_path, cfg, lambda _: None)
    for s in lg.SUBJECTS:
        for n in cfg.lengths:
            assert res.samples[s][n][0] and all(x > 0 for x in res.samples[s][n][0]), (s, n)
            assert res.cpu_ms(s, n) > 0, (s, n)
    # The adapter writes the same rows per superstep whatever the length; PostgresSaver the whole list.
    assert (
        res.rows["adapter"][300] < 1.3 * res.rows["adapter"][10]
        and res.largest["adapter"][300] < 1.3 * res.largest["adapter"][10]
    )
    assert res.rows["lg_pg"][300] > 3 * res.rows["lg_pg"][10]
    assert set(res.big) == {"vanilla", "langgraph"} and all(v["outputs"] == 1 and v["bytes"] > 200_000 for v in res.big.values())
    text = report.render({"mode": "test", "machine": {"cores": "2"}, "duration_s": 1.0, "load": (0.0, 0.0), "langgraph": res})
    assert "| LangGraph adapter: superstep growth 10 → 300 messages" in text and "### The LangGraph adapter" in text


@pytest.mark.store
def test_the_metrics_scrape_bench_copies_a_real_run_and_measures_both(dsn: str) -> None:
    from bench import metrics_scrape

    res = metrics_scrape.main(["--runs", "5", "--reps", "2", "--dsn", dsn])
    assert res["succeeded_runs_reported"] == 5  # the copies are runs the collector reads as the template
    assert res["rows_read"] == 5 * (1 + 3 + 3) and res["scrape_ms_median"] > 0 and res["baseline_ms_median"] > 0


def test_the_inbox_bench_serves_the_pages_it_times(dsn: str) -> None:
    from bench import inbox

    res = inbox.main(["--runs", "3", "--reps", "1", "--dsn", dsn])
    assert res["runs"] == 3 and res["index_ms_median"] > 0 and res["live_check_ms_median"] > 0
