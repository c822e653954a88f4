"""Issue 30 item 1 on a real PostgreSQL server: namespace A's runner credential is a hostile
tenant's. Whatever SQL its grants allow, it reaches nothing of namespace B: no table, function,
sequence, lock or notification channel (G11).

Every table, function and sequence is taken from the catalog, not from a list written here, so
one added later is tried too. B's rows come from a real run (its runner a real process, killed
mid-tool so that its lock was held and seen), plus a row written by the owner in each table the
run itself does not fill.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from agentfast.runner.liveness import runner_state
from agentfast.runner.store import Store

from .helpers import run_cli, spawn_cli, wait_until
from .test_tenants import QUIET_TOOLS, _as, _register

# A lookup tool that takes its time, so a runner is caught holding the run.
SLOW_TOOLS = QUIET_TOOLS.replace(
    '    """Look up an order."""\n',
    '    """Look up an order."""\n    import os, time\n'
    '    if os.environ.get("SLOW_LOOKUP_S"):\n        time.sleep(float(os.environ["SLOW_LOOKUP_S"]))\n',
)
# Lock modes a tenant may hold on a table without stopping another tenant's runner: the ones every
# runner statement takes anyway (reads, inserts, column updates) conflict only with DDL.
HARMLESS_LOCKS = {"ACCESS SHARE", "ROW SHARE", "ROW EXCLUSIVE"}
ALL_LOCKS = [
    "ACCESS SHARE",
    "ROW SHARE",
    "ROW EXCLUSIVE",
    "SHARE UPDATE EXCLUSIVE",
    "SHARE",
    "SHARE ROW EXCLUSIVE",
    "EXCLUSIVE",
    "ACCESS EXCLUSIVE",
]
# What a hostile statement may be answered with: no right (42501, also a row-level-security
# check), the fence (AF001), or a statement the role may not make at all.
REFUSED = {"42501", "AF001", "428C9", "0A000"}


@pytest.fixture
def slow_tools(tmp_path: Path) -> dict[str, str]:
    assert SLOW_TOOLS != QUIET_TOOLS, "the delay was not put into the lookup tool"
    module = f"slow_tools_{uuid.uuid4().hex[:6]}"
    (tmp_path / f"{module}.py").write_text(SLOW_TOOLS)
    return {"module": module, "PYTHONPATH": str(tmp_path)}


@pytest.fixture
def schema(store: Store) -> str:
    return str(store._read("SELECT current_schema() AS s", None)["s"])


@pytest.fixture
def tenant_a(dsn: str, store: Store, slow_tools: dict[str, str]) -> Iterator[tuple[str, str]]:
    """``(A's run id, A's DSN)``: a namespace with a run of its own and its runner credential."""
    mine = _register(store, "team-a", "lookup", slow_tools["module"])
    role, _ = store.set_tenant_password("team-a", "pw-a")
    yield mine, _as(dsn, role, "pw-a")


def _sqlstate(conn: psycopg.Connection, query: sql.Composable | str, params: tuple = ()) -> str | int:
    """Run ``query`` in a transaction that is rolled back; returns its row count, or the SQLSTATE it failed with."""
    try:
        with conn.transaction(force_rollback=True):
            return conn.execute(query, params).rowcount
    except psycopg.Error as err:
        return err.sqlstate or "?"


def _paused_run_of_b(dsn: str, store: Store, tools: dict[str, str]) -> str:
    """B's refund, paused at its gated call by a real runner (the owner's DSN, as locally)."""
    theirs = _register(store, "team-b", "refund", tools["module"])
    res = run_cli("resume", theirs, "--no-wait", dsn=dsn, env={"PYTHONPATH": tools["PYTHONPATH"]}, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [a.call_id for a in store.awaiting(theirs)] == ["call-2-0"]
    return theirs


def test_every_function_of_the_store_pins_its_search_path_with_pg_temp_last(store: Store, schema: str) -> None:
    # The High finding: agentfast_tenant() (SECURITY DEFINER, called by every row-level-security
    # policy) resolved agentfast_tenants through a path with pg_temp first, so a runner's temporary
    # table answered another namespace. Every function that runs for another role (SECURITY
    # DEFINER, triggers) and every function of the store must name its path, pg_temp last.
    rows = store._read(
        """SELECT p.oid::regprocedure::text AS fn, p.prosecdef AS definer, p.prorettype = 'trigger'::regtype AS trigger,
                  coalesce(p.proconfig, '{}') AS config, n.nspname AS schema
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
           WHERE n.nspname <> 'information_schema' AND n.nspname NOT LIKE 'pg\\_%%'
             AND (p.prosecdef OR p.prorettype = 'trigger'::regtype OR p.proname LIKE 'agentfast\\_%%')""",
        None,
        all=True,
    )
    by_name = {r["fn"]: r for r in rows}
    assert "agentfast_tenant()" in by_name and by_name["agentfast_tenant()"]["definer"]  # the list is the catalog's, not empty
    assert "agentfast_fence()" in by_name and by_name["agentfast_fence()"]["trigger"]
    # A new SECURITY DEFINER function of the store is a decision: it is named here when it is made.
    assert {r["fn"] for r in rows if r["definer"] and r["schema"] == schema} == {
        "agentfast_tenant()",
        "agentfast_prune()",
        "agentfast_reply_kept()",  # marks a model reply kept by its turn (migration 19): runner roles get no UPDATE there
    }
    for r in rows:  # the store's, and any other in the database (the example tools' run_epoch)
        config = dict(c.split("=", 1) for c in r["config"])
        assert "search_path" in config, f"{r['fn']} resolves names through its caller's search_path"
        path = [e.strip() for e in config["search_path"].split(",")]
        assert path[-1] == "pg_temp" and not {'"$user"', "$user"} & set(path), f"{r['fn']}: search_path={config['search_path']}"
        if r["schema"] == schema:
            assert set(path[:-1]) <= {schema, "pg_catalog"}, f"{r['fn']}: search_path={config['search_path']}"


def test_no_role_but_the_owner_may_create_temporary_tables_or_objects_in_the_schema(
    dsn: str, store: Store, schema: str, tenant_a: tuple[str, str]
) -> None:
    _, a_dsn = tenant_a
    with psycopg.connect(a_dsn, autocommit=True) as a:
        assert _sqlstate(a, "CREATE TEMP TABLE agentfast_tenants (namespace text, role_name text)") == "42501"
        assert _sqlstate(a, sql.SQL("CREATE TABLE {}.agentfast_mine (x int)").format(sql.Identifier(schema))) == "42501"
        assert (
            _sqlstate(
                a,
                sql.SQL("CREATE FUNCTION {}.split_part(text, text, int) RETURNS text LANGUAGE sql AS 'SELECT 1::text'").format(
                    sql.Identifier(schema)
                ),
            )
            == "42501"
        )
    # The owner still may (a temporary table of its own is its business).
    with psycopg.connect(store.dsn, autocommit=True) as owner:
        owner.execute("CREATE TEMP TABLE agentfast_scratch (x int)")


@pytest.mark.process
def test_a_temporary_table_never_makes_a_runner_role_another_namespace(
    dsn: str, store: Store, schema: str, slow_tools: dict[str, str], tenant_a: tuple[str, str]
) -> None:
    # The attack, performed as written. Even with TEMPORARY granted back (a store whose
    # owner could not revoke it: it does not own the database), the pinned paths hold.
    theirs = _paused_run_of_b(dsn, store, slow_tools)
    mine, a_dsn = tenant_a
    role_a = psycopg.conninfo.conninfo_to_dict(a_dsn)["user"]
    database = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    [before] = [e.tool_call.arguments for e in store.journal(theirs) if e.call_id == "call-2-0"]
    epoch_b = store.get_run(theirs).epoch
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(sql.SQL("GRANT TEMPORARY ON DATABASE {} TO {}").format(sql.Identifier(database), sql.Identifier(role_a)))
    real = lambda t: sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(t))  # noqa: E731 - past A's own temp tables
    with psycopg.connect(a_dsn, autocommit=True) as a:
        a.execute("CREATE TEMP TABLE agentfast_tenants (namespace text, role_name text)")
        a.execute("INSERT INTO agentfast_tenants VALUES ('team-b', session_user)")
        a.execute("CREATE TEMP TABLE agentfast_runs (run_id text, run_uid text, epoch bigint)")
        a.execute("INSERT INTO agentfast_runs VALUES (%s, 'forged', 7)", (mine,))
        assert a.execute("SELECT agentfast_tenant()").fetchone() == ("team-a",)
        for table in ("agentfast_runs", "agentfast_tool_calls", "agentfast_messages", "agentfast_checkpoints"):
            seen = a.execute(sql.SQL("SELECT count(*) FROM {} WHERE run_id = %s").format(real(table)), (theirs,)).fetchone()
            assert seen == (0,), table
        rewrite = sql.SQL("UPDATE {} SET arguments = %s WHERE run_id = %s").format(real("agentfast_tool_calls"))
        assert _sqlstate(a, rewrite, (json.dumps({"order_id": "A-1042", "amount_cents": 999999}), theirs)) in (0, "42501")
        assert (
            _sqlstate(a, sql.SQL("UPDATE {} SET epoch = epoch + 1 WHERE run_id = %s").format(real("agentfast_runs")), (theirs,))
            == 0
        )
        # The fence reads the real run row, not A's forged one: epoch 7 is no lease of A's own run.
        with pytest.raises(psycopg.Error) as err:
            with a.transaction():
                a.execute("SELECT agentfast_name_lease(7, 'forged')")
                a.execute(
                    sql.SQL("INSERT INTO {} (run_id, seq, iteration, message, epoch) VALUES (%s, 0, 0, '{{}}', 0)").format(
                        real("agentfast_messages")
                    ),
                    (mine,),
                )
        assert err.value.sqlstate == "AF001", err.value
    assert [e.tool_call.arguments for e in store.journal(theirs) if e.call_id == "call-2-0"] == [before]
    assert store.get_run(theirs).epoch == epoch_b and "999999" not in before


def _row_of(store: Store, table: str, run_id: str) -> dict | None:
    """One of ``run_id``'s rows of ``table`` as JSON (None: none, or the table has no run_id)."""
    if store._read("SELECT 1 AS x FROM pg_attribute WHERE attrelid = %s::regclass AND attname = 'run_id'", (table,)) is None:
        return None
    row = store._read(
        sql.SQL("SELECT to_jsonb(t) AS r FROM {} t WHERE run_id = %s LIMIT 1").format(sql.Identifier(table)),  # type: ignore[arg-type]
        (run_id,),
    )
    return None if row is None else row["r"]


