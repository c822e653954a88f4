"""The Postgres store against a real server: migrations, fencing (G6), checkpoint cost, retention,
write-once decisions and NOTIFY wake-ups."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from agentfast.runner.migrations import MIGRATIONS
from agentfast.runner.payloads import Limits
from agentfast.runner.snapshot import (
    AwaitedCall,
    Message,
    PendingToolCall,
    RunContext,
    RunStatus,
    Session,
    StateSnapshot,
    ToolCall,
    ToolResult,
    call_id,
    idempotency_key,
)
from agentfast.runner.store import (
    FENCE_SQLSTATE,
    DecisionConflict,
    InvalidDecision,
    JournalEntry,
    Lease,
    LeaseLost,
    Store,
    Turn,
    UnknownCall,
)

from .helpers import count_rows, fenced_rows

TABLES = {
    "agentfast_runs",
    "agentfast_messages",
    "agentfast_checkpoints",
    "agentfast_turns",
    "agentfast_tool_calls",
    "agentfast_approvals",
    "agentfast_migrations",
    "agentfast_locks",
    "agentfast_runners",
    "agentfast_void_decisions",
    "agentfast_tenants",
    "agentfast_cancel_requests",
    "agentfast_payloads",
    "agentfast_sdk_blobs",
    "agentfast_notifications",
    "agentfast_attempts",
    "agentfast_model_replies",
}


@contextmanager
def fresh_database(pg_server) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_server.dsn_for(name)
    finally:
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {r[0] for r in rows if r[0].startswith("agentfast_")}


def messages(start: int, n: int) -> list[Message]:
    # Fixed-width content, so message i costs the same bytes whatever i is.
    return [
        Message(role="user" if i % 2 == 0 else "assistant", content=f"message {i:06d} " + "x" * 100)
        for i in range(start, start + n)
    ]


def snapshot(
    run_id: str, uid: str, msgs: list[Message], iteration: int, phase: str = "Running", pending: PendingToolCall | None = None
) -> StateSnapshot:
    ctx = RunContext(session=Session(run_uid=uid, started_at=0), status=RunStatus(phase=phase))
    ctx.counters.iterations = iteration
    return StateSnapshot(run_id=run_id, context=ctx, messages=list(msgs), pending=pending, saved_at=1_700_000_000_000 + iteration)


def new_run(store: Store, name: str) -> tuple[str, str, Lease]:
    run_id, uid = f"default/{name}", str(uuid.uuid4())
    store.create_run(run_id, uid, {"spec": {"input": name}})
    return run_id, uid, store.acquire_lease(run_id)


def planned(uid: str, iteration: int, calls: list[tuple[str, bool, bool]]) -> tuple[Turn, list[JournalEntry]]:
    """A model turn asking for ``calls`` = [(tool name, gated, idempotent)], and its journal intent."""
    tcs = [ToolCall(id="call_1", name=name, arguments="{}") for name, _, _ in calls]  # provider id reused on purpose
    turn = Turn(iteration, Message(role="assistant", tool_calls=tcs), 100, 20)
    entries = [
        JournalEntry(
            iteration=iteration,
            position=pos,
            call_id=call_id(iteration, pos),
            idempotency_key=idempotency_key(uid, iteration, pos),
            tool_call=tc,
            gated=gated,
            idempotent=idem,
            state="planned",
            attempts=0,
            result=None,
        )
        for pos, (tc, (_, gated, idem)) in enumerate(zip(tcs, calls))
    ]
    return turn, entries


def pause(store: Store, lease: Lease, uid: str, entries: list[JournalEntry], awaited: list[str]) -> PendingToolCall:
    """Commit the checkpoint of a run paused on the calls ``awaited`` (decision ids) of ``entries``'s batch."""
    by_id = {e.call_id: e for e in entries}
    calls = [
        AwaitedCall(
            call_id=cid,
            iteration=by_id[base].iteration,
            position=by_id[base].position,
            tool_call=by_id[base].tool_call,
            idempotency_key=by_id[base].idempotency_key,
            reason="in_flight_not_idempotent" if "-rerun" in cid else "requires_approval",
        )
        for cid in awaited
        for base in [cid.split("-rerun")[0]]
    ]
    pending = PendingToolCall.of(calls, [])
    store.commit_checkpoint(
        lease, snapshot(lease.run_id, uid, [], entries[0].iteration - 1, "WaitingForApproval", pending), stored_messages=0
    )
    return pending


def result_for(e: JournalEntry, content: str = "ok") -> ToolResult:
    return ToolResult(
        call_id=e.call_id,
        position=e.position,
        tool_call_id=e.tool_call.id,
        tool_name=e.tool_call.name,
        content=content,
        idempotency_key=e.idempotency_key,
    )


# -- migrations ------------------------------------------------------------------------------------


def test_migrate_is_idempotent(dsn: str) -> None:
    with Store(dsn, retry_for_s=5) as s:
        assert s.migrate() == len(MIGRATIONS)
        assert tables(dsn) == TABLES
        assert s.migrate() == len(MIGRATIONS)
        assert s.migrate() == len(MIGRATIONS)
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_migrations") == len(MIGRATIONS)


