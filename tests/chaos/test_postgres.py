"""Chaos: Postgres misbehaving under running runners.

- **Restarts** at random moments of a run (fast and immediate, i.e. crash-recovery, restarts, and
  stop / pause / start): the runner carries on, or exits 75 (or 3 when it starts while the server
  is down) and is resumed; the end state equals an uninterrupted run's.
- **Read-only** (a failover: connections drop and land on a server that refuses writes) while a
  runner waits for an approval: no tool runs whose intent could not be recorded; once the
  server takes writes again the run goes on and ends as an uninterrupted one.
- **A revoked privilege** on the journal or on the checkpoints: the runner stops with 75, not a
  crash, having run no tool it could not journal (and re-running none it had journaled) and
  continues once the grant is back.
- **Out of disk**, for real: the runtime's tables on a tablespace on a small tmpfs that the test
  fills up mid-run (the tools' own tables stay on the main disk: their service is elsewhere).

The session's server is shared: every test leaves it running.

    pytest tests/chaos/test_postgres.py -q -s
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import pytest

from agentfast.runner.examples import EXAMPLES_DSN_ENV
from agentfast.runner.store import Store

from ..helpers import examples_dsn_for, spawn_cli
from .harness import (
    LANGGRAPH_BATCH,
    LANGGRAPH_LONG,
    LANGGRAPH_REFUND,
    VANILLA_BATCH,
    VANILLA_LONG,
    VANILLA_REFUND,
    ChaosRun,
    Db,
    Scenario,
    Stats,
    compare,
    create_database,
    drop_database,
    end_state,
    large_run,
    poll_state,
    write_results,
)

# The CI size uses the 7-iteration script; a large run the 13-iteration one (longer windows).
SCENARIOS = (VANILLA_LONG, LANGGRAPH_LONG) if large_run() else (VANILLA_BATCH, LANGGRAPH_BATCH)


@pytest.fixture
def fresh_db(pg_server):
    names: list[str] = []

    def make(prefix: str = "pg", **options: str) -> str:
        names.append(create_database(pg_server, prefix, **options))
        return pg_server.dsn_for(names[-1])

    yield make
    for n in names:
        drop_database(pg_server, n)


# -- restarts ------------------------------------------------------------------------------------


def _server_running(pg_server) -> bool:
    try:
        pg_server.pg_ctl("status")
        return True
    except subprocess.CalledProcessError:
        return False


def _start(pg_server) -> None:
    """Start the embedded server with the options it was first started with."""
    emb = pg_server._embedded
    socket_dir = psycopg.conninfo.conninfo_to_dict(pg_server.admin_dsn)["host"]
    pg_server.pg_ctl("-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(emb.log), "start")


def ensure_running(pg_server) -> None:
    if not _server_running(pg_server):
        _start(pg_server)


def outage(pg_server, kind: str, gap_s: float) -> None:
    if kind == "restart-fast":
        pg_server.pg_ctl("-w", "-m", "fast", "restart")
    elif kind == "restart-immediate":  # no shutdown checkpoint: crash recovery on the way up
        pg_server.pg_ctl("-w", "-m", "immediate", "restart")
    else:  # stopped for gap_s, then started
        pg_server.pg_ctl("-w", "-m", "fast", "stop")
        try:
            time.sleep(gap_s)
        finally:
            _start(pg_server)


def test_postgres_restarts_at_random_moments_lose_nothing(
    pg_server, fresh_db, tmp_path: Path, chaos_seed: int, references
) -> None:
    seed = chaos_seed
    references.prefetch(SCENARIOS)
    rounds = int(os.environ.get("AGENTFAST_CHAOS_PG_ROUNDS", "12" if large_run() else "1"))
    print(f"\npostgres restart chaos seed {seed} (replay: AGENTFAST_CHAOS_SEED={seed}), {rounds} rounds")
    stats = Stats()
    tally = {
        "rounds": 0,
        "outages": 0,
        "restart-fast": 0,
        "restart-immediate": 0,
        "stop-start": 0,
        "long-outage": 0,
        "exits_75": 0,
        "exits_3": 0,
        "processes": 0,
    }
    try:
        for r in range(rounds):
            sc = SCENARIOS[(seed + r) % 2]  # one round in CI: the seed picks the adapter
            ref = references.get(sc)
            rng = random.Random(f"{seed}:pg:{r}")
            dsn = fresh_db("pgr")
            with Store(dsn, retry_for_s=180) as store:
                store.migrate()
                run = ChaosRun(
                    sc,
                    dsn=dsn,
                    store=store,
                    directory=tmp_path,
                    rng=rng,
                    stats=stats,
                    kills=0,
                    reference=ref,
                    label=f"pg round {r} {sc.name}",
                    allowed_exits=(0, 3, 75),
                )
                # Outages at random moments of the run's active time; in a large run, one round
                # keeps the server down past the runner's 30 s retry window (the exit-75 path).
                plan = sorted(
                    (
                        rng.uniform(0, ref.active_s),
                        rng.choice(["restart-fast", "restart-immediate", "stop-start"]),
                        rng.uniform(0.2, 3.0),
                    )
                    for _ in range(rng.randint(2, 3))
                )
                if large_run() and r == 1:
                    plan = [(rng.uniform(0, ref.active_s), "long-outage", 40.0)]
                done = threading.Event()
                errors: list[BaseException] = []

                def chaos() -> None:
                    try:
                        db = Db(dsn)
                        while not done.is_set() and (poll_state(db, run.run_id).epoch or 0) < 1:
                            time.sleep(0.02)
                        t0 = time.monotonic()
                        for at, kind, gap in plan:
                            while not done.is_set() and time.monotonic() < t0 + at:
                                time.sleep(0.01)
                            gate = None
                            if kind == "long-outage":
                                # Catch the runner inside a store call, not inside a tool or an
                                # approval wait (those outlast an outage on their own): hold its
                                # next checkpoint insert on a table lock, then stop the server.
                                # The 30 s retry window runs out: exit 75, then 3 until it is back.
                                gate = psycopg.connect(dsn)
                                gate.execute("LOCK TABLE agentfast_checkpoints IN EXCLUSIVE MODE")
                                deadline = time.monotonic() + 60
                                while (
                                    not done.is_set()
                                    and time.monotonic() < deadline
                                    and not db.query(
                                        """SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'
                                           AND query LIKE 'INSERT INTO agentfast_checkpoints%%'"""
                                    )
                                ):
                                    time.sleep(0.01)
                            if done.is_set():
                                return
                            try:
                                outage(pg_server, "stop-start" if kind == "long-outage" else kind, gap)
                            finally:
                                if gate is not None:
                                    gate.close()  # its session ended with the server
                            tally["outages"] += 1
                            tally[kind] += 1
                    except BaseException as err:
                        errors.append(err)
                    finally:
                        db.close()

                t = threading.Thread(target=chaos, daemon=True)
                t.start()
                try:
                    run.drive()
                finally:
                    done.set()
                    t.join(timeout=120)
                    ensure_running(pg_server)
                if errors:
                    raise errors[0]
                v = run.verdict(ref)
                tally["rounds"] += 1
                tally["processes"] += run.counts["processes"]
                tally["exits_75"] += run.counts["retry_exits"]
                tally["exits_3"] += run.counts["start_failures"]
                print(
                    f"round {r} {sc.name}: plan {[(round(a, 2), k, round(g, 1)) for a, k, g in plan]}, "
                    f"processes {run.counts['processes']}: {' | '.join(run.log)}"
                )
                run.close()
                assert not v.problems, f"seed {seed} round {r}:\n" + "\n".join(v.problems)
                assert not stats.problems, "\n".join(stats.problems)
    finally:
        ensure_running(pg_server)
    print(tally)
    write_results("postgres_restarts", {"seed": seed, **tally})


# -- read-only, privileges ----------------------------------------------------------------------


def _terminate_clients(admin_dsn: str, datname: str) -> None:
    """Drop every session of the database (what clients see when a primary goes away)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (datname,)
        )