def _contents(store: Store, tables: list[str]) -> dict[str, dict]:
    """table -> its row count and a digest of all its rows, to tell that nothing changed."""
    query = "SELECT count(*) AS n, md5(string_agg(to_jsonb(x)::text, '' ORDER BY to_jsonb(x)::text)) AS h FROM {} x"
    return {t: store._read(sql.SQL(query).format(sql.Identifier(t)), None) for t in tables}  # type: ignore[arg-type]


def _writable_columns(store: Store, table: str) -> list[str]:
    """The columns of ``table`` an INSERT may name (not dropped, not generated, not GENERATED ALWAYS)."""
    rows = store._read(
        """SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped
           AND attgenerated = '' AND attidentity <> 'a' ORDER BY attnum""",
        (table,),
        all=True,
    )
    return [r["attname"] for r in rows]


@pytest.mark.process
def test_a_runner_credential_reaches_no_table_function_or_sequence_of_another_namespace(
    dsn: str, store: Store, schema: str, slow_tools: dict[str, str], tenant_a: tuple[str, str]
) -> None:
    theirs = _paused_run_of_b(dsn, store, slow_tools)
    _, a_dsn = tenant_a
    store.decide(theirs, "call-2-0", "approve", decided_by="kubernetes:alice")
    store.void_decision(theirs, "call-9-9", "test")
    store.request_cancel(theirs, "kubernetes:alice")
    # agentfast_runners keeps B's last runner's row; a row in the tables a paused run leaves empty:
    with psycopg.connect(dsn, autocommit=True) as owner:
        run = store.get_run(theirs)
        with owner.transaction():
            owner.execute("SELECT agentfast_name_lease(%s, %s)", (run.epoch, run.run_uid))
            owner.execute(
                "INSERT INTO agentfast_payloads (run_id, digest, size_bytes, content, epoch) VALUES (%s, 'd', 1, 'x', 0)",
                (theirs,),
            )
            owner.execute(
                "INSERT INTO agentfast_sdk_blobs (run_id, key, type, value, epoch) VALUES (%s, 'k', 't', 'v', 0)", (theirs,)
            )
        owner.execute(
            "INSERT INTO agentfast_notifications (run_id, call_id, idempotency_key, event) VALUES (%s, 'call-2-0', 'k', '{}')",
            (theirs,),
        )
    tables = [
        r["relname"]
        for r in store._read(
            "SELECT c.relname FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p')"
            " AND c.relname LIKE 'agentfast\\_%%' ORDER BY 1",
            None,
            all=True,
        )
    ]
    assert "agentfast_runs" in tables and "agentfast_locks" in tables
    before = _contents(store, tables)
    findings: list[str] = []
    with psycopg.connect(a_dsn, autocommit=True) as a:
        for table in tables:
            ident = sql.Identifier(schema, table)
            row = _row_of(store, table, theirs)
            if row is not None:
                seen = _sqlstate(a, sql.SQL("SELECT 1 FROM {} WHERE run_id = %s").format(ident), (theirs,))
                if seen not in (0, "42501"):
                    findings.append(f"{table}: A sees B's rows ({seen})")
                cols = _writable_columns(store, f"{schema}.{table}")
                # B's own row again: privileges, then the fence (a BEFORE trigger), then row-level
                # security refuse it before a unique index could.
                copy = {c: v for c, v in row.items() if c in cols}
                names = sql.SQL(", ").join(sql.Identifier(c) for c in cols)
                insert = sql.SQL("INSERT INTO {} ({}) SELECT {} FROM jsonb_populate_record(NULL::{}, %s)").format(
                    ident, names, names, ident
                )
                got = _sqlstate(a, insert, (json.dumps(copy),))
                if got not in REFUSED:
                    findings.append(f"{table}: A inserted a row for B ({got})")
                for col in cols:
                    got = _sqlstate(
                        a,
                        sql.SQL("UPDATE {} SET {} = {} WHERE run_id = %s").format(
                            ident, sql.Identifier(col), sql.Identifier(col)
                        ),
                        (theirs,),
                    )
                    if got not in (0, *REFUSED):
                        findings.append(f"{table}.{col}: A updated B's rows ({got})")
                got = _sqlstate(a, sql.SQL("DELETE FROM {} WHERE run_id = %s").format(ident), (theirs,))
                if got not in (0, *REFUSED):
                    findings.append(f"{table}: A deleted B's rows ({got})")
                got = _sqlstate(a, sql.SQL("SELECT 1 FROM {} WHERE run_id = %s FOR UPDATE").format(ident), (theirs,))
                if got not in (0, *REFUSED):
                    findings.append(f"{table}: A row-locked B's rows ({got})")
            else:
                got = _sqlstate(a, sql.SQL("SELECT * FROM {}").format(ident))
                if got not in (0, "42501") and table != "agentfast_migrations":
                    findings.append(f"{table}: A reads it ({got})")
            if _sqlstate(a, sql.SQL("TRUNCATE {}").format(ident)) != "42501":
                findings.append(f"{table}: A truncates it")
            for mode in ALL_LOCKS:
                got = _sqlstate(a, sql.SQL("LOCK TABLE {} IN " + mode + " MODE NOWAIT").format(ident))
                if got != "42501" and mode not in HARMLESS_LOCKS:
                    findings.append(f"{table}: A locks it IN {mode} MODE, stopping every namespace's runners ({got})")
        for seq in store._read(
            "SELECT c.oid::regclass::text AS s FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'S'",
            None,
            all=True,
        ):
            for probe in ("SELECT nextval(%s::regclass)", "SELECT setval(%s::regclass, 1)", "SELECT currval(%s::regclass)"):
                got = _sqlstate(a, probe, (seq["s"],))
                if got not in ("42501", "55000"):  # 55000: currval before nextval in this session
                    findings.append(f"{seq['s']}: {probe} answered {got}")
        # Every function of the store, called with B's run id (and harmless values for the rest).
        sample = {
            "text": theirs,
            "bigint": 0,
            "integer": 0,
            "jsonb": "[]",
            "uuid": str(uuid.uuid4()),
            "double precision": None,
            "text[]": [],
            "bytea[]": [],
            "boolean": True,
        }
        for fn in store._read(
            """SELECT p.proname, p.oid::regprocedure::text AS sig, array(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) t) AS args
               FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace AND p.prorettype <> 'trigger'::regtype""",
            None,
            all=True,
        ):
            args = [sample.get(t) for t in fn["args"]]
            call = sql.SQL("SELECT * FROM {}({})").format(
                sql.Identifier(schema, fn["proname"]), sql.SQL(", ").join(sql.SQL("%s::" + t) for t in fn["args"])
            )
            _sqlstate(a, call, tuple(args))  # refused, or it ran and found nothing of B's: the row check below tells
    after = _contents(store, tables)
    assert not findings, "\n".join(findings)
    changed = [t for t in tables if before[t] != after[t]]
    assert changed == [], f"A's statements changed B's (or anyone's) rows in {changed}"
    assert store.get_decision(theirs, "call-2-0").decision == "approve" and store.get_run(theirs).epoch == run.epoch