def test_a_store_at_every_earlier_schema_version_upgrades_and_then_writes(pg_server) -> None:
    """A database left at any earlier schema version (a run registered there, with a checkpoint
    written by hand as a repair would) migrates to this release's, and the runner's writes (the
    functions of migration 12) then work on it and its earlier rows still load."""
    for version in range(1, len(MIGRATIONS)):
        name = f"t_up_{version}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        dsn = pg_server.dsn_for(name)
        try:
            with psycopg.connect(dsn) as conn:  # what Store.migrate did at that version
                conn.execute(
                    "CREATE TABLE agentfast_migrations (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
                )
                for v, migration in enumerate(MIGRATIONS[:version], start=1):
                    conn.execute(migration)
                    conn.execute("INSERT INTO agentfast_migrations (version) VALUES (%s)", (v,))
                uid = str(uuid.uuid4())
                conn.execute(
                    "INSERT INTO agentfast_runs (run_id, run_uid, spec, epoch) VALUES ('default/old', %s, '{}', 1)", (uid,)
                )
                conn.execute("SELECT set_config('agentfast.epoch', '1', true)")
                old = snapshot("default/old", uid, [], 0)
                conn.execute(
                    """INSERT INTO agentfast_checkpoints (run_id, checkpoint_key, iteration, message_count, phase, schema_version,
                                                          context, pending, sdk_state, saved_at, epoch)
                       VALUES ('default/old', %s, 0, 0, 'Running', %s, %s::jsonb, NULL, '{}', %s, 1)""",
                    (uuid.uuid4(), old.schema_version, old.context.model_dump_json(), old.saved_at),
                )
            with Store(dsn, retry_for_s=5) as s:
                assert s.schema_version() == version
                assert s.migrate() == len(MIGRATIONS)
                assert s.load_snapshot("default/old") is not None
                lease = s.acquire_lease("default/old")
                turn, entries = planned(uid, 1, [("add_case_note", False, True)])
                _, ends = s.save_turn_and_mark_started(lease, turn, entries, 0)
                assert ends is None
                s.record_result(lease, 1, 0, result_for(entries[0]))
                snap = snapshot("default/old", uid, [turn.message], 1)
                _, ends = s.commit_checkpoint_then_read_end_requests(lease, snap, stored_messages=0)
                assert ends is not None and ends.cancel is None
                assert [(e.state, e.attempts) for e in s.journal("default/old")] == [("done", 1)]
                assert s.load_snapshot("default/old").messages == [turn.message]
        finally:
            with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_concurrent_migrate_from_threads_on_a_fresh_database(dsn: str) -> None:
    stores = [Store(dsn, retry_for_s=5) for _ in range(4)]
    barrier = threading.Barrier(4)
    results: list[object] = [None] * 4

    def go(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stores[i].migrate()
        except Exception as err:  # noqa: BLE001 - reported below
            results[i] = err

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in stores:
        s.close()
    assert results == [len(MIGRATIONS)] * 4
    assert tables(dsn) == TABLES
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_migrations") == len(MIGRATIONS)


_MIGRATE_PROC = """
import sys, time
from agentfast.runner.store import Store
dsn, start_at = sys.argv[1], float(sys.argv[2])
s = Store(dsn, retry_for_s=5)
time.sleep(max(0.0, start_at - time.time()))
print(s.migrate())
"""


@pytest.mark.process
def test_concurrent_migrate_from_processes_on_a_fresh_database(pg_server) -> None:
    with fresh_database(pg_server) as dsn:
        start_at = time.time() + 3.0  # imports done by then: all four hit migrate() together
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _MIGRATE_PROC, dsn, str(start_at)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(4)
        ]
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, outs
        assert [o.strip().splitlines()[-1] for o in outs] == [str(len(MIGRATIONS))] * 4
        assert tables(dsn) == TABLES
        assert count_rows(dsn, "SELECT count(*) FROM agentfast_migrations") == len(MIGRATIONS)


# -- fencing (G6) --------------------------------------------------------------------------------------


