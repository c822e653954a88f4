"""The schema can be distributed by run_id (Citus) unchanged (migration 7), read from the catalog.

A distributed table's primary key and unique constraints must contain its distribution column;
here each one begins with ``run_id``. ``agentfast_tenants`` (a reference table: small, keyed by
namespace, read by every row-level-security check) and ``agentfast_migrations`` (the
coordinator's) are the exceptions. Also: a run's uid stays one run's (``Store.create_run``),
now that no global constraint says so.
"""

from __future__ import annotations

import psycopg
import pytest

from agentfast.runner.store import Store, UidTaken

from .test_store import TABLES

NOT_DISTRIBUTED = {"agentfast_migrations", "agentfast_tenants", "agentfast_locks"}


def _unique_keys(dsn: str) -> dict[str, list[tuple[str, list[str]]]]:
    """table -> [(index name, its key columns in order)] for every unique index (primary keys and
    UNIQUE constraints are backed by one) of every agentfast_* table in the public schema."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            """SELECT t.relname, i.relname, array(SELECT a.attname FROM unnest(x.indkey) WITH ORDINALITY k(attnum, n)
                                                  JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum
                                                  ORDER BY k.n)
               FROM pg_index x JOIN pg_class t ON t.oid = x.indrelid JOIN pg_class i ON i.oid = x.indexrelid
               JOIN pg_namespace s ON s.oid = t.relnamespace
               WHERE x.indisunique AND s.nspname = 'public' AND t.relname LIKE 'agentfast\\_%'"""
        ).fetchall()
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT relname FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace"
                " WHERE s.nspname = 'public' AND c.relkind = 'r' AND relname LIKE 'agentfast\\_%'"
            ).fetchall()
        }
    out: dict[str, list[tuple[str, list[str]]]] = {t: [] for t in tables}
    for table, index, cols in rows:
        out[table].append((index, list(cols)))
    return out


def test_every_primary_key_and_unique_constraint_begins_with_run_id(store: Store) -> None:
    keys = _unique_keys(store.dsn)
    assert set(keys) == TABLES, "a table the distribution rule does not know about"
    for table in sorted(TABLES - NOT_DISTRIBUTED):
        assert keys[table], f"{table} has no primary key"
        for index, cols in keys[table]:
            assert cols[0] == "run_id", f"{table}: {index} ({', '.join(cols)}) does not begin with run_id"
    with psycopg.connect(store.dsn) as conn:
        constraints = conn.execute(
            """SELECT c.conrelid::regclass::text, c.conname, c.contype,
                      array(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY k(attnum, n)
                            JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum ORDER BY k.n)
               FROM pg_constraint c WHERE c.contype IN ('p', 'u') AND c.conrelid::regclass::text LIKE 'agentfast\\_%'"""
        ).fetchall()
    checked = [(t, n, cols) for t, n, _, cols in constraints if t not in NOT_DISTRIBUTED]
    assert checked and all(cols[0] == "run_id" for _, _, cols in checked), checked


def test_a_uid_names_one_run_for_good(store: Store) -> None:
    uid = "00000000-0000-4000-8000-0000000000d1"
    first = store.create_run("default/a", uid, {"x": 1})
    assert store.create_run("default/a", uid, {"x": 2}) == first  # the same run again: unchanged
    with pytest.raises(UidTaken, match="already run default/a's"):
        store.create_run("default/b", uid, {})
    assert store.get_run("default/b") is None
    archived = store.archive_run("default/a")
    with pytest.raises(UidTaken, match=f"already run {archived}'s"):
        store.create_run("default/a", uid, {})  # an archived run keeps its uid (and its tools' keys)
    assert store.create_run("default/a", "00000000-0000-4000-8000-0000000000d2", {}).run_uid.endswith("d2")


def test_two_registrations_of_one_run_at_once_both_get_it(store: Store) -> None:
    """Two reconciles of a new AgentRun (its create handler and the resync) register it at once:
    the one that waits on the uid's lock finds the run the other made, the same run, and is
    given it (it once raised UidTaken against itself)."""
    import threading

    import psycopg

    from agentfast.runner.store import _UID_LOCK

    uid = "00000000-0000-4000-8000-0000000000d3"
    with psycopg.connect(store.dsn) as other:  # the first registration, between its lock and its commit
        other.execute(_UID_LOCK)
        got: list[object] = []
        second = threading.Thread(target=lambda: got.append(_outcome(lambda: store.create_run("default/r", uid, {"x": 2}))))
        second.start()
        second.join(1.0)
        assert second.is_alive(), "the second registration should wait on the uid's lock"
        other.execute("INSERT INTO agentfast_runs (run_id, run_uid, spec) VALUES ('default/r', %s, '{\"x\": 1}')", (uid,))
        other.commit()
    second.join(10)
    [record] = got
    assert not isinstance(record, Exception), record
    assert record.run_uid == uid and record.spec == {"x": 1}


def _outcome(fn):  # the value, or the exception raised
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        return err
