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
import random
import signal
import time
from pathlib import Path

import pytest

from agentfast.runner.store import Store

from ..helpers import spawn_cli
from .harness import (
    LANGGRAPH_REFUND,
    VANILLA_REFUND,
    ChaosConfig,
    ChaosRun,
    Scenario,
    Stats,
    env_float,
    env_int,
    large_run,
    poll_state,
    run_many,
    write_results,
)


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
    print(
        f"\nchaos seed {cfg.seed} (replay: AGENTFAST_CHAOS_SEED={cfg.seed}); target {cfg.kills} kills, "
        f"budget {cfg.budget_s:.0f}s, {cfg.workers} workers"
    )
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


@pytest.mark.parametrize("scenario", [VANILLA_REFUND, LANGGRAPH_REFUND], ids=lambda s: s.adapter)
def test_sigkill_just_before_the_final_commit_then_resume_finishes(
    dsn: str, store: Store, tmp_path: Path, references, scenario: Scenario
) -> None:
    """Found by the large chaos run (seed 20261130, run 93): a LangGraph run killed after its
    graph's last superstep was committed, but before the run's own Succeeded commit, crashed on
    every resume ("the graph made no progress"), so it could never finish."""
    ref = references.get(scenario)
    run = ChaosRun(
        scenario,
        dsn=dsn,
        store=store,
        directory=tmp_path,
        rng=random.Random(3),
        stats=None,
        kills=0,
        reference=ref,
        label=f"final commit {scenario.adapter}",
    )
    # An uninterrupted process commits ref.commits checkpoints; the last one is the run's ending.
    first = spawn_cli("run", str(run.path), dsn=dsn, fault=f"checkpoint.before_commit@{ref.commits}")
    out = run.watch(first)
    assert first.returncode == -signal.SIGKILL and poll_state(run.db, run.run_id).phase == "Running", out[-2000:]
    proc = spawn_cli("resume", run.run_name, dsn=dsn)
    out = run.watch(proc)
    assert proc.returncode == 0, out[-3000:]
    verdict = run.verdict(ref)
    assert not verdict.problems, verdict.problems
    run.close()