def test_stale_lease_cannot_write_anything(store: Store, dsn: str) -> None:
    run_id, uid, old = new_run(store, "fenced")
    new = store.acquire_lease(run_id)
    assert new.epoch == old.epoch + 1

    with pytest.raises(LeaseLost):
        store.commit_checkpoint(old, snapshot(run_id, uid, messages(0, 3), 0), stored_messages=0)
    turn, entries = planned(uid, 1, [("lookup_order", False, True)])
    with pytest.raises(LeaseLost):
        store.save_turn(old, turn, entries)
    for table in ("agentfast_messages", "agentfast_checkpoints", "agentfast_turns", "agentfast_tool_calls"):
        assert count_rows(dsn, f"SELECT count(*) FROM {table}") == 0, f"{table} was written with a stale lease"

    # The current holder writes; then the stale one cannot touch those rows either.
    store.commit_checkpoint(new, snapshot(run_id, uid, messages(0, 3), 0), stored_messages=0)
    store.save_turn(new, turn, entries)
    with pytest.raises(LeaseLost):
        store.mark_started(old, 1, 0)
    with pytest.raises(LeaseLost):
        store.record_result(old, 1, 0, result_for(entries[0], "from the zombie"))
    with pytest.raises(LeaseLost):
        store.commit_checkpoint(old, snapshot(run_id, uid, messages(0, 5), 1), stored_messages=3)
    [entry] = store.journal(run_id)
    assert entry.state == "planned" and entry.attempts == 0 and entry.result is None
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_messages") == 3
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_checkpoints") == 1
    # Every row carries the epoch that wrote it: only the current one.
    for table in ("agentfast_messages", "agentfast_checkpoints", "agentfast_turns", "agentfast_tool_calls"):
        assert count_rows(dsn, f"SELECT count(*) FROM {table} WHERE epoch <> %s", new.epoch) == 0, table


def test_postgres_itself_rejects_writes_without_the_current_epoch(store: Store, dsn: str) -> None:
    run_id, uid, lease = new_run(store, "raw")
    store.commit_checkpoint(lease, snapshot(run_id, uid, messages(0, 1), 0), stored_messages=0)
    insert = "INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch) VALUES (%s, 1, 0, '{}', %s)"

    with psycopg.connect(dsn) as conn:  # no agentfast.epoch at all, even claiming the right epoch in the row
        with pytest.raises(psycopg.Error) as err:
            conn.execute(insert, (run_id, lease.epoch))
        assert err.value.sqlstate == FENCE_SQLSTATE == "AF001"
        assert "without a lease" in str(err.value)
    with psycopg.connect(dsn) as conn:  # an UPDATE of an existing row, same
        with pytest.raises(psycopg.Error) as err:
            conn.execute("UPDATE agentfast_messages SET message = '{}' WHERE run_id = %s", (run_id,))
        assert err.value.sqlstate == "AF001"
    with psycopg.connect(dsn) as conn:  # a stale epoch
        conn.execute(
            "SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', %s, true)",
            (str(lease.epoch - 1), uid),
        )
        with pytest.raises(psycopg.Error) as err:
            conn.execute(insert, (run_id, lease.epoch))
        assert err.value.sqlstate == "AF001" and "stale" in str(err.value)
    with psycopg.connect(dsn) as conn:  # a session-level setting left behind does not count as a lease after a takeover
        conn.execute(
            "SELECT set_config('agentfast.epoch', %s, false), set_config('agentfast.run_uid', %s, false)", (str(lease.epoch), uid)
        )
        conn.commit()
        store.acquire_lease(run_id)
        with pytest.raises(psycopg.Error) as err:
            conn.execute(insert, (run_id, lease.epoch))
        assert err.value.sqlstate == "AF001"
    current = store.get_run(run_id).epoch
    with psycopg.connect(dsn) as conn:  # the current epoch, but another run's uid
        conn.execute(
            "SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', %s, true)",
            (str(current), str(uuid.uuid4())),
        )
        with pytest.raises(psycopg.Error) as err:
            conn.execute(insert, (run_id, current))
        assert err.value.sqlstate == "AF001" and "the run was replaced: uid mismatch" in str(err.value), err.value
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_messages") == 1
    # The control: with the current epoch and the run's uid the same statement is accepted, so the
    # check is the epoch and the uid.
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', %s, true)", (str(current), uid)
        )
        conn.execute(insert, (run_id, 999))
    assert count_rows(dsn, "SELECT epoch FROM agentfast_messages WHERE seq = 1") == current  # the trigger sets it
    # A writer that names no uid (a hand-written repair; a runner of a release before migration 11
    # during an upgrade) is checked by the epoch alone, as before: every Store transaction names it.
    for no_uid in (None, ""):
        with psycopg.connect(dsn) as conn:
            conn.execute("SELECT set_config('agentfast.epoch', %s, true)", (str(current),))
            if no_uid is not None:
                conn.execute("SELECT set_config('agentfast.run_uid', %s, true)", (no_uid,))
            conn.execute(
                "UPDATE agentfast_messages SET message = '{\"repaired\": true}' WHERE run_id = %s AND seq = 1", (run_id,)
            )
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_messages WHERE message ? 'repaired'") == 1


