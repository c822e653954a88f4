"""Issue 13 items 1 and 2 on a real PostgreSQL server: a namespace's runner role reaches only its
own namespace's runs, never writes a decision, never changes the schema.

The attack the issue measured, performed with a runner role of namespace ``team-a``: read
``team-b``'s input and transcript, insert an approval for ``team-b``'s gated refund, take over
its lease, rewrite its spec. Each is refused by Postgres itself (row-level security and grants),
not by the store's code. And a runner role still runs its own run end to end (``agentfast
resume`` with its DSN, what a runner pod does), with a tool module that keeps no records.
"""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.migrations import MIGRATIONS
from agentfast.runner.store import SchemaBehind, Store

from .helpers import EXAMPLES, run_cli

QUIET_TOOLS = textwrap.dedent('''
    from agentfast.runner.tools import ToolContext, tool

    @tool
    def lookup_order(ctx: ToolContext, order_id: str) -> dict:
        """Look up an order."""
        return {"order_id": order_id, "charges": [4999, 4999], "status": "paid"}

    @tool(requires_approval=True)
    def issue_refund(ctx: ToolContext, order_id: str, amount_cents: int, reason: str = "") -> dict:
        """Refund part of an order."""
        return {"refund_id": ctx.idempotency_key, "amount_cents": amount_cents}

    @tool
    def add_case_note(ctx: ToolContext, order_id: str, note: str) -> dict:
        """Note something on the case."""
        return {"noted": True}
''')


def _register(store: Store, namespace: str, name: str, tools_module: str, **spec: object) -> str:
    """Register the refund example as the operator does, its tools taken from ``tools_module`` and
    ``spec`` set over its spec; returns its run id."""
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())}
    for tool in doc["spec"]["tools"]:
        tool["ref"] = f"{tools_module}:{tool['name']}"
    doc["spec"].update(spec)
    run_id = f"{namespace}/{name}"
    store.create_run(run_id, doc["metadata"]["uid"], doc)
    return run_id


def _as(dsn: str, role: str, password: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, user=role, password=password)


def _refused(conn: psycopg.Connection, query: str, *params: object) -> str:
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
        with conn.transaction():
            conn.execute(query, params)
    return str(err.value)


@pytest.fixture
def quiet_tools(tmp_path: Path) -> dict[str, str]:
    module = f"quiet_tools_{uuid.uuid4().hex[:6]}"
    (tmp_path / f"{module}.py").write_text(QUIET_TOOLS)
    return {"module": module, "PYTHONPATH": str(tmp_path)}


