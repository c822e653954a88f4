"""Chaos: zombie runners. A runner is frozen with SIGSTOP at a random moment, a successor takes the
run over and finishes it, then the zombie is thawed with SIGCONT.

The zombie must exit 76 (lease lost) having written nothing (no row with its epoch appears after
it wakes) and having started no tool call (only the call it was frozen inside may finish; the
non-idempotent tool checks the fencing token, so even that one cannot send twice). The run's end
state must equal an uninterrupted run's.

``tests/test_runner_behaviour.py`` has the basic case (two live runners, one waiting); this is the
chaos variant: random freeze points on both adapters, and a freeze inside an open transaction.

    pytest tests/chaos/test_zombie.py -q -s
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from agentfast.runner.store import Store

from ..helpers import freeze as _freeze
from ..helpers import spawn_cli
from ..helpers import thaw as _thaw
from .harness import (
    LANGGRAPH_BATCH,
    VANILLA_BATCH,
    ChaosRun,
    Db,
    compare,
    end_state,
    large_run,
    poll_state,
    write_results,
)

RUN_TABLES = ("agentfast_messages", "agentfast_checkpoints", "agentfast_turns", "agentfast_tool_calls")


def rows_by_epoch(db: Db, run_id: str) -> dict[str, dict[int, int]]:
    out = {}
    for table in RUN_TABLES:
        out[table] = dict(db.query(f"SELECT epoch, count(*) FROM {table} WHERE run_id = %s GROUP BY epoch", run_id))
    return out


def _tick_until(run: ChaosRun, proc: subprocess.Popen, deadline: float, until=lambda: False) -> None:
    """Play the human for ``run`` until ``deadline``, ``until()`` or the process exits."""
    while time.monotonic() < deadline and proc.poll() is None and not until():
        run._human(poll_state(run.db, run.run_id), time.monotonic())
        time.sleep(0.02)


def _finish(run: ChaosRun, proc: subprocess.Popen, timeout: float) -> str:
    _tick_until(run, proc, time.monotonic() + timeout)
    if proc.poll() is None:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{run.label}: the successor did not finish in {timeout:.0f}s:\n{out[-3000:]}")
    out, _ = proc.communicate()
    return out


def test_a_zombie_frozen_at_a_random_moment_cannot_act_after_it_thaws(
    pg_server, dsn: str, store: Store, tmp_path: Path, chaos_seed: int, references
) -> None:
    seed = chaos_seed
    references.prefetch([VANILLA_BATCH, LANGGRAPH_BATCH])
    rounds = int(os.environ.get("AGENTFAST_CHAOS_ZOMBIE_ROUNDS", "40" if large_run() else "1"))
    print(f"\nzombie chaos seed {seed} (replay: AGENTFAST_CHAOS_SEED={seed}), {rounds} rounds")
    db = Db(dsn)
    tally = {
        "rounds": 0,
        "finished_before_freeze": 0,
        "zombies_fenced": 0,
        "zombie_finished_first": 0,
        "zombie_rows_after_thaw": 0,
        "zombie_tool_starts_after_thaw": 0,
        "takeover_blocked": 0,
        "diverged": 0,
        "duplicated_effects": 0,
        "lost_results": 0,
    }
    problems: list[str] = []
    try:
        for r in range(rounds):
            sc = (VANILLA_BATCH, LANGGRAPH_BATCH)[(seed + r) % 2]  # one round in CI: the seed picks the adapter
            ref = references.get(sc)
            rng = random.Random(f"{seed}:zombie:{r}")
            run = ChaosRun(
                sc,
                dsn=dsn,
                store=store,
                directory=tmp_path,
                rng=rng,
                stats=None,
                kills=0,
                reference=ref,
                label=f"zombie round {r} {sc.name}",
            )
            zombie = spawn_cli("run", str(run.path), dsn=dsn)
            try:
                _tick_until(run, zombie, time.monotonic() + 60, lambda: (poll_state(db, run.run_id).epoch or 0) >= 1)
                _tick_until(run, zombie, time.monotonic() + rng.uniform(0, ref.active_s))
                if zombie.poll() is not None:  # it finished before the freeze: nothing to thaw
                    zombie.communicate()
                    tally["finished_before_freeze"] += 1
                    assert zombie.returncode == 0 and poll_state(db, run.run_id).phase == "Succeeded"
                    run.close()
                    continue
                _freeze(zombie.pid)
                time.sleep(0.1)  # a statement the zombie had sent finishes on the server
                st = poll_state(db, run.run_id)
                frozen_epoch = st.epoch
                finished_first = st.phase == "Succeeded"
                in_flight = {
                    k
                    for (k,) in db.query(
                        "SELECT idempotency_key FROM agentfast_tool_calls WHERE run_id = %s AND state = 'started'", run.run_id
                    )
                }

                successor = spawn_cli("resume", run.run_name, "--force", dsn=dsn)
                _tick_until(run, successor, time.monotonic() + 30, lambda: (poll_state(db, run.run_id).epoch or 0) > frozen_epoch)
                if (poll_state(db, run.run_id).epoch or 0) <= frozen_epoch and successor.poll() is None:
                    tally["takeover_blocked"] += 1
                    problems.append(f"round {r}: the successor could not take the lease in 30s while the zombie was frozen")
                    _thaw(zombie.pid)
                out_s = _finish(run, successor, 90)
                assert successor.returncode == 0, out_s
                assert poll_state(db, run.run_id).phase == "Succeeded"

                before = rows_by_epoch(db, run.run_id)
                [(thawed_at,)] = db.query("SELECT clock_timestamp()")
                _thaw(zombie.pid)
                out_z, _ = zombie.communicate(timeout=90)
            finally:
                if zombie.poll() is None:
                    _thaw(zombie.pid)
                    zombie.kill()
                    zombie.communicate()
            tally["rounds"] += 1
            if finished_first:
                tally["zombie_finished_first"] += 1
                assert zombie.returncode == 0, out_z
            else:
                assert zombie.returncode == 76, f"round {r}: the zombie exited {zombie.returncode}:\n{out_z[-3000:]}"
                assert "another runner" in out_z and "Traceback" not in out_z, out_z[-3000:]
                tally["zombies_fenced"] += 1
            after = rows_by_epoch(db, run.run_id)
            for table in RUN_TABLES:
                if after[table].get(frozen_epoch, 0) > before[table].get(frozen_epoch, 0):
                    tally["zombie_rows_after_thaw"] += 1
                    problems.append(f"round {r}: {table} gained rows of the zombie's epoch {frozen_epoch} after it thawed")
            late = db.query(
                "SELECT tool, idempotency_key FROM agentfast_examples.chaos_invocations WHERE epoch = %s AND at > %s AND idempotency_key LIKE %s",
                frozen_epoch,
                thawed_at,
                f"{run.uid}:%",
            )
            for tool, key in late:
                if key not in in_flight:
                    tally["zombie_tool_starts_after_thaw"] += 1
                    problems.append(f"round {r}: the thawed zombie started {tool} {key}")
            v = compare(
                ref.state,
                end_state(store, db, run.run_id, run.uid, sc.ledger),
                run.denied_reruns,
                frozen_in_flight=(frozen_epoch, in_flight),
            )
            tally["diverged"] += v.diverged
            tally["duplicated_effects"] += v.duplicated_effects + v.unexpected_effects
            tally["lost_results"] += v.lost_results
            problems += [f"round {r}: {p}" for p in v.problems]
            print(f"round {r} {sc.name}: zombie exit {zombie.returncode}, epoch {frozen_epoch}, in flight {len(in_flight)}")
            run.close()
    finally:
        db.close()
    print(tally)
    write_results("zombie", {"seed": seed, **tally, "problems": problems})
    assert not problems, "\n".join(problems)


def _backend_waiting_on(db: Db, datname: str, query_prefix: str) -> int | None:
    rows = db.query(
        """SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock' AND query LIKE %s""",
        datname,
        query_prefix + "%",
    )
    return rows[0][0] if rows else None