@pytest.mark.parametrize("how", ["delete", "archive"])
def test_a_lease_of_a_replaced_run_cannot_write_into_its_successor_at_the_same_epoch(dsn: str, how: str) -> None:
    """G6 across runs of one name: an AgentRun deleted (or archived) and created again gets the same
    run_id and epochs from 0 again, so the old runner's epoch comes round; its uid never does."""
    big = "B" * 4096  # over the threshold below: stored out of line, a fenced payload row
    with Store(dsn, retry_for_s=5, payload_limits=Limits(threshold_bytes=1024)) as store:
        store.migrate()
        run_id, old_uid = "default/reused", str(uuid.uuid4())
        store.create_run(run_id, old_uid, {"spec": {"input": "first"}})
        store.acquire_lease(run_id)
        old = store.acquire_lease(run_id)  # epoch 2
        turn, entries = planned(old_uid, 1, [("lookup", False, True), ("refund", False, False)])
        store.save_turn(old, turn, entries)
        store.mark_started(old, 1, 0)
        store.record_result(old, 1, 0, result_for(entries[0], big))  # the old run stores the payload itself
        store.commit_checkpoint(old, snapshot(run_id, old_uid, messages(0, 2), 1), stored_messages=0)
        archived_rows = None
        if how == "delete":
            assert store.delete_run(run_id)
        else:
            archived = store.archive_run(run_id)
            assert archived == f"{run_id}@{old_uid.replace('-', '')[:8]}"
            archived_rows = fenced_rows(dsn, archived)
            assert [r[-1] for r in archived_rows["agentfast_payloads"]] == [old.epoch]  # renamed with the run's own epoch

        new_uid = str(uuid.uuid4())
        store.create_run(run_id, new_uid, {"spec": {"input": "second"}})
        store.acquire_lease(run_id)
        new = store.acquire_lease(run_id)
        assert (new.run_id, new.epoch) == (old.run_id, old.epoch) and new.run_uid != old.run_uid  # only the uid differs
        new_turn, new_entries = planned(new_uid, 1, [("lookup", False, True), ("refund", False, False)])
        store.save_turn(new, new_turn, new_entries)
        store.mark_started(new, 1, 1)
        store.record_result(new, 1, 1, result_for(new_entries[1], "refunded"))
        store.commit_checkpoint(new, snapshot(run_id, new_uid, messages(0, 1), 1), stored_messages=0)
        before = fenced_rows(dsn, run_id)

        # The zombie of the old run, with its own store (its own process's cache), tries every write.
        with Store(dsn, retry_for_s=5, payload_limits=Limits(threshold_bytes=1024)) as zombie:
            zombie_turn, zombie_entries = planned(old_uid, 2, [("refund", False, False)])
            attempts = {
                "checkpoint": lambda: zombie.commit_checkpoint(
                    old, snapshot(run_id, old_uid, messages(0, 4), 2), stored_messages=1
                ),
                "checkpoint with a payload": lambda: zombie.commit_checkpoint(
                    old,
                    snapshot(run_id, old_uid, [*messages(0, 1), Message(role="user", content=big + "x")], 2),
                    stored_messages=1,
                ),
                "turn": lambda: zombie.save_turn(old, zombie_turn, zombie_entries),
                "mark_started": lambda: zombie.mark_started(old, 1, 0),  # planned in the new run: the UPDATE's trigger
                "mark_started of a done call": lambda: zombie.mark_started(old, 1, 1),  # no row changes: the store's check
                "record_result": lambda: zombie.record_result(old, 1, 0, result_for(entries[0], "zombie")),
                "record_result with a payload": lambda: zombie.record_result(old, 1, 0, result_for(entries[0], big + "zombie")),
            }
            for what, attempt in attempts.items():
                with pytest.raises(LeaseLost, match="the run was replaced: uid mismatch"):
                    attempt()
                assert fenced_rows(dsn, run_id) == before, what

        # The control: the same writes under the new run's lease go through.
        store.mark_started(new, 1, 0)
        store.record_result(new, 1, 0, result_for(new_entries[0], big))  # same content as the old run's payload
        assert [e.result.content for e in store.journal(run_id, 1)] == [big, "refunded"]
        assert count_rows(dsn, "SELECT count(*) FROM agentfast_payloads WHERE run_id = %s", run_id) == 1
        assert fenced_rows(dsn, run_id) != before
        if archived_rows is not None:
            assert fenced_rows(dsn, archived) == archived_rows  # the earlier run's kept rows, untouched


def test_takeover_waits_for_an_in_flight_write_and_then_fences_it(store: Store, dsn: str) -> None:
    run_id, uid, old = new_run(store, "race")
    taken: list[Lease] = []
    with psycopg.connect(dsn) as conn:  # the old holder, mid-transaction
        conn.execute(
            "SELECT set_config('agentfast.epoch', %s, true), set_config('agentfast.run_uid', %s, true)", (str(old.epoch), uid)
        )
        conn.execute(
            "INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch) VALUES (%s, 0, 0, '{}', 0)", (run_id,)
        )
        t = threading.Thread(target=lambda: taken.append(store.acquire_lease(run_id)))
        t.start()
        time.sleep(0.5)
        assert not taken, "a takeover must wait for a write that holds the current epoch"
        conn.commit()  # the old holder's write was legitimate when it was made
    t.join(10)
    assert taken and taken[0].epoch == old.epoch + 1
    with pytest.raises(LeaseLost):
        store.commit_checkpoint(old, snapshot(run_id, uid, messages(0, 2), 0), stored_messages=1)