@pytest.mark.process
def test_a_namespaces_runner_role_reaches_only_its_own_runs(dsn: str, store: Store, quiet_tools: dict[str, str]) -> None:
    env = {"PYTHONPATH": quiet_tools["PYTHONPATH"]}
    theirs = _register(store, "team-b", "refund", quiet_tools["module"])
    assert run_cli("resume", theirs, "--no-wait", dsn=dsn, env=env, timeout=90).returncode == 0
    assert [a.call_id for a in store.awaiting(theirs)] == ["call-2-0"]  # team-b's refund awaits a human
    mine = _register(store, "team-a", "lookup", quiet_tools["module"])
    role, _ = store.set_tenant_password("team-a", "pw-a")
    assert role == store.tenant_role("team-a") and store.tenant("team-a")[0] == role

    with psycopg.connect(_as(dsn, role, "pw-a"), autocommit=True) as a:
        assert a.execute("SELECT current_user, agentfast_tenant()").fetchone() == (role, "team-a")
        for table in (
            "agentfast_runs",
            "agentfast_messages",
            "agentfast_checkpoints",
            "agentfast_turns",
            "agentfast_tool_calls",
            "agentfast_approvals",
            "agentfast_runners",
            "agentfast_payloads",
            "agentfast_sdk_blobs",
        ):
            visible = {r[0] for r in a.execute(f"SELECT DISTINCT run_id FROM {table}").fetchall()}
            assert visible <= {mine}, (table, visible)  # team-b's input, transcript, journal: not even seen
        assert a.execute("UPDATE agentfast_runs SET epoch = epoch + 1 WHERE run_id = %s", (theirs,)).rowcount == 0
        _refused(
            a,
            "INSERT INTO agentfast_approvals (run_id, call_id, decision, decided_by) VALUES (%s, 'call-2-0', 'approve', 'x')",
            theirs,
        )
        _refused(
            a,
            "INSERT INTO agentfast_approvals (run_id, call_id, decision, decided_by) VALUES (%s, 'call-2-0', 'approve', 'x')",
            mine,
        )
        _refused(a, "UPDATE agentfast_runs SET spec = '{}' WHERE run_id = %s", mine)  # a takeover, never a new spec
        _refused(a, "SELECT * FROM agentfast_tenants")
        _refused(a, "SELECT * FROM agentfast_void_decisions")
        _refused(a, "UPDATE agentfast_payloads SET content = '' WHERE run_id = %s", mine)  # a payload, once stored, never changes
        _refused(a, "DELETE FROM agentfast_payloads WHERE run_id = %s", mine)
        _refused(a, "CREATE TABLE public.agentfast_mine (x int)")  # the store's schema
        _refused(a, "CREATE SCHEMA agentfast_mine")  # nor a schema of its own: tools keep their tables under their own role (G11)
        _refused(a, "DELETE FROM agentfast_runs WHERE run_id = %s", mine)
        with pytest.raises(psycopg.Error) as err:  # rows of another namespace cannot be written
            with a.transaction():
                a.execute("SELECT set_config('agentfast.epoch', '0', true)")
                a.execute(
                    "INSERT INTO agentfast_messages (run_id, seq, iteration, message, epoch) VALUES (%s, 99, 9, '{}', 0)",
                    (theirs,),
                )
        # the fence (which sees no such run under row-level security) or the policy's check
        assert err.value.sqlstate in ("AF001", "42501"), err.value
    assert store.get_decision(theirs, "call-2-0") is None and store.get_run(theirs).spec["spec"]["input"]

    # team-b's own role runs team-b's run to the end, once a human (the operator's role) decided.
    role_b, _ = store.set_tenant_password("team-b", "pw-b")
    store.decide(theirs, "call-2-0", "approve", decided_by="kubernetes:alice")
    done = run_cli("resume", theirs, "--no-wait", dsn=_as(dsn, role_b, "pw-b"), env=env, timeout=90)
    assert done.returncode == 0, done.stdout
    assert store.load_context(theirs)[0].status.phase == "Succeeded"
    # The role of team-a cannot run team-b's run: it does not even see it.
    other = run_cli("resume", theirs, "--no-wait", dsn=_as(dsn, role, "pw-a"), env=env, timeout=90)
    assert other.returncode != 0 and "team-b/refund" in other.stdout


def test_a_runner_role_never_migrates_and_says_why(dsn: str, store: Store) -> None:
    role, _ = store.set_tenant_password("team-a", "pw-a")
    runner = Store(_as(dsn, role, "pw-a"), retry_for_s=2)
    try:
        assert runner.migrate() == len(MIGRATIONS)  # up to date: only read
        with psycopg.connect(dsn, autocommit=True) as owner:  # as if this release were one migration ahead
            owner.execute("DELETE FROM agentfast_migrations WHERE version = %s", (len(MIGRATIONS),))
        with pytest.raises(SchemaBehind) as err:
            runner.migrate()
        assert f"version {len(MIGRATIONS) - 1}" in str(err.value) and "operator migrates" in str(err.value)
    finally:
        runner.close()