def _listen(conn: psycopg.Connection, *channels: str) -> None:
    for ch in channels:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(ch)))


@pytest.mark.process
def test_notifications_name_no_run_and_a_squatted_lock_stalls_nothing(
    dsn: str, store: Store, slow_tools: dict[str, str], tenant_a: tuple[str, str]
) -> None:
    # A listens on every channel the store uses and takes every advisory lock it sees held, while
    # B's runner works: it learns no run name, and B's next runner takes its run over as if A
    # were not there.
    _, a_dsn = tenant_a
    theirs = _register(store, "team-b", "refund", slow_tools["module"])
    env = {"PYTHONPATH": slow_tools["PYTHONPATH"], "SLOW_LOOKUP_S": "30"}
    a = psycopg.connect(a_dsn, autocommit=True)
    squatter = psycopg.connect(a_dsn, autocommit=True)
    try:
        _listen(a, "agentfast_progress", "agentfast_approval")
        runner = spawn_cli("resume", theirs, "--no-wait", dsn=dsn, env=env)
        try:
            wait_until(lambda: runner_state(store, theirs).alive, timeout=60, what="B's runner to hold its run")
            held = squatter.execute(
                "SELECT (classid::bigint << 32) | objid::bigint AS k FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
            ).fetchall()
            assert held, "B's runner holds an advisory lock A can see in pg_locks"
        finally:
            runner.kill()
            runner.communicate()
        wait_until(lambda: not runner_state(store, theirs).alive, timeout=30, what="B's runner's session to end")
        # A takes every key it saw (signed 64-bit, as pg_advisory_lock takes them), and the old fixed keys too.
        for (k,) in held:
            signed = k - (1 << 64) if k >= 1 << 63 else k
            assert squatter.execute("SELECT pg_try_advisory_lock(%s)", (signed,)).fetchone() == (True,)
        for k in (0x61_66_5F_6D_69_67, 0x61_66_5F_74_6E_74):  # the migration and tenant keys of earlier releases
            squatter.execute("SELECT pg_try_advisory_lock(%s)", (k,))
        assert not runner_state(store, theirs).alive  # a key held by A is not B's runner
        # The owner's own serializations go on: a namespace's credential, a new run.
        t0 = time.monotonic()
        store.set_tenant_password("team-c", "pw-c")
        _register(store, "team-c", "refund", slow_tools["module"])
        assert time.monotonic() - t0 < 10
        with psycopg.connect(store.dsn) as owner:
            owner.execute("LOCK TABLE agentfast_migrations IN SHARE ROW EXCLUSIVE MODE NOWAIT")
        # B's next runner takes its run over and goes on to the gated call.
        done = run_cli("resume", theirs, "--no-wait", dsn=dsn, env={"PYTHONPATH": slow_tools["PYTHONPATH"]}, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert [c.call_id for c in store.awaiting(theirs)] == ["call-2-0"]
        store.decide(theirs, "call-2-0", "approve", decided_by="kubernetes:alice")
        payloads = [n.payload for n in a.notifies(timeout=2.0)]
    finally:
        a.close()
        squatter.close()
    assert payloads, "A heard B's notifications (the channels are anyone's): the test must see their payloads"
    token = store.notify_token(theirs)
    assert token and all(p == token for p in payloads), payloads  # B's opaque token, nothing else
    assert not any("team-b" in p or "refund" in p for p in payloads)
    with psycopg.connect(a_dsn, autocommit=True) as a2:  # and A cannot tell whose token it is
        assert a2.execute("SELECT count(*) FROM agentfast_runs WHERE notify_token = %s", (token,)).fetchone() == (0,)