def test_write_waits_for_a_takeover_in_progress_and_is_then_refused(store: Store, dsn: str) -> None:
    run_id, uid, old = new_run(store, "race2")
    outcome: list[object] = []

    def write() -> None:
        try:
            outcome.append(store.commit_checkpoint(old, snapshot(run_id, uid, messages(0, 2), 0), stored_messages=0))
        except LeaseLost as err:
            outcome.append(err)

    with psycopg.connect(dsn) as conn:  # a takeover, not yet committed
        conn.execute("UPDATE agentfast_runs SET epoch = epoch + 1 WHERE run_id = %s", (run_id,))
        t = threading.Thread(target=write)
        t.start()
        time.sleep(0.5)
        assert not outcome, "the write must wait for the takeover to finish"
        conn.commit()
    t.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLost), outcome
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_messages") == 0
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_checkpoints") == 0


# -- checkpoints -------------------------------------------------------------------------------------


def test_a_checkpoint_inserts_only_the_new_messages(store: Store, dsn: str) -> None:
    run_id, uid, lease = new_run(store, "append")
    k, n = 3, 12
    msgs = messages(0, 2)
    store.commit_checkpoint(lease, snapshot(run_id, uid, msgs, 0), stored_messages=0)
    for it in range(1, n + 1):
        stored = len(msgs)
        msgs = msgs + messages(stored, k)
        store.commit_checkpoint(lease, snapshot(run_id, uid, msgs, it), stored_messages=stored)
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_messages WHERE run_id = %s", run_id) == 2 + n * k
    for it in range(1, n + 1):
        assert count_rows(dsn, "SELECT count(*) FROM agentfast_messages WHERE run_id = %s AND iteration = %s", run_id, it) == k
    loaded = store.load_snapshot(run_id)
    assert [m.content for m in loaded.messages] == [m.content for m in msgs]
    assert loaded.context.counters.iterations == n