def test_re_keying_a_namespace_keeps_its_role_and_changes_its_credential(dsn: str, store: Store) -> None:
    role, first = store.set_tenant_password("team-a", "pw-1")
    again, second = store.set_tenant_password("team-a", "pw-2")
    assert again == role and first != second and store.tenant("team-a") == (role, second)
    with psycopg.connect(_as(dsn, role, "pw-2")) as conn:
        assert conn.execute("SELECT agentfast_tenant()").fetchone()[0] == "team-a"
    assert store.tenant("nobody") is None and store.tenant_role("team-a") != store.tenant_role("team-b")


@pytest.mark.process
def test_a_table_in_the_runner_roles_own_schema_never_shadows_the_store(
    dsn: str, store: Store, quiet_tools: dict[str, str]
) -> None:
    # Releases before the tool host gave each runner role a schema of its name for its tools'
    # tables (first in its default search_path), and upgraded servers keep it. A table named like
    # the store's, made there, must not be what the runner reads: a fake agentfast_approvals with
    # an "approve" would run the refund unasked.
    env = {"PYTHONPATH": quiet_tools["PYTHONPATH"]}
    run_id = _register(store, "team-a", "refund", quiet_tools["module"])
    role, _ = store.set_tenant_password("team-a", "pw-a")
    with psycopg.connect(dsn, autocommit=True) as su:  # as such a release made it
        su.execute(f'CREATE SCHEMA "{role}" AUTHORIZATION "{role}"')
    runner_dsn = _as(dsn, role, "pw-a")
    with psycopg.connect(runner_dsn, autocommit=True) as tool:
        assert tool.execute("SELECT current_schema()").fetchone()[0] == role  # where a tool's CREATE TABLE lands
        tool.execute(
            "CREATE TABLE agentfast_approvals (run_id text, call_id text, decision text, reason text, result text,"
            " decided_by text, decided_at timestamptz DEFAULT now())"
        )
        tool.execute(
            "INSERT INTO agentfast_approvals (run_id, call_id, decision, decided_by) VALUES (%s, 'call-2-0', 'approve', 'tool')",
            (run_id,),
        )
    proc = run_cli("resume", run_id, "--no-wait", dsn=runner_dsn, env=env, timeout=90)
    assert proc.returncode == 0, proc.stdout
    ctx, pending = store.load_context(run_id)
    assert ctx.status.phase == "WaitingForApproval" and [a.call_id for a in pending.awaiting] == [
        "call-2-0"
    ]  # still asks a human
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # and another namespace's role cannot reach this schema
        role_b, _ = store.set_tenant_password("team-b", "pw-b")
        with psycopg.connect(_as(dsn, role_b, "pw-b"), autocommit=True) as b:
            b.execute(f'SELECT * FROM "{role}".agentfast_approvals')


@pytest.mark.process
def test_the_whole_chain_works_for_an_owner_that_is_no_superuser(dsn: str, quiet_tools: dict[str, str]) -> None:
    # Production shape (the chart's bundled server, a managed Postgres): the operator's role owns
    # the database and may create roles, and is no superuser; it migrates, makes a namespace's
    # role, and that role runs the namespace's run.
    owner = f"owner_{uuid.uuid4().hex[:8]}"
    database = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"CREATE ROLE \"{owner}\" LOGIN PASSWORD 'pw-owner' CREATEROLE NOSUPERUSER")
        su.execute(f'ALTER DATABASE "{database}" OWNER TO "{owner}"')
        if su.execute("SELECT 1 FROM pg_roles WHERE rolname = 'agentfast_runner'").fetchone():
            # made by an earlier test's database on this shared server; a fresh server's owner makes it itself
            su.execute(f'GRANT agentfast_runner TO "{owner}" WITH ADMIN OPTION')
    owner_dsn = _as(dsn, owner, "pw-owner")
    store = Store(owner_dsn, retry_for_s=5)
    try:
        store.migrate()
        run_id = _register(store, "team-c", "refund", quiet_tools["module"])
        role, _ = store.set_tenant_password("team-c", "pw-c")
        env = {"PYTHONPATH": quiet_tools["PYTHONPATH"]}
        assert run_cli("resume", run_id, "--no-wait", dsn=_as(dsn, role, "pw-c"), env=env, timeout=90).returncode == 0
        store.decide(run_id, "call-2-0", "approve", decided_by="kubernetes:alice")
        assert run_cli("resume", run_id, "--no-wait", dsn=_as(dsn, role, "pw-c"), env=env, timeout=90).returncode == 0
        assert store.load_context(run_id)[0].status.phase == "Succeeded"
    finally:
        store.close()