def _journal_row(db: Db, run_id: str, call_id: str) -> tuple[str, int]:
    [(state, attempts)] = db.query(
        "SELECT state, attempts FROM agentfast_tool_calls WHERE run_id = %s AND call_id = %s", run_id, call_id
    )
    return state, attempts


def _executions(db: Db, uid: str, tool: str) -> int:
    return len(
        db.query(
            "SELECT 1 FROM agentfast_examples.demo_tool_invocations WHERE tool = %s AND idempotency_key LIKE %s", tool, f"{uid}:%"
        )
    )


def _wait_for_pause(run: ChaosRun, proc: subprocess.Popen | None = None, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = poll_state(run.db, run.run_id)
        if st.phase == "WaitingForApproval":
            return st.pending_id
        if proc is not None and proc.poll() is not None and st.phase != "WaitingForApproval":
            out, _ = proc.communicate()
            pytest.fail(f"the runner exited {proc.returncode} before pausing:\n{out[-3000:]}")
        time.sleep(0.05)
    pytest.fail("the run never paused for approval")


@pytest.mark.parametrize(
    "scenario", [VANILLA_REFUND, LANGGRAPH_REFUND] if large_run() else [VANILLA_REFUND], ids=lambda s: s.adapter
)
def test_a_read_only_failover_runs_no_tool_it_cannot_journal(
    pg_server, fresh_db, tmp_path: Path, scenario: Scenario, references
) -> None:
    references.prefetch([VANILLA_REFUND, LANGGRAPH_REFUND])
    dsn = fresh_db("ro")
    datname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    admin = psycopg.conninfo.make_conninfo(dsn, options="-c default_transaction_read_only=off")  # the operator's, elsewhere
    with Store(admin, retry_for_s=60) as store:
        store.migrate()
        run = ChaosRun(
            scenario,
            dsn=dsn,
            store=store,
            directory=tmp_path,
            rng=random.Random(7),
            stats=None,
            kills=0,
            reference=references.get(scenario),
            label=f"read-only {scenario.adapter}",
        )
        proc = spawn_cli("run", str(run.path), dsn=dsn)
        try:
            call = _wait_for_pause(run, proc)
            assert call == "call-2-0"
            with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{datname}" SET default_transaction_read_only = on')
            _terminate_clients(pg_server.admin_dsn, datname)
            store.decide(run.run_id, call, "approve", decided_by="chaos")  # the runner wakes into a read-only server

            time.sleep(2.5)
            while_read_only = proc.poll()
            assert while_read_only in (None, 75), (
                f"exit {proc.returncode} on a read-only server:\n{proc.communicate()[0][-3000:]}"
            )
            assert _executions(run.db, run.uid, "issue_refund") == 0, "the refund ran though its intent could not be journaled"
            assert _journal_row(run.db, run.run_id, "call-2-0") == ("planned", 0)

            with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:  # the failover completes
                conn.execute(f'ALTER DATABASE "{datname}" RESET default_transaction_read_only')
            _terminate_clients(pg_server.admin_dsn, datname)
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode in (0, 75), out[-3000:]
            if proc.returncode == 75:
                proc = spawn_cli("resume", run.run_name, dsn=dsn)
                out, _ = proc.communicate(timeout=90)
                assert proc.returncode == 0, out[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        v = compare(references.get(scenario).state, end_state(store, run.db, run.run_id, run.uid, scenario.ledger), set())
        assert not v.problems, v.problems
        assert _executions(run.db, run.uid, "issue_refund") == 1
        run.close()
    write_results(
        f"read_only_{scenario.adapter}",
        {"exit_while_read_only": while_read_only, "refund_runs_while_read_only": 0, "refund_runs": 1, "same_as_reference": True},
    )


@pytest.mark.parametrize("privilege,table", [("UPDATE", "agentfast_tool_calls"), ("INSERT", "agentfast_messages")])
def test_a_revoked_privilege_stops_the_runner_safely(
    pg_server, fresh_db, tmp_path: Path, privilege: str, table: str, references
) -> None:
    """Revoked UPDATE on the journal: the approved refund's intent cannot be recorded, so it must
    not run. Revoked INSERT on the transcript: the takeover checkpoint (no new message) commits,
    the refund runs and its result is journaled, but the iteration cannot commit; after the grant
    is back the result is stitched in, not re-run."""
    scenario = VANILLA_REFUND
    dsn = fresh_db("priv")
    role = f"chaos_runner_{os.getpid()}_{random.randrange(10**6)}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A role with the store's table privileges and no tenant: BYPASSRLS, so that what is under
        # test is the privilege revoked below, not row-level security (tests/test_tenants.py).
        conn.execute(f'CREATE ROLE "{role}" LOGIN BYPASSRLS')
    runner_dsn = psycopg.conninfo.make_conninfo(dsn, user=role)
    try:
        with Store(dsn, retry_for_s=60) as store:
            store.migrate()
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
                conn.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"')
                conn.execute(f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
                # and the functions a runner calls, as agentfast_runner holds them (some, such as
                # agentfast_record_reply, are revoked from PUBLIC)
                conn.execute(f'GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO "{role}"')
            run = ChaosRun(
                scenario,
                dsn=runner_dsn,
                store=store,
                directory=tmp_path,
                rng=random.Random(11),
                stats=None,
                kills=0,
                reference=references.get(scenario),
                label=f"revoked {privilege} on {table}",
            )
            tools = {EXAMPLES_DSN_ENV: examples_dsn_for(dsn)}  # the refund's own database (G11)
            admin = Db(dsn)  # the runner's role may not read the tools' tables
            res = spawn_cli("run", str(run.path), "--no-wait", dsn=runner_dsn, env=tools)
            out, _ = res.communicate(timeout=90)
            assert res.returncode == 0 and poll_state(run.db, run.run_id).phase == "WaitingForApproval", out[-3000:]
            store.decide(run.run_id, "call-2-0", "approve", decided_by="chaos")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'REVOKE {privilege} ON {table} FROM "{role}"')

            res = spawn_cli("resume", run.run_name, dsn=runner_dsn, env=tools)
            out, _ = res.communicate(timeout=90)
            assert res.returncode == 75, f"exit {res.returncode} without the {privilege} privilege on {table}:\n{out[-3000:]}"
            assert "Traceback" not in out, out[-3000:]
            if table == "agentfast_tool_calls":
                assert _executions(admin, run.uid, "issue_refund") == 0, "the refund ran though its intent could not be journaled"
                assert _journal_row(run.db, run.run_id, "call-2-0") == ("planned", 0)
            else:
                assert _executions(admin, run.uid, "issue_refund") == 1
                assert _journal_row(run.db, run.run_id, "call-2-0") == ("done", 1)
                assert poll_state(run.db, run.run_id).phase == "WaitingForApproval"  # the iteration did not commit

            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'GRANT {privilege} ON {table} TO "{role}"')
            res = spawn_cli("resume", run.run_name, dsn=runner_dsn, env=tools)
            out, _ = res.communicate(timeout=90)
            assert res.returncode == 0, out[-3000:]
            v = compare(references.get(scenario).state, end_state(store, admin, run.run_id, run.uid, scenario.ledger), set())
            assert not v.problems, v.problems
            assert _executions(admin, run.uid, "issue_refund") == 1
            run.close()
            admin.close()
        write_results(
            f"privilege_{privilege}_{table}",
            {
                "exit_while_revoked": 75,
                "refund_runs_while_revoked": 0 if table == "agentfast_tool_calls" else 1,
                "refund_runs": 1,
                "same_as_reference": True,
            },
        )
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


# -- out of disk ----------------------------------------------------------------------------------


@pytest.fixture
def small_tablespace(pg_server):
    """A tablespace on a 16 MiB tmpfs, owned by the server's OS user; yields (name, mount dir)."""
    if pg_server._embedded is None:
        pytest.skip("out-of-disk needs the embedded server (a tablespace on a tmpfs mounted on its host)")
    if os.geteuid() != 0:
        pytest.skip("out-of-disk mounts a small tmpfs, which needs root; docs/reliability.md says what was run")
    mnt = Path(tempfile.mkdtemp(prefix="agentfast-disk-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        user = pg_server._embedded.system_user
        if user:
            shutil.chown(mnt, user=user, group=user)
        name = f"chaos_small_{os.getpid()}_{random.randrange(10**6)}"
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLESPACE {name} LOCATION '{mnt}'")
        try:
            yield name, mnt
        finally:
            for f in mnt.glob("filler*"):
                f.unlink()
            with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
                for (db,) in conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'disk_%'").fetchall():
                    conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
                conn.execute(f"DROP TABLESPACE IF EXISTS {name}")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def _fill(mnt: Path) -> int:
    """Fill the tmpfs to the last byte; returns the bytes written."""
    written = 0
    with open(mnt / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            block = b"\0" * size
            try:
                while True:
                    written += f.write(block)
            except OSError:
                pass
    return written


def _rollbacks(db: Db, datname: str) -> int:
    """Transactions rolled back in the database so far (the statistics lag by up to a second)."""
    return db.query("SELECT xact_rollback FROM pg_stat_database WHERE datname = %s", datname)[0][0]


def test_out_of_disk_mid_run_runs_no_tool_it_cannot_journal(
    pg_server, small_tablespace, tmp_path: Path, chaos_seed: int, references
) -> None:
    space, mnt = small_tablespace
    seed = chaos_seed
    references.prefetch(SCENARIOS)
    rounds = int(os.environ.get("AGENTFAST_CHAOS_DISK_ROUNDS", "6" if large_run() else "1"))
    tally = {
        "rounds": 0,
        "full_windows": 0,
        "writes_refused_while_full": 0,
        "runtime_writes_refused": 0,
        "processes": 0,
        "exits_75": 0,
    }
    for r in range(rounds):
        sc = SCENARIOS[(seed + r) % 2]
        ref = references.get(sc)
        rng = random.Random(f"{seed}:disk:{r}")
        name = f"disk_{random.randrange(10**9)}"
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        dsn = pg_server.dsn_for(name)
        with Store(dsn, retry_for_s=120) as store:
            store.migrate()
            with psycopg.connect(dsn, autocommit=True) as conn:  # the runtime's tables (and a probe) on the small disk
                conn.execute(f"ALTER TABLE ALL IN TABLESPACE pg_default SET TABLESPACE {space}")
                conn.execute(f"ALTER INDEX ALL IN TABLESPACE pg_default SET TABLESPACE {space}")
                conn.execute(f"CREATE TABLE disk_probe (x text) TABLESPACE {space}")
            run = ChaosRun(
                sc,
                dsn=dsn,
                store=store,
                directory=tmp_path,
                rng=rng,
                stats=None,
                kills=0,
                reference=ref,
                label=f"disk round {r} {sc.name}",
                allowed_exits=(0, 75),
            )
            done = threading.Event()
            refused: list[int] = []
            runner_refused: list[int] = []

            def chaos() -> None:
                db = Db(dsn)
                try:
                    # Fill the disk once the run reaches a random early iteration (the tables are
                    # still small, so their next row needs a new page), until a write is refused.
                    # Not later than iteration 2: a scenario may end at 4, and then no runtime write
                    # is left to refuse (the one-round CI size failed so).
                    at = rng.randint(1, 2)
                    while (
                        not done.is_set()
                        and (
                            db.query("SELECT max(iteration) FROM agentfast_checkpoints WHERE run_id = %s", run.run_id)[0][0] or 0
                        )
                        < at
                    ):
                        time.sleep(0.01)
                    if done.is_set():
                        return
                    before = _rollbacks(db, name)
                    _fill(mnt)
                    print(f"disk full at iteration {at}: {shutil.disk_usage(mnt).free} bytes free", flush=True)
                    try:
                        db.query("INSERT INTO disk_probe SELECT repeat('x', 1000) FROM generate_series(1, 100)")
                    except psycopg.errors.DiskFull:
                        refused.append(1)
                    tally["full_windows"] += 1
                    # Full until the runtime has had a write refused (a rollback besides the
                    # probe's; or 10 s), then a while longer.
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline and not done.is_set() and _rollbacks(db, name) - before <= len(refused):
                        time.sleep(0.1)
                    time.sleep(rng.uniform(0.2, 2.0))
                    runner_refused.append(max(0, _rollbacks(db, name) - before - len(refused)))
                finally:
                    for f in mnt.glob("filler*"):
                        f.unlink()
                    print(f"disk freed: {shutil.disk_usage(mnt).free} bytes free", flush=True)
                    db.close()

            t = threading.Thread(target=chaos, daemon=True)
            t.start()
            try:
                run.drive()
            finally:
                done.set()
                t.join(timeout=60)
                for f in mnt.glob("filler*"):
                    f.unlink()
            tally["writes_refused_while_full"] += len(refused)
            tally["runtime_writes_refused"] += sum(runner_refused)
            tally["rounds"] += 1
            tally["processes"] += run.counts["processes"]
            tally["exits_75"] += run.counts["retry_exits"]
            v = run.verdict(ref)
            print(f"round {r} {sc.name}: {' | '.join(run.log)}")
            run.close()
            assert not run.counts["unexpected_exits"], f"seed {seed} round {r}:\n" + "\n".join(run.log)
            assert not v.problems, f"seed {seed} round {r}:\n" + "\n".join(v.problems)
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print(tally)
    write_results("out_of_disk", {"seed": seed, **tally})
    assert tally["writes_refused_while_full"] >= 1, "the disk never refused a write: the test did not test anything"
    assert tally["runtime_writes_refused"] >= 1, "the disk never refused one of the runtime's writes"