def _measure_one_checkpoint(store: Store, dsn: str, name: str, history: int) -> dict[str, int]:
    """Commit ``history`` messages, then one more iteration of 4; return what that iteration wrote."""
    run_id, uid, lease = new_run(store, name)
    msgs = messages(0, history)
    store.commit_checkpoint(lease, snapshot(run_id, uid, msgs, 0), stored_messages=0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CHECKPOINT")  # every page touched next pays its full-page image, in both runs alike
        before = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        store.commit_checkpoint(lease, snapshot(run_id, uid, msgs + messages(history, 4), 1), stored_messages=history)
        wal = conn.execute("SELECT pg_current_wal_insert_lsn() - %s::pg_lsn", (before,)).fetchone()[0]
        new_rows, new_bytes = conn.execute(
            "SELECT count(*), sum(pg_column_size(message)) FROM agentfast_messages WHERE run_id = %s AND iteration = 1", (run_id,)
        ).fetchone()
        cp_bytes = conn.execute(
            "SELECT pg_column_size(c.*) FROM agentfast_checkpoints c WHERE run_id = %s ORDER BY checkpoint_id DESC LIMIT 1",
            (run_id,),
        ).fetchone()[0]
    return {"rows": new_rows, "message_bytes": int(new_bytes), "checkpoint_bytes": cp_bytes, "wal_bytes": int(wal)}


def test_checkpoint_cost_does_not_grow_with_the_transcript(store: Store, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:  # keep autovacuum's own writes out of the WAL measurement
        for table in ("agentfast_messages", "agentfast_checkpoints", "agentfast_runs"):
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    small = _measure_one_checkpoint(store, dsn, "small", 10)
    large = _measure_one_checkpoint(store, dsn, "large", 2000)  # same name length: same row sizes
    assert small["rows"] == large["rows"] == 4
    assert large["message_bytes"] == small["message_bytes"], (small, large)
    assert large["checkpoint_bytes"] <= small["checkpoint_bytes"] + 16, (small, large)
    # All bytes the commit made Postgres write (WAL): a full rewrite of 2,000 messages would be
    # ~50x the small run's; an append-only one differs by a few full-page images (deeper index).
    transcript_bytes = count_rows(
        dsn, "SELECT sum(pg_column_size(message)) FROM agentfast_messages WHERE run_id = 'default/large'"
    )
    assert large["wal_bytes"] < 3 * small["wal_bytes"] + 16_384, (small, large)  # a few more index pages, no more
    assert large["wal_bytes"] < transcript_bytes / 4, (large, transcript_bytes)


def test_retention_keeps_the_last_k_checkpoints_and_every_message(dsn: str) -> None:
    with Store(dsn, retention_keep=3, retry_for_s=5) as s:
        s.migrate()
        run_id, uid, lease = new_run(s, "retained")
        msgs = messages(0, 2)
        s.commit_checkpoint(lease, snapshot(run_id, uid, msgs, 0), stored_messages=0)
        for it in range(1, 9):
            stored = len(msgs)
            msgs = msgs + messages(stored, 2)
            s.commit_checkpoint(lease, snapshot(run_id, uid, msgs, it), stored_messages=stored)
        kept = s.list_checkpoints(run_id)
        assert [c.iteration for c in kept] == [6, 7, 8]
        assert [c.message_count for c in kept] == [14, 16, 18]
        assert count_rows(dsn, "SELECT count(*) FROM agentfast_messages WHERE run_id = %s", run_id) == 18
        loaded = s.load_snapshot(run_id)
        assert len(loaded.messages) == 18 and loaded.context.counters.iterations == 8
        # another run's checkpoints are not pruned by this one's commits
        other_id, other_uid, other_lease = new_run(s, "other")
        s.commit_checkpoint(other_lease, snapshot(other_id, other_uid, messages(0, 1), 0), stored_messages=0)
        s.commit_checkpoint(lease, snapshot(run_id, uid, msgs, 9), stored_messages=len(msgs))
        assert len(s.list_checkpoints(other_id)) == 1
        assert [c.iteration for c in s.list_checkpoints(run_id)] == [7, 8, 9]


def test_load_snapshot_returns_the_latest(store: Store) -> None:
    assert store.load_snapshot("default/nope") is None and store.load_context("default/nope") is None
    run_id, uid, lease = new_run(store, "latest")
    msgs = messages(0, 2)
    store.commit_checkpoint(lease, snapshot(run_id, uid, msgs, 0), stored_messages=0)
    turn, entries = planned(uid, 1, [("issue_refund", True, True), ("add_case_note", False, True)])
    pending = PendingToolCall(
        call_id="call-1-0",
        iteration=1,
        position=0,
        tool_call=turn.message.tool_calls[0],
        idempotency_key=entries[0].idempotency_key,
        executed_sibling_results=[result_for(entries[1], "noted")],
    )
    store.commit_checkpoint(lease, snapshot(run_id, uid, msgs, 0, "WaitingForApproval", pending), stored_messages=2)
    loaded = store.load_snapshot(run_id)
    assert loaded.context.status.phase == "WaitingForApproval"
    assert loaded.pending == pending
    msgs2 = msgs + messages(2, 3)
    store.commit_checkpoint(lease, snapshot(run_id, uid, msgs2, 1, "Succeeded"), stored_messages=2)
    loaded = store.load_snapshot(run_id)
    assert loaded.context.status.phase == "Succeeded" and loaded.pending is None
    assert loaded.context.counters.iterations == 1
    assert [m.content for m in loaded.messages] == [m.content for m in msgs2]
    ctx, p = store.load_context(run_id)
    assert ctx == loaded.context and p is None


# -- decisions ---------------------------------------------------------------------------------------


def test_decisions_are_write_once(store: Store) -> None:
    run_id, uid, lease = new_run(store, "decide")
    turn, entries = planned(uid, 1, [("issue_refund", True, True), ("add_case_note", False, False)])
    store.save_turn(lease, turn, entries)
    pause(store, lease, uid, entries, ["call-1-0"])

    first = store.decide(run_id, "call-1-0", "approve", reason="looks right", decided_by="alice")
    assert (first.decision, first.reason, first.decided_by) == ("approve", "looks right", "alice")
    with pytest.raises(DecisionConflict, match="already decided: approve") as same:
        store.decide(run_id, "call-1-0", "approve", reason="looks right", decided_by="bob")
    assert same.value.same and same.value.existing == first  # a replay (the operator's resync) can tell
    with pytest.raises(DecisionConflict, match="already decided") as other:
        store.decide(run_id, "call-1-0", "deny", reason="changed my mind", decided_by="mallory")
    assert not other.value.same
    assert store.get_decision(run_id, "call-1-0") == first
    assert store.awaiting(run_id) == []
    with pytest.raises(UnknownCall, match="no run"):
        store.decide("default/no-such-run", "call-1-0", "approve")
    with pytest.raises(InvalidDecision):
        store.decide(run_id, "call-1-1", "maybe")  # type: ignore[arg-type]
    assert store.get_decision(run_id, "call-9-9") is None


def test_a_decision_only_for_a_call_awaiting_one_now(store: Store, dsn: str) -> None:
    """Not for a non-gated sibling, a finished call, a call not yet planned or not yet paused on,
    nor a -rerunN id that awaits nothing; each refusal says why and what does await."""
    run_id, uid, lease = new_run(store, "awaited")
    turn, entries = planned(uid, 1, [("issue_refund", True, True), ("add_case_note", False, True), ("send_mail", True, False)])
    store.save_turn(lease, turn, entries)
    with pytest.raises(UnknownCall, match="call-1-0 .* the run has not paused on it; no call of this run awaits a decision now"):
        store.decide(run_id, "call-1-0", "approve")  # gated and planned, but the run has not paused yet
    store.mark_started(lease, 1, 1)
    store.record_result(lease, 1, 1, result_for(entries[1], "noted"))
    pause(store, lease, uid, entries, ["call-1-0", "call-1-2"])
    assert [a.call_id for a in store.awaiting(run_id)] == ["call-1-0", "call-1-2"]

    refusals = {
        "call-1-1": "it is finished (add_case_note)",
        "call-3-0": "the run has no such tool call",
        "call-1-0-rerun1": "issue_refund is idempotent",
        "call-1-2-rerun1": "not an interrupted call of call-1-2 that awaits a human",
        "call-1-0-rerunx": "the run has no such tool call",
        "": "the run has no such tool call",
    }
    for cid, why in refusals.items():
        for decision, kw in (("approve", {}), ("deny", {"reason": "no"}), ("complete", {"result": "{}"})):
            with pytest.raises(UnknownCall) as err:
                store.decide(run_id, cid, decision, **kw)  # type: ignore[arg-type]
            assert why in str(err.value) and "awaiting a decision now: call-1-0, call-1-2" in str(err.value), str(err.value)
    assert count_rows(dsn, "SELECT count(*) FROM agentfast_approvals") == 0

    # In any order; each once; a denial keeps its reason, a completion its result verbatim.
    done = store.decide(run_id, "call-1-2", "complete", result='{"sent":true}', decided_by="carol")
    assert (done.decision, done.result, done.decided_by) == ("complete", '{"sent":true}', "carol")
    assert [a.call_id for a in store.awaiting(run_id)] == ["call-1-0"]
    with pytest.raises(InvalidDecision, match="needs a reason"):
        store.decide(run_id, "call-1-0", "deny")
    with pytest.raises(InvalidDecision, match="needs a reason"):
        store.decide(run_id, "call-1-0", "deny", reason="   ")
    with pytest.raises(InvalidDecision, match="levels deep"):  # plain text is a result too; JSON over the limits is not
        store.decide(run_id, "call-1-0", "complete", result="[" * 100 + "]" * 100)
    denied = store.decide(run_id, "call-1-0", "deny", reason="customer withdrew")
    assert denied.reason == "customer withdrew"
    with pytest.raises(DecisionConflict, match="already decided: deny \\(customer withdrew\\)"):
        store.decide(run_id, "call-1-0", "deny", reason="another reason")
    assert store.get_decision(run_id, "call-1-0").reason == "customer withdrew"
    assert store.awaiting(run_id) == []
    with pytest.raises(DecisionConflict):
        store.decide(run_id, "call-1-2", "approve")

    # A finished run awaits nothing, whatever its last pending record said, and says so when asked.
    store.commit_checkpoint(lease, snapshot(run_id, uid, [], 1, "Succeeded"), stored_messages=0)
    assert store.awaiting(run_id) == []
    with pytest.raises(UnknownCall, match=r"call-1-1 .*cannot be decided: the run has ended \(Succeeded"):
        store.decide(run_id, "call-1-1", "approve")


def test_an_in_flight_rerun_awaits_under_its_own_id(store: Store) -> None:
    run_id, uid, lease = new_run(store, "rerun")
    turn, entries = planned(uid, 1, [("send_mail", False, False)])
    store.save_turn(lease, turn, entries)
    store.mark_started(lease, 1, 0)
    pause(store, lease, uid, entries, ["call-1-0-rerun1"])
    with pytest.raises(UnknownCall, match="call-1-0 .*awaiting a decision now: call-1-0-rerun1"):
        store.decide(run_id, "call-1-0", "approve")
    with pytest.raises(UnknownCall):
        store.decide(run_id, "call-1-0-rerun2", "approve")
    assert store.decide(run_id, "call-1-0-rerun1", "complete", result='"sent"').result == '"sent"'


def test_unstorable_text_in_a_decision_is_replaced(store: Store) -> None:
    run_id, uid, lease = new_run(store, "nul")
    turn, entries = planned(uid, 1, [("issue_refund", True, True)])
    store.save_turn(lease, turn, entries)
    pause(store, lease, uid, entries, ["call-1-0"])
    d = store.decide(run_id, "call-1-0", "deny", reason="no\x00pe \udc80 [/b]")
    assert d.reason == "no\ufffdpe \ufffd [/b]"


def _listening(dsn: str, n: int = 1) -> bool:
    with psycopg.connect(dsn) as conn:
        return (
            conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = 'LISTEN agentfast_approval'"
            ).fetchone()[0]
            >= n
        )


def test_wait_for_decision_wakes_on_notify(store: Store, dsn: str) -> None:
    from .helpers import wait_until

    run_id, uid, lease = new_run(store, "wake")
    other_id, other_uid, other_lease = new_run(store, "wake-other")
    for _rid, u, ls in ((run_id, uid, lease), (other_id, other_uid, other_lease)):
        turn, entries = planned(u, 1, [("issue_refund", True, True)])
        store.save_turn(ls, turn, entries)
        pause(store, ls, u, entries, ["call-1-0"])

    stop = threading.Event()
    got: list[object] = []
    woke_at: list[float] = []

    def waiter() -> None:
        got.append(store.wait_for_decision(run_id, "call-1-0", stop, poll_s=60))  # no polling to rescue it
        woke_at.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    wait_until(lambda: _listening(dsn), timeout=10, what="the waiter to LISTEN")
    time.sleep(0.3)  # past its first read: only a notification can wake it now

    store.decide(other_id, "call-1-0", "approve")  # another run's decision does not wake this call
    time.sleep(0.8)
    assert not got

    store.decide(run_id, "call-1-0", "deny", reason="no")
    decided_at = time.monotonic()
    t.join(5)
    assert got, "the waiter did not wake"
    assert got[0].decision == "deny" and got[0].reason == "no"
    assert woke_at[0] - decided_at < 1.0, f"woke {woke_at[0] - decided_at:.2f}s after the decision"
    stop.set()


def test_wait_for_decision_returns_none_when_stopped(store: Store, dsn: str) -> None:
    run_id, uid, lease = new_run(store, "stopped")
    stop = threading.Event()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(store.wait_for_decision(run_id, "call-1-0", stop, poll_s=60)))
    t.start()
    time.sleep(0.5)
    stop.set()
    stopped_at = time.monotonic()
    t.join(5)
    assert not t.is_alive()
    assert got == [None]
    assert time.monotonic() - stopped_at < 1.5


