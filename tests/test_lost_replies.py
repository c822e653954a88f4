"""Every model reply the endpoint answered counts against the budget, whatever dies when (issue 30
item 4, issue 31 item 4, case 11 of ../shared/cases).

Process tier: real runner processes SIGKILLed at ``model.after_call`` (the endpoint answered and
billed; the turn is not saved), real Postgres, the scripted model over real HTTP behind a
ModelConfig with prices (11 USD a reply: 1,000 prompt + 100 completion tokens at 10,000 USD per
million). Both adapters:

- three replies lost to crashes show as 3,300 tokens / 33 USD in ``agentfast status`` and the
  store's reader view; the next resume ends the run ``Failed`` (budget exceeded, max_cost 30)
  without asking the endpoint again;
- a reply recorded when it arrived and then kept by its saved turn is counted once: a runner
  killed after the turn was saved (``tool.before_call``) and resumed to the end shows exactly the
  two replies the endpoint answered, and so does status while the run is down;
- a lost reply and the replies that follow add up: 3 answered, 3 counted;
- at the store: a retried record adds nothing, a turn keeps only its own lease's reply, a zombie's stays lost.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from agentfast.runner.names import ExitCode
from agentfast.runner.store import Store
from agentfast.testing.scripted import ScriptedModelServer, parse_script

from .helpers import run_cli

pytestmark = pytest.mark.process

KILLED = -9  # a runner that SIGKILLed itself at a fault point (spawn_cli runs python directly)
SCRIPT = {
    "model": "scripted-branch",
    "turns": [
        {
            "tool_calls": [{"id": "tc_1", "name": "echo", "arguments": {"text": "ZX4 1QQ"}}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 100},
        },
        {"content": "Your nearest branch is Elm Street.", "usage": {"prompt_tokens": 1000, "completion_tokens": 100}},
    ],
}
PRICES = {"promptPerMillionTokens": 10000, "completionPerMillionTokens": 10000}  # 1,100 tokens: 11 USD
BUDGET = {"max_iterations": 6, "max_tokens": 20000, "max_cost": 30, "max_duration_ms": 120000, "classifier": "none"}


def _write(tmp_path: Path, base_url: str, adapter: str, name: str) -> Path:
    config = {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "ModelConfig",
        "metadata": {"name": "llm"},
        "spec": {"baseURL": base_url, "models": ["scripted-branch"], "maxRetries": 0, "timeoutSeconds": 20, "prices": PRICES},
    }
    spec: dict = {
        "model": {"name": "scripted-branch", "config": "llm"},
        "input": "Which branch is nearest to ZX4 1QQ?",
        "tools": [{"name": "echo", "ref": "agentfast.testing.tools:echo"}],
        "budget": BUDGET,
    }
    if adapter == "langgraph":
        spec |= {"adapter": "langgraph", "graph": {"ref": "agentfast.runner.examples.refund_graph:build"}}
    run = {"apiVersion": "agentfast.dev/v1alpha1", "kind": "AgentRun", "metadata": {"name": name, "uid": str(uuid.uuid4())}}
    run["spec"] = spec
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all([config, run]))
    return path


def _status(name: str, dsn: str) -> dict:
    proc = run_cli("status", name, "-o", "json", dsn=dsn)
    assert proc.returncode == 0, proc.stdout
    doc: dict = json.loads(proc.stdout)
    return doc


def _replies(dsn: str, run_id: str) -> list[tuple[int, int, int, bool]]:
    """(iteration, epoch, total tokens, kept) of every recorded reply of the run, in order."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT iteration, epoch, prompt_tokens + completion_tokens, kept FROM agentfast_model_replies"
            " WHERE run_id = %s ORDER BY epoch, iteration",
            (run_id,),
        ).fetchall()
    return [tuple(r) for r in rows]  # type: ignore[misc]


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_replies_lost_to_crashes_count_and_the_next_resume_fails_without_asking_again(
    tmp_path: Path, dsn: str, store: Store, adapter: str
) -> None:
    name = f"lost-{adapter}"
    with ScriptedModelServer(parse_script(SCRIPT)) as server:
        path = _write(tmp_path, server.base_url, adapter, name)
        first = run_cli("run", str(path), "--no-wait", dsn=dsn, fault="model.after_call", timeout=90)
        assert first.returncode == KILLED, first.stdout
        for _ in range(2):
            again = run_cli("resume", name, "--no-wait", dsn=dsn, fault="model.after_call", timeout=90)
            assert again.returncode == KILLED, again.stdout
        assert len(server.requests) == 3  # the endpoint answered (and billed) three requests

        doc = _status(name, dsn)
        assert doc["usage"]["total_tokens"] == 3300 and doc["usage"]["lost_replies"] == 3
        assert doc["usage"]["prompt_tokens"] == 3000 and doc["usage"]["completion_tokens"] == 300
        assert doc["cost"]["amount"] == pytest.approx(33.0) and doc["cost"]["max_cost"] == 30
        ctx, _ = store.load_context(f"default/{name}")  # the operator's and the inbox's view
        assert ctx.usage.total_tokens == 3300 and ctx.cost() == pytest.approx(33.0)

        last = run_cli("resume", name, "--no-wait", dsn=dsn, timeout=90)
        assert last.returncode == ExitCode.FAILED, last.stdout
        assert len(server.requests) == 3  # not asked again
    ctx, _ = store.load_context(f"default/{name}")
    assert (ctx.status.phase, ctx.status.reason) == ("Failed", "BudgetExceeded")
    assert ctx.status.message == (
        "budget exceeded: max_cost is 30.00 USD and the run has cost 33.00 USD"
        " (3000 prompt and 300 completion tokens, 3 of them in model replies lost to crashes)"
    )
    assert ctx.usage.total_tokens == 3300  # still counted once each after the ending's checkpoint
    assert [(it, tokens, kept) for it, _, tokens, kept in _replies(dsn, f"default/{name}")] == [(1, 1100, False)] * 3
    # the checkpoint itself counts saved turns only: the lost replies are never folded in twice
    assert store.load_snapshot(f"default/{name}").context.usage.total_tokens == 0
    # the operator's metrics count them too (agentfast_tokens_total, agentfast_cost_total)
    from agentfast.operator.metrics import RUNS_SQL

    [rows] = store.read_together([(RUNS_SQL, None)])
    [row] = [r for r in rows if r["phase"] == "Failed"]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3000, 300) and row["cost"] == pytest.approx(33.0)


