"""Chaos: many scripted runs on both adapters, SIGKILLed at random points, resumed until done.

Each run is compared with an uninterrupted run of its scenario (transcript, iterations, tokens,
the effect rows its tools wrote); see tests/chaos/harness.py for what counts as a violation.
The CI size (defaults below: 12 kills, at most 4 per run, every scenario once) takes about a
minute on two busy cores; hack/chaos.sh runs a large
one (``AGENTFAST_CHAOS_KILLS``, default 1,000) and writes the table in docs/reliability.md.

    pytest tests/chaos/test_kill_resume.py -q -s                  # CI size, prints the seed
    AGENTFAST_CHAOS_SEED=123 pytest tests/chaos/test_kill_resume.py -s   # replay a schedule
    AGENTFAST_CHAOS_SEED=123 AGENTFAST_CHAOS_KILLS=1000 AGENTFAST_CHAOS_ONLY=13 pytest ... -s  # one run of a large one
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .harness import ChaosConfig, Stats, env_float, env_int, large_run, run_many, write_results


def test_sigkill_at_random_points_then_resume_changes_nothing(pg_server, tmp_path: Path, chaos_seed: int, references) -> None:
    cfg = ChaosConfig(
        seed=chaos_seed,
        kills=env_int("AGENTFAST_CHAOS_KILLS", 12),
        budget_s=env_float("AGENTFAST_CHAOS_BUDGET_S", 20.0),
        workers=env_int("AGENTFAST_CHAOS_WORKERS", 2),
        min_runs=4,  # every scenario at least once, whatever the budget
        max_kills_per_run=None if large_run() else 4,
        only=tuple(int(i) for i in os.environ.get("AGENTFAST_CHAOS_ONLY", "").split(",") if i),
    )
    print(f"\nchaos seed {cfg.seed} (replay: AGENTFAST_CHAOS_SEED={cfg.seed}); target {cfg.kills} kills, "
          f"budget {cfg.budget_s:.0f}s, {cfg.workers} workers")
    stats = Stats()
    started = time.monotonic()
    run_many(pg_server, cfg, tmp_path, stats, references)
    elapsed = time.monotonic() - started
    print(stats.summary())
    for p in stats.problems[:40]:
        print("PROBLEM", p)
    write_results("kill_resume", {"seed": cfg.seed, "elapsed_s": round(elapsed, 1), "workers": cfg.workers, **stats.as_dict()})
    total = stats.total()
    assert total["runs"] >= min(4, len(cfg.only) or 4), stats.summary()
    assert stats.violations() == 0, f"seed {cfg.seed}:\n{stats.summary()}\n" + "\n".join(stats.problems[:40])
