"""The benchmark's code runs (bench/, issue 6), at a tiny size against the test server.

Not a performance assertion: a bench that silently broke would publish stale or empty figures.
Full runs: ``bash bench/run.sh`` (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import checkpoint, report, throughput  # noqa: E402
from bench.pg import pgbench_tps  # noqa: E402


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
    text = report.render({"mode": "test", "machine": {"cores": "2"}, "duration_s": 1.0, "load": (0.0, 0.0),
                          "checkpoint": res, "load_snapshot": load})
    assert "Store.commit_checkpoint" in text and "| checkpoint p50" in text


def test_throughput_workers_and_pgbench(dsn: str, tmp_path: Path) -> None:
    from agentfast.runner.store import Store

    from bench.checkpoint import FLOOR_PAYLOAD
    from bench.workload import Prefiller

    with Store(dsn, pool_max=1) as store:
        store.migrate()
        runs = [Prefiller(store, dsn).make_run(10) for _ in range(2)]
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE bench_floor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, run_id text NOT NULL, payload jsonb NOT NULL)")
    rate = throughput._run_procs(throughput._store_worker, lambda i: (dsn, runs[i][0], runs[i][1]), 2, 0.5)
    assert rate > 0
    script = tmp_path / "insert.sql"
    script.write_text(f"INSERT INTO bench_floor (run_id, payload) VALUES ('pgbench', '{FLOOR_PAYLOAD}');\n")
    tps, _ = pgbench_tps(dsn, script, 2, 1)
    assert tps > 0
