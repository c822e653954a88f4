"""The checkpoint model: round trips, upgrades from the pre-release shape, and forward safety."""

from __future__ import annotations

import copy
import json

import pytest
from pydantic import ValidationError

from agentfast.runner.snapshot import (
    SCHEMA_VERSION,
    AwaitedCall,
    Budget,
    Classification,
    Message,
    PendingToolCall,
    RunContext,
    Session,
    StateSnapshot,
    ToolCall,
    ToolResult,
    call_id,
    idempotency_key,
    upgrade_snapshot_dict,
)

UID = "3f1c0a4e-0000-4000-8000-00000000beef"


def _result(position: int, name: str, content: str, *, error_kind=None) -> ToolResult:
    return ToolResult(
        call_id=call_id(2, position),
        position=position,
        tool_call_id="call_1",
        tool_name=name,
        content=content,
        is_error=error_kind is not None,
        error_kind=error_kind,
        idempotency_key=idempotency_key(UID, 2, position),
    )


def full_snapshot() -> StateSnapshot:
    """A paused run: a gated refund at position 0, two siblings already executed."""
    refund = ToolCall(id="call_1", name="issue_refund", arguments='{"order_id": "A-1042", "amount_cents": 4999}')
    note = ToolCall(id="call_2", name="add_case_note", arguments='{"order_id": "A-1042", "note": "dup ✓"}')
    broken = ToolCall(id="call_3", name="lookup_order", arguments='{"order_id": ')
    declared = Budget(max_iterations=10, max_tokens=20_000, max_duration_ms=120_000)
    ctx = RunContext(
        session=Session(run_uid=UID, adapter="vanilla", model="scripted-refund", started_at=1_700_000_000_000),
        budget=Budget(max_iterations=6, max_tokens=8_000, max_duration_ms=60_000),
        classification=Classification(
            classifier="heuristic",
            label="simple",
            reason="15 words and 3 tools",
            declared=declared,
            applied=Budget(max_iterations=6, max_tokens=8_000, max_duration_ms=60_000),
        ),
    )
    ctx.counters.iterations = 1
    ctx.counters.model_calls = 2
    ctx.counters.tool_calls = 2
    ctx.counters.malformed_tool_calls = 1
    ctx.counters.approvals_requested = 1
    ctx.usage.prompt_tokens, ctx.usage.completion_tokens, ctx.usage.total_tokens = 473, 89, 562
    ctx.status.phase = "WaitingForApproval"
    ctx.status.reason = "AwaitingApproval"
    ctx.turns_accounted = 2
    messages = [
        Message(role="system", content="You are a support agent."),
        Message(role="user", content="Refund order A-1042 — merci 🙏"),
        Message(role="assistant", tool_calls=[ToolCall(id="call_1", name="lookup_order", arguments='{"order_id": "A-1042"}')]),
        Message(role="tool", content='{"order_id": "A-1042"}', tool_call_id="call_1", name="lookup_order"),
    ]
    pending = PendingToolCall(
        call_id="call-2-0",
        iteration=2,
        position=0,
        tool_call=refund,
        idempotency_key=idempotency_key(UID, 2, 0),
        executed_sibling_results=[
            _result(1, "add_case_note", '{"ok": true}'),
            _result(2, "lookup_order", "error: arguments are not valid JSON", error_kind="malformed"),
        ],
        requested_at=1_700_000_001_000,
    )
    assert note and broken  # the batch the pending call belongs to
    return StateSnapshot(
        run_id="default/refund-demo",
        context=ctx,
        messages=messages,
        sdk_state={"checkpoint": {"v": 4, "channel_values": {"x": [1, 2, {"y": None}]}}},
        pending=pending,
        saved_at=1_700_000_002_000,
    )


def test_round_trip_python_and_json() -> None:
    snap = full_snapshot()
    again = StateSnapshot.model_validate(snap.model_dump())
    assert again == snap
    as_json = snap.model_dump_json()
    from_json = StateSnapshot.model_validate_json(as_json)
    assert from_json == snap
    # through plain json (what jsonb hands back), not only pydantic's own JSON path
    via_json = StateSnapshot.model_validate(json.loads(json.dumps(snap.model_dump(mode="json"))))
    assert via_json == snap
    assert via_json.pending.executed_sibling_results[1].error_kind == "malformed"
    assert [r.position for r in via_json.pending.executed_sibling_results] == [1, 2]
    assert via_json.messages[1].content == "Refund order A-1042 — merci 🙏"
    assert via_json.schema_version == SCHEMA_VERSION


def test_round_trip_without_pending() -> None:
    snap = full_snapshot()
    snap.pending = None
    again = StateSnapshot.model_validate_json(snap.model_dump_json())
    assert again.pending is None and again == snap


def test_tool_result_to_message_keeps_the_provider_id() -> None:
    r = _result(1, "add_case_note", '{"ok": true}')
    m = r.to_message()
    assert (m.role, m.tool_call_id, m.name, m.content) == ("tool", "call_1", "add_case_note", '{"ok": true}')
    assert m.to_openai() == {"role": "tool", "content": '{"ok": true}', "tool_call_id": "call_1"}


def v0_dict() -> dict:
    """The pre-release shape: no schema_version, budget at the top, ``pending.sibling_results``."""
    new = full_snapshot().model_dump(mode="json")
    old = copy.deepcopy(new)
    old.pop("schema_version")
    old["budget"] = old["context"].pop("budget")
    old["pending"]["sibling_results"] = old["pending"].pop("executed_sibling_results")
    return old