def test_a_decision_made_before_waiting_is_found_at_once(store: Store) -> None:
    run_id, uid, lease = new_run(store, "early")
    turn, entries = planned(uid, 1, [("issue_refund", True, True)])
    store.save_turn(lease, turn, entries)
    pause(store, lease, uid, entries, ["call-1-0"])
    store.decide(run_id, "call-1-0", "approve")
    t0 = time.monotonic()
    d = store.wait_for_decision(run_id, "call-1-0", threading.Event(), poll_s=60)
    assert d.decision == "approve" and time.monotonic() - t0 < 1.0


# -- starting a call against a cancel or a deadline -----------------------------------------------------


def test_mark_started_refuses_once_the_run_is_cancelled_or_past_its_deadline(store: Store, dsn: str) -> None:
    """The write that starts a call checks the run's end requests in the same transaction: after
    a cancel, or past the deadline, it marks nothing and says why (no call can start after
    either, whatever runs between a separate check and the call)."""
    run_id, uid, lease = new_run(store, "ends")
    turn, entries = planned(
        uid, 1, [("add_case_note", False, True), ("add_case_note", False, True), ("add_case_note", False, True)]
    )
    store.save_turn(lease, turn, entries)
    assert store.mark_started(lease, 1, 0, deadline_s=3600) is None  # marked: run it
    ends = store.mark_started(lease, 1, 1, deadline_s=0.0)  # the run is older than 0 s
    assert ends is not None and ends.cancel is None and ends.age_s >= 0
    store.request_cancel(run_id, "cli:alice")
    ends = store.mark_started(lease, 1, 2)
    assert ends is not None and ends.cancel is not None and ends.cancel.requested_by == "cli:alice"
    assert [(e.state, e.attempts) for e in store.journal(run_id, 1)] == [("started", 1), ("planned", 0), ("planned", 0)]
    # A lost lease is still a lost lease, cancelled or not.
    store.acquire_lease(run_id)
    with pytest.raises(LeaseLost):
        store.mark_started(lease, 1, 1)