@pytest.mark.process
def test_a_new_run_of_an_old_name_never_touches_the_earlier_runs_rows(
    dsn: str, store: Store, quiet_tools: dict[str, str]
) -> None:
    # Issue 13 item 6: deleting an AgentRun keeps its rows "for audit"; re-applying one of the same
    # name used to wipe them. Now they are kept under NS/NAME@UID8, with their decisions.
    env = {"PYTHONPATH": quiet_tools["PYTHONPATH"]}
    first = _register(store, "team-a", "refund", quiet_tools["module"])
    assert run_cli("resume", first, "--no-wait", dsn=dsn, env=env, timeout=90).returncode == 0
    store.decide(first, "call-2-0", "approve", decided_by="kubernetes:alice")
    old_uid = store.get_run(first).run_uid
    before = store.decision_log(first)
    kept = store.archive_run(first)
    assert kept == f"{first}@{old_uid.replace('-', '')[:8]}"
    second = _register(store, "team-a", "refund", quiet_tools["module"])  # the operator registers the new AgentRun
    assert second == first and store.get_run(second).run_uid != old_uid and store.load_context(second) is None
    assert store.get_run(kept).run_uid == old_uid and store.decision_log(kept) == [{**d, "run_id": kept} for d in before]
    assert store.load_context(kept)[0].status.phase == "WaitingForApproval" and len(store.load_snapshot(kept).messages) > 2
    assert [r.run_id for r in store.earlier_runs(first)] == [kept]
    history = run_cli("history", kept, dsn=dsn)
    assert history.returncode == 0 and "kubernetes:alice" in history.stdout, history.stdout
    assert run_cli("resume", second, "--no-wait", dsn=dsn, env=env, timeout=90).returncode == 0
    named = run_cli("history", second, dsn=dsn)
    assert "earlier runs of this name" in named.stdout and kept in named.stdout, named.stdout
    role, _ = store.set_tenant_password("team-a", "pw-a")  # still the namespace's, under row-level security
    with psycopg.connect(_as(dsn, role, "pw-a"), autocommit=True) as a:
        assert {r[0] for r in a.execute("SELECT run_id FROM agentfast_runs").fetchall()} == {first, kept}


@pytest.mark.process
def test_a_run_whose_agentrun_is_deleted_mid_run_is_cancelled_and_nothing_more_runs(
    dsn: str, store: Store, quiet_tools: dict[str, str]
) -> None:
    # Issue 13 item 6: deleted while its refund awaits a human, the run ends Cancelled (kept for
    # audit); a late approval or a late runner does nothing.
    from agentfast.runner.store import UnknownCall

    env = {"PYTHONPATH": quiet_tools["PYTHONPATH"]}
    run_id = _register(store, "team-a", "refund", quiet_tools["module"])
    assert run_cli("resume", run_id, "--no-wait", dsn=dsn, env=env, timeout=90).returncode == 0
    messages = len(store.load_snapshot(run_id).messages)
    assert store.cancel_run(run_id, "the AgentRun refund was deleted") is True
    ctx, pending = store.load_context(run_id)
    assert (ctx.status.phase, ctx.status.reason) == ("Cancelled", "Deleted") and [a.call_id for a in pending.awaiting] == [
        "call-2-0"
    ]
    assert len(store.load_snapshot(run_id).messages) == messages  # the transcript, kept as it was
    with pytest.raises(UnknownCall):
        store.decide(run_id, "call-2-0", "approve", decided_by="kubernetes:late")
    late = run_cli("resume", run_id, "--no-wait", dsn=dsn, env=env, timeout=90)
    assert store.load_context(run_id)[0].status.phase == "Cancelled" and store.journal(run_id, 2)[0].state == "planned", (
        late.stdout
    )
    assert store.cancel_run(run_id, "again") is False  # an ended run keeps its ending


