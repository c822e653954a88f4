"""Cost on real runs (issue 17 item 5, G7): ``agentfast run`` on the embedded tier's Postgres,
the model over real HTTP, then ``agentfast status``.

- a run on a ModelConfig endpoint with prices goes over ``spec.budget.max_cost`` and ends
  ``Failed`` (BudgetExceeded) with a sentence naming the limit and the cost, exit 1;
- a run on the scripted model with ``spec.model.prices`` stays under it and succeeds, its cost
  shown by ``agentfast status`` (text and ``-o json``);
- a cost limit on a model without prices is refused before anything is registered, exit 2.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml

from agentfast.runner.names import ExitCode
from agentfast.runner.store import Store
from agentfast.testing.scripted import ScriptedModelServer, load_script

from .helpers import run_cli

pytestmark = pytest.mark.process

ECHO = {"name": "echo", "ref": "agentfast.testing.tools:echo"}


def _agentrun(name: str, model: dict, budget: dict) -> dict:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "uid": str(uuid.uuid4())},
        "spec": {"model": model, "input": "echo until told to stop", "tools": [ECHO], "budget": budget},
    }


def _modelconfig(base_url: str, prices: dict | None) -> dict:
    spec = {"baseURL": base_url, "models": ["scripted-endless"], "maxRetries": 0, "timeoutSeconds": 20}
    if prices:
        spec["prices"] = prices
    return {"apiVersion": "agentfast.dev/v1alpha1", "kind": "ModelConfig", "metadata": {"name": "llm"}, "spec": spec}


def _status_json(run: str, dsn: str) -> dict:
    proc = run_cli("status", run, "-o", "json", dsn=dsn)
    assert proc.returncode == 0, proc.stdout
    return json.loads(proc.stdout)


def test_a_run_on_an_endpoint_with_prices_over_max_cost_ends_failed_saying_why(tmp_path: Path, dsn: str, store: Store) -> None:
    # endless: 900 prompt + 100 completion tokens a turn; at 10 and 50 per million, 0.014 USD a turn.
    # After 2 turns 0.028 < 0.03; after 3, 0.042: the 4th is never asked.
    prices = {"promptPerMillionTokens": 10, "completionPerMillionTokens": 50}
    with ScriptedModelServer(load_script("endless")) as server:
        path = tmp_path / "capped.yaml"
        run = _agentrun("capped", {"name": "scripted-endless", "config": "llm"}, {"max_cost": 0.03, "classifier": "none"})
        path.write_text(yaml.safe_dump_all([_modelconfig(server.base_url, prices), run]))
        proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
        assert proc.returncode == ExitCode.FAILED, proc.stdout
        assert len(server.requests) == 3
    reason = "budget exceeded: max_cost is 0.03 USD and the run has cost 0.042 USD (2700 prompt and 300 completion tokens)"
    assert reason in proc.stdout
    ctx = store.load_context("default/capped")[0]
    assert (ctx.status.phase, ctx.status.reason, ctx.status.message) == ("Failed", "BudgetExceeded", reason)
    assert ctx.prices is not None and ctx.prices.promptPerMillionTokens == 10 and ctx.budget.max_cost == 0.03
    doc = _status_json("capped", dsn)
    assert doc["cost"]["amount"] == pytest.approx(0.042) and doc["cost"]["currency"] == "USD"
    assert doc["cost"]["max_cost"] == 0.03 and doc["modelConfig"]["prices"]["promptPerMillionTokens"] == 10
    assert doc["usage"]["prompt_tokens"] == 2700 and doc["usage"]["total_tokens"] == 3000


def test_a_scripted_run_with_prices_under_max_cost_succeeds_and_status_shows_its_cost(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    script = tmp_path / "short.yaml"
    script.write_text(
        yaml.safe_dump(
            {
                "model": "scripted-short",
                "turns": [
                    {
                        "tool_calls": [{"id": "c1", "name": "echo", "arguments": {"text": "hi"}}],
                        "usage": {"prompt_tokens": 1000, "completion_tokens": 200},
                    },
                    {"content": "done", "usage": {"prompt_tokens": 1500, "completion_tokens": 100}},
                ],
            }
        )
    )
    # 2500 prompt tokens at 2 and 300 completion tokens at 8 per million: 0.0074 EUR
    prices = {"promptPerMillionTokens": 2, "completionPerMillionTokens": 8, "currency": "EUR"}
    path = tmp_path / "under.yaml"
    model = {"name": "scripted-short", "script": str(script), "prices": prices}
    path.write_text(yaml.safe_dump(_agentrun("under", model, {"max_cost": 0.01, "classifier": "none"})))
    proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
    assert proc.returncode == ExitCode.OK, proc.stdout
    assert store.load_context("default/under")[0].status.phase == "Succeeded"
    doc = _status_json("under", dsn)
    assert doc["cost"]["amount"] == pytest.approx(0.0074) and doc["cost"]["currency"] == "EUR"
    assert doc["cost"]["max_cost"] == 0.01 and doc["cost"]["prices"]["completionPerMillionTokens"] == 8
    assert doc["usage"] == {
        "prompt_tokens": 2500,
        "completion_tokens": 300,
        "total_tokens": 2800,
        "duration_ms": doc["usage"]["duration_ms"],
        "lost_replies": 0,  # no reply was lost to a crash
    }
    assert doc["budget"]["applied"]["max_cost"] == 0.01
    text = run_cli("status", "under", dsn=dsn)
    assert text.returncode == 0, text.stdout
    assert "0.0074 EUR of max_cost 0.01 EUR" in text.stdout, text.stdout


def test_a_cost_limit_on_a_model_without_prices_is_refused_before_anything_runs(tmp_path: Path, dsn: str, store: Store) -> None:
    with ScriptedModelServer(load_script("endless")) as server:
        path = tmp_path / "unpriced.yaml"
        run = _agentrun("unpriced", {"name": "scripted-endless", "config": "llm"}, {"max_cost": 1})
        path.write_text(yaml.safe_dump_all([_modelconfig(server.base_url, None), run]))
        proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
        assert len(server.requests) == 0
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stdout
    assert "spec.budget.max_cost: ModelConfig 'llm' has no prices" in proc.stdout and "Traceback" not in proc.stdout
    path = tmp_path / "scripted.yaml"
    path.write_text(yaml.safe_dump(_agentrun("scripted", {"name": "m", "script": "endless"}, {"max_cost": 1})))
    proc = run_cli("run", str(path), "--no-wait", dsn=dsn, timeout=90)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stdout
    assert "spec.budget.max_cost: the scripted model has no prices" in proc.stdout
    assert [r.run_id for r, _ in store.list_runs()] == []