# Where the zombie is parked: (the table the test locks so that the zombie's statement waits, the
# start of that statement, extra environment of the zombie, the state its session is left in once
# the lock is released and the statement has ended on the server without the frozen client).
PARKED = {
    # A write that carries a large payload is still BEGIN, the lease, the payload rows, the write,
    # COMMIT (store._write_statement): frozen after its payload insert, the zombie holds the run
    # row FOR SHARE (the fence trigger) in an open transaction. A 16-byte threshold sends every
    # longer text out of line, so the zombie soon makes such a write.
    "in an open transaction": (
        "agentfast_payloads",
        "INSERT INTO agentfast_payloads",
        {"AGENTFAST_PAYLOAD_THRESHOLD_BYTES": "16"},
        "idle in transaction",
    ),
    # A checkpoint is one statement, its own transaction (migration 12): it commits on the server
    # while the client is frozen, and leaves nothing open.
    "in a one-statement write": ("agentfast_checkpoints", "SELECT * FROM agentfast_commit_checkpoint", {}, "idle"),
}


@pytest.mark.parametrize("parked", sorted(PARKED))
def test_a_zombie_frozen_inside_a_transaction_does_not_block_the_takeover(
    pg_server, dsn: str, store: Store, tmp_path: Path, references, parked: str
) -> None:
    """A runner frozen (GC pause, SIGSTOP, a partitioned node) inside a transaction, between two of
    its statements, holds the run row FOR SHARE; the successor's takeover (epoch + 1) waits for that
    lock. It must not wait for ever: Postgres ends the zombie's idle transaction and the successor
    takes over. A zombie frozen while its one-statement write waits holds nothing once it ends."""
    table, statement, zombie_env, frozen_state = PARKED[parked]
    sc, ref = VANILLA_BATCH, references.get(VANILLA_BATCH)
    run = ChaosRun(
        sc,
        dsn=dsn,
        store=store,
        directory=tmp_path,
        rng=random.Random(1),
        stats=None,
        kills=0,
        reference=ref,
        label=f"zombie {parked}",
    )
    db = Db(dsn)
    datname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    # Park the zombie exactly inside a write: its statement waits for this table lock.
    gate = psycopg.connect(dsn)
    zombie = spawn_cli("run", str(run.path), dsn=dsn, env=zombie_env)
    try:
        _tick_until(run, zombie, time.monotonic() + 60, lambda: (poll_state(db, run.run_id).phase or "") == "Running")
        _tick_until(
            run,
            zombie,
            time.monotonic() + 60,
            lambda: any(k == "done" for (k,) in db.query("SELECT state FROM agentfast_tool_calls WHERE run_id = %s", run.run_id)),
        )
        gate.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
        deadline = time.monotonic() + 30
        while _backend_waiting_on(db, datname, statement) is None:
            assert time.monotonic() < deadline and zombie.poll() is None, f"the runner never reached {statement}"
            run._human(poll_state(db, run.run_id), time.monotonic())
            time.sleep(0.01)
        _freeze(zombie.pid)
        gate.commit()  # the statement completes on the server; the frozen client sends nothing more
        time.sleep(0.2)
        [(state,)] = db.query("SELECT state FROM pg_stat_activity WHERE datname = %s AND query LIKE %s", datname, statement + "%")
        assert state == frozen_state, state
        frozen_epoch = poll_state(db, run.run_id).epoch

        successor = spawn_cli("resume", run.run_name, "--force", dsn=dsn)
        t0 = time.monotonic()
        _tick_until(run, successor, t0 + 60, lambda: (poll_state(db, run.run_id).epoch or 0) > frozen_epoch)
        took = time.monotonic() - t0
        took_over = (poll_state(db, run.run_id).epoch or 0) > frozen_epoch
        if not took_over:
            _thaw(zombie.pid)  # unblock, so the run can still be checked below
        out_s = _finish(run, successor, 90)
        assert took_over, f"the successor waited {took:.0f}s for the frozen zombie's transaction and never took over"
        assert successor.returncode == 0, out_s
        before = rows_by_epoch(db, run.run_id)
        _thaw(zombie.pid)
        out_z, _ = zombie.communicate(timeout=90)
        assert zombie.returncode == 76, out_z[-3000:]
        assert rows_by_epoch(db, run.run_id) == before
    finally:
        gate.close()
        if zombie.poll() is None:
            _thaw(zombie.pid)
            zombie.kill()
            zombie.communicate()
    print(f"\nthe successor took over {took:.1f}s after the zombie froze {parked}")
    v = compare(ref.state, end_state(store, db, run.run_id, run.uid, sc.ledger), run.denied_reruns)
    assert not v.problems, v.problems
    db.close()
    run.close()