def test_a_revoked_namespace_credential_stops_at_once_and_comes_back_re_keyed(dsn: str, store: Store) -> None:
    # Issue 13 item 3: a namespace with no AgentRun left (or no longer watched) loses its runner
    # credential: no new login, and a session still open sees nothing from its next statement.
    run_id = _register(store, "team-a", "kept", "nowhere")
    role, _ = store.set_tenant_password("team-a", "pw-1")
    with psycopg.connect(_as(dsn, role, "pw-1"), autocommit=True) as open_session:
        assert open_session.execute("SELECT count(*) FROM agentfast_runs").fetchone()[0] == 1
        assert store.tenants().keys() == {"team-a"} and store.revoke_tenant("team-a") is True
        assert open_session.execute("SELECT count(*) FROM agentfast_runs").fetchone()[0] == 0
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(_as(dsn, role, "pw-1"), connect_timeout=5).close()
    assert store.tenant("team-a") is None and store.revoke_tenant("team-a") is False
    again, _ = store.set_tenant_password("team-a", "pw-2")  # a new run there: the same role, a new password, LOGIN again
    with psycopg.connect(_as(dsn, again, "pw-2")) as back:
        assert again == role and back.execute("SELECT run_id FROM agentfast_runs").fetchall() == [(run_id,)]


@pytest.mark.process
def test_retention_deletes_only_ended_runs_whose_agentrun_is_gone(
    dsn: str, store: Store, quiet_tools: dict[str, str], monkeypatch
) -> None:
    # Issue 13 item 6: retention is explicit (spec.ttlSecondsAfterFinished, else the chart's
    # default; 0 keeps), and never deletes the rows of a live AgentRun (it would run again).
    import time

    from agentfast.operator import main

    env = {"PYTHONPATH": quiet_tools["PYTHONPATH"]}
    monkeypatch.setattr(main.STATE, "store", store)
    monkeypatch.setattr(main.SETTINGS, "ttl_after_finished_s", 0)
    monkeypatch.setattr(main.SETTINGS, "namespaces", [])

    def paused(name: str, ttl: int) -> str:
        run_id = _register(store, "team-a", name, quiet_tools["module"], ttlSecondsAfterFinished=ttl)
        assert run_cli("resume", run_id, "--no-wait", dsn=dsn, env=env, timeout=90).returncode == 0
        return run_id

    gone, live, forever = paused("gone", 1), paused("live", 1), paused("forever", 0)
    live_map = {live: store.get_run(live).run_uid, forever: "another-uid"}  # "gone" has no AgentRun; "forever"'s is a newer one
    main._retain(live_map)  # the deletions the operator missed: unfinished runs without their AgentRun end Cancelled
    assert [store.load_context(r)[0].status.phase for r in (gone, live, forever)] == [
        "Cancelled",
        "WaitingForApproval",
        "Cancelled",
    ]
    store.cancel_run(live, "test: ended")
    time.sleep(1.5)
    assert {r for r, _ in store.expired_runs(0)} == {gone, live}  # forever: 0 keeps
    main._retain(live_map)
    assert store.get_run(gone) is None  # past its retention and its AgentRun gone
    assert store.get_run(live) is not None and store.get_run(forever) is not None  # a live AgentRun's rows; ttl 0
    monkeypatch.setattr(main.SETTINGS, "ttl_after_finished_s", 1)
    assert {r for r, _ in store.expired_runs(1)} == {live}  # the chart's default does not override a run's own 0