def test_a_turn_saved_with_its_first_calls_intent_starts_that_call_unless_the_run_must_end(store: Store, dsn: str) -> None:
    """save_turn_and_mark_started is save_turn then mark_started in one write: the call is marked
    started (one attempt) with the turn and the plan; when the run was cancelled or is past its
    deadline the turn and the plan are saved and the call stays planned, and it says why."""
    run_id, uid, lease = new_run(store, "turn-and-intent")
    turn, entries = planned(uid, 1, [("add_case_note", True, True), ("add_case_note", False, True)])
    stored, ends = store.save_turn_and_mark_started(lease, turn, entries, 1, deadline_s=3600)
    assert ends is None and stored.message == turn.message
    assert [(e.state, e.attempts) for e in store.journal(run_id, 1)] == [("planned", 0), ("started", 1)]
    assert store.load_turn(run_id, 1) is not None
    turn2, entries2 = planned(uid, 2, [("add_case_note", False, True)])
    _, ends = store.save_turn_and_mark_started(lease, turn2, entries2, 0, deadline_s=0.0)  # older than 0 s
    assert ends is not None and ends.cancel is None
    store.request_cancel(run_id, "cli:bob")
    turn3, entries3 = planned(uid, 3, [("add_case_note", False, True)])
    _, ends = store.save_turn_and_mark_started(lease, turn3, entries3, 0)
    assert ends is not None and ends.cancel is not None and ends.cancel.requested_by == "cli:bob"
    assert [(e.iteration, e.state, e.attempts) for e in store.journal(run_id) if e.iteration > 1] == [
        (2, "planned", 0),
        (3, "planned", 0),
    ]
    assert store.last_turn_iteration(run_id) == 3
    store.acquire_lease(run_id)
    with pytest.raises(LeaseLost):
        store.save_turn_and_mark_started(lease, *planned(uid, 4, [("add_case_note", False, True)]), 0)
