"""Human decisions, through the CLI as a user makes them (issue 11, items 4 and 5).

- A decision is accepted only for a call awaiting one now, once; a denial carries its reason to
  the model (case 05).
- Every call of a batch that awaits a human is pending at once and decidable in any order; the
  run goes on when all are decided (case 06; a batch of four with two gated calls and two
  siblings, in both adapters).
- ``agentfast complete`` records that an awaited call's effect already happened (case 08), and
  is refused for a call that awaits nothing.
- A tool's recovery check settles an interrupted call before a human is asked.

The inputs of cases 05, 06 and 08 are copied in tests/cases/NN/. Every command is a real
``agentfast`` process against the test's own Postgres database; tools count their executions in
a file ($CASE_EFFECTS).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentfast.runner.store import Store

from .helpers import phase_of, wait_until

CASES = Path(__file__).resolve().parent / "cases"


class Cli:
    """``agentfast`` as a user runs it: one case's tools on PYTHONPATH, its AgentRun file in a tmp dir."""

    def __init__(self, dsn: str, tmp: Path, tools_dir: Path, **env: str):
        self.dsn, self.tmp = dsn, tmp
        self.effects = tmp / "effects.log"
        self.env = {
            **os.environ,
            "AGENTFAST_DSN": dsn,
            "CASE_EFFECTS": str(self.effects),
            "NO_COLOR": "1",
            "COLUMNS": "200",
            "PYTHONPATH": os.pathsep.join([str(tools_dir), os.environ.get("PYTHONPATH", "")]),
            **env,
        }
        self.env.pop("AGENTFAST_FAULT", None)

    def agentrun(self, src: Path, script: Path, **spec: object) -> Path:
        """A copy of the AgentRun ``src`` whose model plays ``script`` (an absolute path), with ``spec`` overrides."""
        doc = yaml.safe_load(src.read_text())
        doc["spec"]["model"]["script"] = str(script)
        doc["spec"].update(spec)
        path = self.tmp / f"{doc['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    def spawn(self, *args: str, fault: str | None = None, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "agentfast.runner", *args],
            env={**self.env, **env, **({"AGENTFAST_FAULT": fault} if fault else {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def __call__(self, *args: str, fault: str | None = None, **env: str) -> subprocess.CompletedProcess:
        proc = self.spawn(*args, fault=fault, **env)
        out, err = proc.communicate(timeout=90)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def ran(self, tool: str) -> int:
        """How many times the tool's body ran."""
        return sum(1 for line in self.effects.read_text().splitlines() if line.split()[1] == tool) if self.effects.exists() else 0


def refused(p: subprocess.CompletedProcess, *phrases: str) -> None:
    """Exit 2 with a message (no traceback) containing each phrase."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.strip(), p.stderr
    for phrase in phrases:
        assert phrase in p.stderr, p.stderr


def tool_messages(store: Store, run_id: str) -> dict[str, str]:
    """The transcript's tool messages by provider tool-call id."""
    return {m.tool_call_id: m.content for m in store.load_snapshot(run_id).messages if m.role == "tool"}


# -- case 05 ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_case05_decisions_only_for_awaited_calls_and_a_denial_keeps_its_reason(tmp_path: Path, dsn: str, store: Store) -> None:
    cli = Cli(dsn, tmp_path, CASES / "05")
    run, rid = "case05-decisions", "default/case05-decisions"
    path = cli.agentrun(CASES / "05" / "agentrun.yaml", CASES / "05" / "script.yaml")
    p = cli("run", str(path), "--no-wait")
    assert p.returncode == 0 and "WaitingForApproval" in p.stdout, p.stdout
    assert cli.ran("add_case_note") == 1 and cli.ran("issue_voucher") == 0

    refused(
        cli("deny", run, "call-1-1", "--reason", "not needed"),
        "call-1-1",
        "does not await",
        "it is finished (add_case_note)",
        "awaiting a decision now: call-1-0",
    )
    refused(cli("approve", run, "call-3-0"), "call-3-0", "no such tool call")
    refused(cli("approve", run, "call-1-0-rerun1"), "issue_voucher is idempotent")
    refused(cli("complete", run, "call-1-1", "--result", '{"ok": true}'), "does not await")
    refused(cli("deny", run, "call-1-0"), "reason")  # the model would read nothing
    refused(cli("deny", run, "call-1-0", "--reason", "   "), "reason")
    assert store.get_decisions(rid, ["call-1-0", "call-1-1", "call-3-0"]) == {}

    p = cli("deny", run, "call-1-0", "--reason", "customer withdrew")
    assert p.returncode == 0 and "customer withdrew" in p.stdout, (p.stdout, p.stderr)
    refused(cli("deny", run, "call-1-0", "--reason", "another reason"), "already decided: deny (customer withdrew)")
    refused(cli("approve", run, "call-1-0"), "already decided")
    refused(cli("deny", run, "call-1-0", "--reason", "customer withdrew"), "already decided")  # not twice, even the same

    p = cli("resume", run)
    assert p.returncode == 0 and "Succeeded" in p.stdout, p.stdout
    assert "tool done: call-1-0" not in p.stdout and "denied, not run: call-1-0 issue_voucher: customer withdrew" in p.stdout
    msg = tool_messages(store, rid)["tc_e1"]
    assert msg == "denied: a human reviewer declined this issue_voucher call: customer withdrew. It was not run."
    assert cli.ran("issue_voucher") == 0 and cli.ran("add_case_note") == 1
    ctx, _ = store.load_context(rid)
    assert (ctx.counters.tool_calls, ctx.counters.approvals_requested) == (1, 1)  # a denied call is not a tool call
    refused(cli("approve", run, "call-1-0"), "already decided")
    refused(cli("approve", run, "call-1-1"), "cannot be decided: the run has ended (Succeeded")


# -- case 06 ---------------------------------------------------------------------------------------


def test_case06_every_gated_call_is_pending_at_once_and_decided_in_any_order(tmp_path: Path, dsn: str, store: Store) -> None:
    cli = Cli(dsn, tmp_path, CASES / "06")
    run, rid = "case06-three-gated", "default/case06-three-gated"
    p = cli("run", str(cli.agentrun(CASES / "06" / "agentrun.yaml", CASES / "06" / "script.yaml")), "--no-wait")
    assert p.returncode == 0, p.stdout
    assert "waiting for decisions on 3 calls" in p.stdout and all(c in p.stdout for c in ("call-1-0", "call-1-1", "call-1-2"))

    status = json.loads(cli("status", run, "-o", "json").stdout)
    assert [a["call_id"] for a in status["awaiting"]] == ["call-1-0", "call-1-1", "call-1-2"]
    assert [a["tool"] for a in status["awaiting"]] == ["freeze_card", "reissue_card", "refund_charge"]
    assert status["pending"]["call_id"] == "call-1-0" and len(status["pending"]["awaiting"]) == 3
    text = cli("status", run).stdout
    assert sum(1 for line in text.splitlines() if line.strip().startswith("awaiting")) == 3, text
    assert cli.ran("freeze_card") + cli.ran("reissue_card") + cli.ran("refund_charge") == 0

    assert cli("approve", run, "call-1-2").returncode == 0
    status = json.loads(cli("status", run, "-o", "json").stdout)
    assert [a["call_id"] for a in status["awaiting"]] == ["call-1-0", "call-1-1"]
    assert [(d["call_id"], d["decision"]) for d in status["decided"]] == [("call-1-2", "approve")]
    assert "decided" in cli("status", run).stdout
    assert cli("approve", run, "call-1-0").returncode == 0
    assert cli("approve", run, "call-1-1").returncode == 0
    assert store.awaiting(rid) == []
    p = cli("resume", run, "--no-wait")
    assert p.returncode == 0 and "Succeeded" in p.stdout, p.stdout
    assert (cli.ran("freeze_card"), cli.ran("reissue_card"), cli.ran("refund_charge")) == (1, 1, 1)
    ctx, pending = store.load_context(rid)
    assert pending is None and (ctx.counters.tool_calls, ctx.counters.approvals_requested) == (3, 3)
    assert list(tool_messages(store, rid)) == ["tc_f1", "tc_f2", "tc_f3"]  # the model's order


@pytest.mark.process
@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_batch_of_four_two_gated_two_siblings_waits_for_every_decision(
    tmp_path: Path, dsn: str, store: Store, adapter: str
) -> None:
    """A waiting runner goes on only when both gated calls are decided, in any order; siblings ran once, first."""
    cli = Cli(dsn, tmp_path, CASES)
    tools = [{"name": n, "ref": f"decision_tools:{n}"} for n in ("freeze_card", "add_note", "refund_charge")]
    extra = (
        {"adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"}}
        if adapter == "langgraph"
        else {}
    )
    path = cli.agentrun(CASES / "05" / "agentrun.yaml", CASES / "batch4.yaml", tools=tools, **extra)
    rid = "default/case05-decisions"
    proc = cli.spawn("run", str(path))  # waits for the decisions
    try:
        wait_until(lambda: [a.call_id for a in store.awaiting(rid)] == ["call-1-0", "call-1-2"], what="both gated calls pending")
        _, pending = store.load_context(rid)
        assert sorted(r.call_id for r in pending.executed_sibling_results) == ["call-1-1", "call-1-3"]
        assert cli.ran("add_note") == 2

        store.decide(rid, "call-1-2", "approve", decided_by="test")  # the later one first
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)  # woken by the decision, it keeps waiting for the other one
        assert phase_of(store, rid) == "WaitingForApproval" and cli.ran("refund_charge") == 0
        store.decide(rid, "call-1-0", "complete", result='{"frozen":"0457","by":"phone"}', decided_by="test")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Succeeded" in out, (out, err)
    assert (cli.ran("freeze_card"), cli.ran("refund_charge"), cli.ran("add_note")) == (0, 1, 2)
    msgs = tool_messages(store, rid)
    assert list(msgs) == ["tc_1", "tc_2", "tc_3", "tc_4"]
    assert msgs["tc_1"] == '{"frozen":"0457","by":"phone"}' and msgs["tc_3"] == '{"refunded": "CH-1"}'
    ctx, _ = store.load_context(rid)
    assert (ctx.counters.tool_calls, ctx.counters.approvals_requested) == (4, 2)  # a completed call counts
    assert "recorded as done, not run: call-1-0 freeze_card" in out and "tool done: call-1-0" not in out


# -- case 08 and complete --------------------------------------------------------------------------


@pytest.mark.process
def test_case08_complete_records_an_in_flight_effect_that_already_happened(tmp_path: Path, dsn: str, store: Store) -> None:
    cli = Cli(dsn, tmp_path, CASES / "08")
    run, rid = "case08-inflight", "default/case08-inflight"
    p = cli(
        "run",
        str(cli.agentrun(CASES / "08" / "agentrun.yaml", CASES / "08" / "script.yaml")),
        fault="tool.after_call:send_voucher",
    )
    assert p.returncode == -signal.SIGKILL and cli.ran("send_voucher") == 1, p.stdout
    p = cli("resume", run, "--no-wait")
    assert p.returncode == 0 and "waiting for approval of call-1-0-rerun1" in p.stdout and "may already have run" in p.stdout, (
        p.stdout
    )
    status = json.loads(cli("status", run, "-o", "json").stdout)
    assert [(a["call_id"], a["reason"]) for a in status["awaiting"]] == [("call-1-0-rerun1", "in_flight_not_idempotent")]

    refused(cli("complete", run, "call-1-0", "--result", '{"voucher":"V-100"}'), "awaiting a decision now: call-1-0-rerun1")
    refused(cli("complete", run, "call-1-0-rerun2", "--result", '{"voucher":"V-100"}'), "does not await")
    refused(cli("complete", run, "call-1-0-rerun1", "--result", ""), "JSON")
    p = cli("complete", run, "call-1-0-rerun1", "--result", '{"voucher":"V-100"}')  # kept verbatim: no re-encoding
    assert p.returncode == 0, p.stderr
    refused(cli("complete", run, "call-1-0-rerun1", "--result", '{"voucher":"V-100"}'), "already decided")
    refused(cli("approve", run, "call-1-0-rerun1"), "already decided")

    p = cli("resume", run, "--no-wait")
    assert p.returncode == 0 and "Succeeded" in p.stdout, p.stdout
    assert cli.ran("send_voucher") == 1
    assert tool_messages(store, rid) == {"tc_h1": '{"voucher":"V-100"}'}
    [entry] = store.journal(rid)
    assert entry.state == "done" and entry.result.recorded_by == "human:" + store.get_decision(rid, "call-1-0-rerun1").decided_by
    ctx, _ = store.load_context(rid)
    assert ctx.counters.tool_calls == 1 and ctx.counters.tool_errors == 0
    refused(cli("complete", run, "call-1-0-rerun1", "--result", "{}"), "already decided")


def test_a_denied_in_flight_rerun_does_not_claim_it_was_not_run(tmp_path: Path, dsn: str, store: Store) -> None:
    cli = Cli(dsn, tmp_path, CASES / "08")
    run, rid = "case08-inflight", "default/case08-inflight"
    cli(
        "run",
        str(cli.agentrun(CASES / "08" / "agentrun.yaml", CASES / "08" / "script.yaml")),
        fault="tool.after_call:send_voucher",
    )
    assert cli("resume", run, "--no-wait").returncode == 0
    assert cli("deny", run, "call-1-0-rerun1", "--reason", "do not send another").returncode == 0
    assert cli("resume", run).returncode == 0
    msg = tool_messages(store, rid)["tc_h1"]
    assert msg.startswith("denied:") and "do not send another" in msg and "not run" not in msg and "may have taken effect" in msg
    assert cli.ran("send_voucher") == 1


# -- recovery checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["happened", "not_happened", "unknown", "raise"])
def test_a_recovery_check_settles_an_interrupted_call_before_a_human_is_asked(
    tmp_path: Path, dsn: str, store: Store, answer: str
) -> None:
    cli = Cli(dsn, tmp_path, CASES)
    tools = [{"name": "send_mail", "ref": "decision_tools:send_mail"}]
    path = cli.agentrun(CASES / "08" / "agentrun.yaml", CASES / "mail.yaml", tools=tools)
    run, rid = "case08-inflight", "default/case08-inflight"
    p = cli("run", str(path), fault="tool.after_call:send_mail")
    assert p.returncode == -signal.SIGKILL and cli.ran("send_mail") == 1

    p = cli("resume", run, "--no-wait", RECOVERY_ANSWER=answer)
    assert p.returncode == 0, (p.stdout, p.stderr)
    [entry] = store.journal(rid)
    if answer == "happened":  # done with the check's result; no human, no second mail
        assert "Succeeded" in p.stdout and "recorded as done, not run" in p.stdout
        assert cli.ran("send_mail") == 1 and entry.result.recorded_by == "recovery_check"
        assert tool_messages(store, rid)["tc_m"] == json.dumps({"found_by": entry.idempotency_key, "mail": "M-1"}, sort_keys=True)
        assert store.load_context(rid)[0].counters.approvals_requested == 0
    elif answer == "not_happened":  # safe to run again, with the same key
        assert "Succeeded" in p.stdout and cli.ran("send_mail") == 2 and entry.attempts == 2
        keys = {line.split()[3] for line in cli.effects.read_text().splitlines()}
        assert keys == {entry.idempotency_key}
    else:  # the check cannot tell (or fails): a human decides
        assert phase_of(store, rid) == "WaitingForApproval" and cli.ran("send_mail") == 1
        assert [a.call_id for a in store.awaiting(rid)] == ["call-1-0-rerun1"]
        # A human's decision on the re-run wins over the check: the check is not asked again.
        assert cli("complete", run, "call-1-0-rerun1", "--result", '"sent by hand"').returncode == 0
        p = cli("resume", run, "--no-wait", RECOVERY_ANSWER="not_happened")
        assert p.returncode == 0 and "Succeeded" in p.stdout and cli.ran("send_mail") == 1
        assert tool_messages(store, rid)["tc_m"] == '"sent by hand"'
