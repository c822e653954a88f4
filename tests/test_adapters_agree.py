"""Both adapters play the same refund conversation and must leave the same transcript.

Beyond the conformance suite (each adapter equal to itself across kills), this pins the two
adapters to each other: same messages in the same order, same iterations, same token usage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentfast.runner.store import Store

from .conformance import LANGGRAPH, VANILLA, Adapter, agentrun_file, invocations, refunds, spawn_cli, wait_for_approval_request

pytestmark = pytest.mark.process  # every test here starts real OS processes (tests/conftest.py: tiers)


def run_to_end(tmp_path: Path, store: Store, dsn: str, adapter: Adapter, decision: str) -> object:
    # Distinct uids: a run's uid is unique, and the idempotency keys (so the transcripts) embed it.
    uid = "00000000-0000-4000-8000-00000000000" + ("1" if adapter is VANILLA else "2")
    proc = spawn_cli("run", str(agentrun_file(tmp_path, adapter.example, uid=uid)), dsn=dsn)
    call = wait_for_approval_request(store, adapter.run_id)
    store.decide(adapter.run_id, call, decision, reason="over the refund limit" if decision == "deny" else None)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return store.load_snapshot(adapter.run_id)


def test_both_adapters_leave_the_same_transcript(tmp_path: Path, store: Store, dsn: str) -> None:
    vanilla = run_to_end(tmp_path, store, dsn, VANILLA, "approve")
    langgraph = run_to_end(tmp_path, store, dsn, LANGGRAPH, "approve")

    def same(m: object) -> dict:  # the refund id embeds the run uid, which differs by design
        d = m.model_dump()
        if d.get("content"):
            d["content"] = d["content"].replace("00000000-0000-4000-8000-000000000002", "00000000-0000-4000-8000-000000000001")
        return d

    assert [same(m) for m in vanilla.messages] == [same(m) for m in langgraph.messages]
    assert vanilla.context.counters.iterations == langgraph.context.counters.iterations == 3
    assert vanilla.context.usage.total_tokens == langgraph.context.usage.total_tokens > 0
    assert vanilla.context.session.adapter == "vanilla" and langgraph.context.session.adapter == "langgraph"
    # LangGraph's own state travels as an opaque sdk_state; the vanilla loop has none.
    assert vanilla.sdk_state == {} and langgraph.sdk_state.get("format", "").startswith("agentfast.langgraph")
    assert refunds(dsn) == 2 and invocations(dsn, "add_case_note") == 2  # one per run


def test_a_denial_reaches_the_model_in_both_adapters(tmp_path: Path, store: Store, dsn: str) -> None:
    for adapter in (VANILLA, LANGGRAPH):
        snap = run_to_end(tmp_path, store, dsn, adapter, "deny")
        refund_result = [m for m in snap.messages if m.role == "tool" and m.name == "issue_refund"]
        assert len(refund_result) == 1
        assert refund_result[0].content.startswith("denied:") and "over the refund limit" in refund_result[0].content
        assert snap.context.status.phase == "Succeeded"
    assert refunds(dsn) == 0


def test_the_registry_has_the_adapter_of_every_spec_adapter_value() -> None:
    """The CLI picks the adapter class by ``spec.adapter`` from the registry: every value the spec
    admits names one, and that class records the same value in the run's session."""
    from typing import get_args

    from agentfast.runner.adapters import ADAPTERS, adapter_class
    from agentfast.runner.spec import AgentRunSpec

    values = set(get_args(AgentRunSpec.model_fields["adapter"].annotation))
    assert set(ADAPTERS) == values == {"vanilla", "langgraph"}
    for name in sorted(values):
        assert adapter_class(name).adapter == name