def test_v0_snapshot_loads_via_upgrade() -> None:
    old = v0_dict()
    frozen = copy.deepcopy(old)
    snap = StateSnapshot.model_validate(old)
    assert old == frozen, "upgrading must not mutate the caller's dict"
    assert snap.schema_version == SCHEMA_VERSION
    assert snap.context.budget == Budget(max_iterations=6, max_tokens=8_000, max_duration_ms=60_000)
    assert [r.tool_name for r in snap.pending.executed_sibling_results] == ["add_case_note", "lookup_order"]
    assert snap == full_snapshot()
    # the old names are gone, not kept as extras next to the new ones
    dumped = snap.model_dump()
    assert "budget" not in dumped and "sibling_results" not in dumped["pending"]


def test_v0_without_pending_or_budget_loads() -> None:
    old = v0_dict()
    old["pending"] = None
    old.pop("budget")
    snap = StateSnapshot.model_validate(old)
    assert snap.pending is None
    assert snap.context.budget == Budget()  # the defaults


def test_explicit_version_0_is_upgraded_too() -> None:
    old = v0_dict()
    old["schema_version"] = 0
    assert StateSnapshot.model_validate(old).context.budget.max_iterations == 6


def test_newer_schema_version_is_refused() -> None:
    newer = full_snapshot().model_dump(mode="json")
    newer["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ValidationError) as err:
        StateSnapshot.model_validate(newer)
    assert f"schema_version {SCHEMA_VERSION + 1} is newer" in str(err.value)
    with pytest.raises(ValueError):
        upgrade_snapshot_dict(newer)


def test_unknown_keys_survive_a_round_trip() -> None:
    data = full_snapshot().model_dump(mode="json")
    data["future_top"] = {"a": [1, 2]}
    data["context"]["future_ctx"] = "kept"
    data["context"]["counters"]["future_counter"] = 7
    data["pending"]["future_pending"] = True
    data["pending"]["executed_sibling_results"][0]["future_result"] = "r"
    data["messages"][2]["tool_calls"][0]["future_call"] = {"x": None}
    data["messages"][0]["future_message"] = "m"
    snap = StateSnapshot.model_validate(data)
    out = json.loads(snap.model_dump_json())
    assert out["future_top"] == {"a": [1, 2]}
    assert out["context"]["future_ctx"] == "kept"
    assert out["context"]["counters"]["future_counter"] == 7
    assert out["pending"]["future_pending"] is True
    assert out["pending"]["executed_sibling_results"][0]["future_result"] == "r"
    assert out["messages"][2]["tool_calls"][0]["future_call"] == {"x": None}
    assert out["messages"][0]["future_message"] == "m"
    # and a second trip changes nothing
    assert json.loads(StateSnapshot.model_validate(out).model_dump_json()) == out


def test_ids_are_unique_per_iteration_and_position() -> None:
    keys = {idempotency_key(UID, it, pos) for it in range(1, 20) for pos in range(5)}
    ids = {call_id(it, pos) for it in range(1, 20) for pos in range(5)}
    assert len(keys) == len(ids) == 95
    # iteration 1 position 12 and iteration 11 position 2 must not collide
    assert idempotency_key(UID, 1, 12) != idempotency_key(UID, 11, 2)
    assert call_id(1, 12) != call_id(11, 2)


@pytest.mark.parametrize("field", ["max_iterations", "max_tokens", "max_duration_ms"])
def test_budget_limits_must_be_positive(field: str) -> None:
    with pytest.raises(ValidationError):
        Budget(**{field: 0})


def test_bad_phase_is_refused() -> None:
    data = full_snapshot().model_dump(mode="json")
    data["context"]["status"]["phase"] = "Sleeping"
    with pytest.raises(ValidationError):
        StateSnapshot.model_validate(data)


# -- schema 2: every awaited call of a batch ---------------------------------------------------------


def _awaited(position: int, name: str, call: str | None = None) -> AwaitedCall:
    return AwaitedCall(
        call_id=call or call_id(2, position),
        iteration=2,
        position=position,
        tool_call=ToolCall(id=f"call_{position}", name=name, arguments="{}"),
        idempotency_key=idempotency_key(UID, 2, position),
        requested_at=1_700_000_001_000,
    )


def test_a_pending_batch_lists_every_awaited_call() -> None:
    calls = [_awaited(0, "freeze_card"), _awaited(2, "refund_charge", "call-2-2-rerun1")]
    pending = PendingToolCall.of(calls, [_result(1, "add_case_note", '{"ok": true}')])
    assert pending.call_ids == ["call-2-0", "call-2-2-rerun1"]
    assert pending.call_id == "call-2-0" and pending.tool_call.name == "freeze_card"  # the seed's single call: the first
    snap = full_snapshot()
    snap.pending = pending
    again = StateSnapshot.model_validate(json.loads(json.dumps(snap.model_dump(mode="json"))))
    assert again.pending == pending and again.pending.awaiting[1].call_id == "call-2-2-rerun1"
    with pytest.raises(ValueError):
        PendingToolCall.of([], [])


def test_v1_pending_loads_as_one_awaited_call() -> None:
    """Schema 1 paused on one call at a time and had no ``awaiting``: it awaited its own call."""
    old = full_snapshot().model_dump(mode="json")
    old["schema_version"] = 1
    old["pending"].pop("awaiting")
    kept = copy.deepcopy(old)
    snap = StateSnapshot.model_validate(old)
    assert old == kept  # validating does not rewrite the caller's dict
    assert snap.schema_version == SCHEMA_VERSION == 2
    assert snap.pending.call_ids == ["call-2-0"]
    assert (
        snap.pending.awaiting[0].tool_call.name == "issue_refund" and snap.pending.awaiting[0].requested_at == 1_700_000_001_000
    )
    # The store's cheap path (load_context) validates a pending record alone: same answer.
    assert PendingToolCall.model_validate(kept["pending"]) == snap.pending
