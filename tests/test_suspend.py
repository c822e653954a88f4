"""A runner waiting for a human past ``AGENTFAST_SUSPEND_AFTER_SECONDS`` exits 0 and frees itself;
a decision then lets the next runner resume at the exact step (issue 14 item 2; in a pod the
operator sets the variable from ``spec.suspendAfter``). Real processes, real Postgres."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentfast.runner.store import Store

from .helpers import agentrun_file, count_rows, run_cli

pytestmark = pytest.mark.process  # every test here starts real OS processes (tests/conftest.py: tiers)

RUN_ID = "default/refund-demo"


def test_a_waiting_runner_suspends_and_a_decision_resumes_it_at_the_exact_step(dsn: str, store: Store, tmp_path: Path) -> None:
    path = agentrun_file(tmp_path)
    started = time.monotonic()
    first = run_cli("run", str(path), dsn=dsn, env={"AGENTFAST_SUSPEND_AFTER_SECONDS": "2"}, timeout=90)
    waited = time.monotonic() - started
    assert first.returncode == 0 and "suspended: no decision within 2 s" in first.stdout, first.stdout
    assert waited < 60, waited  # it did not wait for ever
    ctx, pending = store.load_context(RUN_ID)
    assert ctx.status.phase == "WaitingForApproval" and [a.call_id for a in pending.awaiting] == ["call-2-0"]
    store.decide(RUN_ID, "call-2-0", "approve", decided_by="cli:test")
    second = run_cli("resume", "refund-demo", dsn=dsn, env={"AGENTFAST_SUSPEND_AFTER_SECONDS": "2"}, timeout=90)
    assert second.returncode == 0, second.stdout
    ctx, _ = store.load_context(RUN_ID)
    assert ctx.status.phase == "Succeeded" and ctx.counters.iterations == 3 and ctx.counters.resumes == 1
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger") == 1