@pytest.mark.parametrize("adapter", ["vanilla", "langgraph"])
def test_a_reply_recorded_then_kept_by_its_turn_is_counted_once(tmp_path: Path, dsn: str, store: Store, adapter: str) -> None:
    name = f"kept-{adapter}"
    run_id = f"default/{name}"
    with ScriptedModelServer(parse_script(SCRIPT)) as server:
        path = _write(tmp_path, server.base_url, adapter, name)
        # Killed after the turn of iteration 1 was saved (with its call's intent), before its checkpoint.
        first = run_cli("run", str(path), "--no-wait", dsn=dsn, fault="tool.before_call", timeout=90)
        assert first.returncode == KILLED, first.stdout
        assert _replies(dsn, run_id) == [(1, 1, 1100, True)]
        down = _status(name, dsn)  # the turn saved since the checkpoint counts, once
        assert down["usage"]["total_tokens"] == 1100 and down["usage"]["lost_replies"] == 0
        done = run_cli("resume", name, "--no-wait", dsn=dsn, timeout=90)
        assert done.returncode == ExitCode.OK, done.stdout
        assert len(server.requests) == 2
    doc = _status(name, dsn)
    assert doc["context"]["status"]["phase"] == "Succeeded"
    assert doc["usage"]["total_tokens"] == 2200 and doc["usage"]["lost_replies"] == 0
    assert doc["cost"]["amount"] == pytest.approx(22.0)
    assert [(it, tokens, kept) for it, _, tokens, kept in _replies(dsn, run_id)] == [(1, 1100, True), (2, 1100, True)]


def test_a_lost_reply_and_the_ones_after_it_add_up(tmp_path: Path, dsn: str, store: Store) -> None:
    name = "lost-once"
    with ScriptedModelServer(parse_script(SCRIPT)) as server:
        path = _write(tmp_path, server.base_url, "vanilla", name)
        first = run_cli("run", str(path), "--no-wait", dsn=dsn, fault="model.after_call", timeout=90)
        assert first.returncode == KILLED, first.stdout
        done = run_cli("resume", name, "--no-wait", dsn=dsn, timeout=90)
        assert done.returncode == ExitCode.OK, done.stdout  # 22 USD before the last call: under 30
        assert len(server.requests) == 3
    doc = _status(name, dsn)
    assert doc["usage"]["total_tokens"] == 3300 and doc["usage"]["lost_replies"] == 1
    assert doc["cost"]["amount"] == pytest.approx(33.0)
    kept = [k for _, _, _, k in _replies(dsn, f"default/{name}")]
    assert kept == [False, True, True]  # epoch 1's reply lost; epoch 2's two kept by their turns


def test_a_reply_is_recorded_once_kept_only_by_its_own_leases_turn_and_a_zombies_counts(store: Store) -> None:
    """Store level: a retried record adds nothing; the turn saved under the same lease keeps its
    reply; a reply recorded by a runner whose lease was taken over (a zombie) stays lost."""
    from agentfast.runner.snapshot import Message
    from agentfast.runner.store import LostReplies, Turn

    run_id = "default/ledger"
    store.create_run(run_id, str(uuid.uuid4()), {"spec": {}})
    zombie = store.acquire_lease(run_id)
    store.record_reply(zombie, 1, 1000, 100, 11.0)
    store.record_reply(zombie, 1, 1000, 100, 11.0)  # a retry after a lost acknowledgement
    assert store.lost_replies(run_id) == LostReplies(1, 1000, 100)
    lease = store.acquire_lease(run_id)  # taken over: the zombie's reply was paid for and is lost
    store.record_reply(lease, 1, 900, 90, None)
    store.save_turn(lease, Turn(1, Message(role="assistant", content="hi"), 900, 90), [])
    assert store.lost_replies(run_id) == LostReplies(1, 1000, 100)  # the new lease's reply is kept by its turn
    with psycopg.connect(store.dsn) as conn:
        rows = conn.execute(
            "SELECT epoch, kept, cost FROM agentfast_model_replies WHERE run_id = %s ORDER BY epoch", (run_id,)
        ).fetchall()
    assert rows == [(zombie.epoch, False, 11.0), (lease.epoch, True, None)]
