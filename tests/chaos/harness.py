"""The chaos harness: many scripted runs, killed with SIGKILL at random points, resumed, and
compared with an uninterrupted run of the same scenario.

What one chaos run does (:class:`ChaosRun`), with its own ``random.Random`` seeded from the
session seed and the run's index, so a schedule is reproducible:

1. Start ``agentfast run FILE`` as a real OS process (``spawn_cli``), against real Postgres, with
   the scripted model over real HTTP.
2. Before each process, pick how it dies: a named fault point (``AGENTFAST_FAULT=point[:tool]@n``,
   ``runner/faults.py``: the process SIGKILLs itself the n-th time it gets there), an external
   SIGKILL at a random time after the process took the lease, or nothing (it runs on).
3. Act as the human: approve gated calls as they appear (after a random delay, sometimes while the
   runner waits, sometimes while no runner is alive). A non-idempotent call that was in flight
   when a runner died comes back as ``call-I-P-rerunN``: the human checks the tool's outbox and
   approves the re-run if the effect is absent, denies it if the effect is there.
4. ``agentfast resume`` in a new process, again and again, until the run has Succeeded.
5. Compare with the scenario's reference (one uninterrupted process): transcript, iterations,
   tokens, and the side-effect ledger the tools wrote (rows keyed by idempotency key; every
   execution of a tool body is logged with its key and time).

What is counted as a violation (the targets are all zero):

- **duplicated effect**: a key whose effect was applied twice (the non-idempotent outbox), or a
  call re-executed after its result was persisted (an execution logged after the journal's
  ``finished_at`` for that key), or an execution with no recorded intent (more executions of a key
  than the journal's ``attempts``);
- **lost result**: a journal row of the run not ``done``, or an effect of the reference missing;
- **unexpected effect**: an effect the reference does not have;
- **diverged transcript**: messages, iterations or tokens differ from the reference (a denied
  re-run of a call whose effect already happened is the one allowed difference: its tool message
  must then say ``denied: ...``);
- **unexpected exit**: a runner that exits with a code other than 0, 3 (Postgres unreachable at
  start: retriable, counted apart) or 75 (or 76 in the zombie test), an unexplained SIGKILL, a
  process that hangs, or a run not finished after 80 processes.

Re-executions of an in-flight idempotent call with the same key are allowed (G4) and reported.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml

from agentfast.runner.store import Store

from ..helpers import EXAMPLES, spawn_cli

FAULT_POINTS = (
    "tool.before_call",
    "tool.after_call",
    "tool.after_persist",
    "checkpoint.before_commit",
    "checkpoint.after_commit",
    "approval.waiting",
)
TOOL_POINTS = FAULT_POINTS[:3]

CHAOS_TOOLS = [
    {"name": "chaos_read", "ref": "agentfast.testing.chaos_tools:chaos_read"},
    {"name": "chaos_write", "ref": "agentfast.testing.chaos_tools:chaos_write"},
    {"name": "chaos_pay", "ref": "agentfast.testing.chaos_tools:chaos_pay"},
    {"name": "chaos_notify", "ref": "agentfast.testing.chaos_tools:chaos_notify"},
]
# Room for the long script and for Postgres outages (active time counts retries).
CHAOS_BUDGET = {"max_iterations": 30, "max_tokens": 200_000, "max_duration_ms": 900_000, "classifier": "none"}
CHAOS_INPUT = "Restock the items that are low, pay the two suppliers, and tell ops and the customer."


# -- scenarios ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """An AgentRun to torture: an adapter's example file, optionally with the chaos script and tools.

    ``ledger``: which tables the tools write ("demo": runner/examples/refund.py; "chaos":
    testing/chaos_tools.py).
    """

    name: str
    adapter: str
    example: str
    script: str | None = None
    ledger: str = "demo"
    max_kills: tuple[int, int] = (3, 8)

    @property
    def tools(self) -> list[str]:
        if self.ledger == "chaos":
            return [t["name"] for t in CHAOS_TOOLS]
        return ["lookup_order", "issue_refund", "add_case_note"]

    def manifest(self, directory: Path, run_name: str, uid: str) -> Path:
        doc = yaml.safe_load((EXAMPLES / self.example).read_text())
        doc["metadata"]["name"] = run_name
        doc["metadata"]["uid"] = uid
        spec = doc["spec"]
        if self.script:
            spec["model"]["name"] = f"scripted-{self.script}"
            spec["model"]["script"] = self.script
            spec["input"] = CHAOS_INPUT
            spec["tools"] = CHAOS_TOOLS
            spec["budget"] = dict(CHAOS_BUDGET)
        path = directory / f"{run_name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path


VANILLA_REFUND = Scenario("vanilla-refund", "vanilla", "refund.yaml", max_kills=(3, 8))
LANGGRAPH_REFUND = Scenario("langgraph-refund", "langgraph", "refund-langgraph.yaml", max_kills=(3, 8))
VANILLA_BATCH = Scenario("vanilla-chaos_batch", "vanilla", "refund.yaml", "chaos_batch", "chaos", (5, 14))
LANGGRAPH_BATCH = Scenario("langgraph-chaos_batch", "langgraph", "refund-langgraph.yaml", "chaos_batch", "chaos", (5, 14))
VANILLA_LONG = Scenario("vanilla-chaos_long", "vanilla", "refund.yaml", "chaos_long", "chaos", (6, 16))
LANGGRAPH_LONG = Scenario("langgraph-chaos_long", "langgraph", "refund-langgraph.yaml", "chaos_long", "chaos", (6, 16))
KILL_SCENARIOS = (VANILLA_REFUND, LANGGRAPH_REFUND, VANILLA_BATCH, LANGGRAPH_BATCH)


# -- configuration ------------------------------------------------------------------------------


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def session_seed() -> int:
    """``AGENTFAST_CHAOS_SEED`` or a fresh one; the tests print it so a failure can be replayed."""
    value = os.environ.get("AGENTFAST_CHAOS_SEED")
    return int(value) if value else random.SystemRandom().randrange(1, 2**31)


def large_run() -> bool:
    """True under hack/chaos.sh (``AGENTFAST_CHAOS_KILLS`` set): every test scales up."""
    return bool(os.environ.get("AGENTFAST_CHAOS_KILLS"))


# -- databases ----------------------------------------------------------------------------------


def create_database(pg_server: Any, prefix: str, **options: str) -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    extra = "".join(f" {k} {v}" for k, v in options.items())
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{extra}')
    return name


def drop_database(pg_server: Any, name: str) -> None:
    for _ in range(30):  # the server may be restarting under a test that just finished
        try:
            with psycopg.connect(pg_server.admin_dsn, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        except psycopg.OperationalError:
            time.sleep(1)


class Db:
    """A small autocommit connection for the harness's reads, reopened when Postgres went away."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self._conn: psycopg.Connection | None = None

    def query(self, sql: str, *params: object, retry_for_s: float = 120.0) -> list[tuple]:
        deadline = time.monotonic() + retry_for_s
        while True:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                try:
                    return self._conn.execute(sql, params).fetchall()
                except psycopg.errors.UndefinedTable:
                    return []
            except psycopg.OperationalError as err:
                if err.sqlstate and not err.sqlstate.startswith(("08", "57P")):
                    raise  # a server-side refusal (e.g. disk full), not a lost connection
                self.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None


# -- observing a run ----------------------------------------------------------------------------


@dataclass
class RunState:
    """What the harness sees of a run between two polls."""

    epoch: int | None
    phase: str | None
    pending_id: str | None
    pending_reason: str | None
    pending_key: str | None


def poll_state(db: Db, run_id: str) -> RunState:
    rows = db.query(
        """SELECT r.epoch, c.phase, c.pending->>'call_id', c.pending->>'reason', c.pending->>'idempotency_key'
           FROM agentfast_runs r LEFT JOIN LATERAL (
               SELECT phase, pending FROM agentfast_checkpoints c WHERE c.run_id = r.run_id
               ORDER BY checkpoint_id DESC LIMIT 1) c ON true
           WHERE r.run_id = %s""",
        run_id,
    )
    if not rows:
        return RunState(None, None, None, None, None)
    return RunState(*rows[0])


def effects(db: Db, ledger: str, uid: str) -> list[tuple[str, str, str]]:
    """Every effect the run's tools applied: (tool, idempotency key, payload), one per applied row."""
    like = f"{uid}:%"
    if ledger == "demo":
        rows = [
            ("issue_refund", k, json.dumps([o, a, r]))
            for k, o, a, r in db.query(
                "SELECT idempotency_key, order_id, amount_cents, reason FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key LIKE %s",
                like,
            )
        ]
        rows += [
            ("add_case_note", k, json.dumps([o, n]))
            for k, o, n in db.query(
                "SELECT idempotency_key, order_id, note FROM agentfast_examples.demo_case_notes WHERE idempotency_key LIKE %s",
                like,
            )
        ]
        return rows
    rows = [
        (t, k, json.dumps(p, sort_keys=True))
        for t, k, p in db.query(
            "SELECT tool, idempotency_key, payload FROM agentfast_examples.chaos_ledger WHERE idempotency_key LIKE %s", like
        )
    ]
    rows += [
        (t, k, json.dumps(p, sort_keys=True))
        for t, k, p in db.query(
            "SELECT tool, idempotency_key, payload FROM agentfast_examples.chaos_outbox WHERE idempotency_key LIKE %s", like
        )
    ]
    return rows


def invocations(db: Db, ledger: str, uid: str) -> list[tuple[str, str, Any, int | None]]:
    """Every execution of a tool body: (tool, idempotency key, when, fencing epoch if logged)."""
    like = f"{uid}:%"
    if ledger == "demo":
        return [
            (t, k, at, None)
            for t, k, at in db.query(
                "SELECT tool, idempotency_key, at FROM agentfast_examples.demo_tool_invocations WHERE idempotency_key LIKE %s",
                like,
            )
        ]
    return list(
        db.query(
            "SELECT tool, idempotency_key, at, epoch FROM agentfast_examples.chaos_invocations WHERE idempotency_key LIKE %s",
            like,
        )
    )


def outbox_has(db: Db, ledger: str, key: str) -> bool:
    """Whether the non-idempotent effect of the call with this key was applied (the human's check)."""
    if ledger == "demo":
        return bool(db.query("SELECT 1 FROM agentfast_examples.demo_case_notes WHERE idempotency_key = %s", key)) or bool(
            db.query("SELECT 1 FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key = %s", key)
        )
    return bool(db.query("SELECT 1 FROM agentfast_examples.chaos_outbox WHERE idempotency_key = %s", key))


def _norm(obj: Any, uid: str) -> Any:
    return json.loads(json.dumps(obj).replace(uid, "<uid>"))


def _tool_message_index(messages: list[dict], iteration: int, position: int) -> int | None:
    seen = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            seen += 1
            if seen == iteration:
                return i + 1 + position
    return None


@dataclass
class EndState:
    """A finished run, normalized (its uid replaced) so two runs compare."""

    phase: str
    pending: bool
    iterations: int
    total_tokens: int
    messages: list[dict]
    effects: Counter
    journal: list[dict]
    invocations: list[tuple]
    uid: str


def end_state(store: Store, db: Db, run_id: str, uid: str, ledger: str) -> EndState:
    snap = store.load_snapshot(run_id)
    assert snap is not None, f"{run_id} has no checkpoint"
    journal = [
        {
            "call_id": c,
            "key": k,
            "tool": t,
            "state": s,
            "attempts": a,
            "finished_at": f,
            "idempotent": i,
            "it": it,
            "pos": p,
            "gated": g,
        }
        for c, k, t, s, a, f, i, it, p, g in db.query(
            """SELECT call_id, idempotency_key, tool_name, state, attempts, finished_at, idempotent, iteration, position, gated
               FROM agentfast_tool_calls WHERE run_id = %s ORDER BY iteration, position""",
            run_id,
        )
    ]
    return EndState(
        phase=snap.context.status.phase,
        pending=snap.pending is not None,
        iterations=snap.context.counters.iterations,
        total_tokens=snap.context.usage.total_tokens,
        messages=_norm([m.model_dump(mode="json") for m in snap.messages], uid),
        effects=Counter((t, k.replace(uid, "<uid>"), p) for t, k, p in effects(db, ledger, uid)),
        journal=journal,
        invocations=invocations(db, ledger, uid),
        uid=uid,
    )


@dataclass
class Verdict:
    """How a chaos run's end state compares with the reference's."""

    duplicated_effects: int = 0
    lost_results: int = 0
    unexpected_effects: int = 0
    diverged: int = 0
    same_key_reruns: int = 0
    problems: list[str] = field(default_factory=list)


def compare(
    ref: EndState, got: EndState, denied_reruns: set[tuple[int, int]], *, frozen_in_flight: tuple[int, set[str]] | None = None
) -> Verdict:
    """``frozen_in_flight``: a zombie's epoch and the idempotency keys of the calls whose intent it
    had committed when it froze (tests/chaos/test_zombie.py). Such a call may start after the
    zombie thaws, even after its successor persisted the call's result: the zombie is inside that
    call (its intent is durable), and only the tool's idempotency key or fencing token keeps the
    effect single, which the effect checks below still verify. Any other late start is a re-run."""
    v = Verdict()
    zombie_epoch, zombie_keys = frozen_in_flight or (None, set())
    # Duplicated effects: a key applied twice (only the non-idempotent outbox can hold two rows).
    for (tool, key, _), n in got.effects.items():
        if n > 1:
            v.duplicated_effects += n - 1
            v.problems.append(f"effect of {tool} {key} applied {n} times")
    by_key = {j["key"]: j for j in got.journal}
    runs_per_key = Counter(k for _, k, _, _ in got.invocations)
    for tool, key, at, epoch in got.invocations:
        j = by_key.get(key)
        if j is None:
            v.duplicated_effects += 1
            v.problems.append(f"{tool} ran with key {key}, which is in no journal row")
        elif j["finished_at"] is not None and at > j["finished_at"] and not (epoch == zombie_epoch and key in zombie_keys):
            v.duplicated_effects += 1
            v.problems.append(f"{j['call_id']} {tool} ran again after its result was persisted")
    for key, n in runs_per_key.items():
        j = by_key.get(key)
        if j is None:
            continue
        if n > j["attempts"]:
            v.duplicated_effects += n - j["attempts"]
            v.problems.append(f"{j['call_id']} ran {n} times but its intent was recorded {j['attempts']} times")
        if n > 1 and j["idempotent"]:
            v.same_key_reruns += n - 1
    # Lost results: every call finished; every effect of the reference present.
    for j in got.journal:
        if j["state"] != "done":
            v.lost_results += 1
            v.problems.append(f"{j['call_id']} {j['tool']} ended {j['state']}, not done")
    for eff, n in ref.effects.items():
        if got.effects.get(eff, 0) < n:
            v.lost_results += 1
            v.problems.append(f"missing effect {eff}")
    for eff in got.effects:
        if eff not in ref.effects:
            v.unexpected_effects += 1
            v.problems.append(f"unexpected effect {eff}")
    # The transcript, iterations and tokens.
    if got.phase != "Succeeded" or got.pending:
        v.diverged += 1
        v.problems.append(f"ended {got.phase} (pending: {got.pending})")
    expected = json.loads(json.dumps(ref.messages))
    actual = json.loads(json.dumps(got.messages))
    for it, pos in denied_reruns:
        i = _tool_message_index(actual, it, pos)
        if i is None or i >= len(actual) or not (actual[i].get("content") or "").startswith("denied:"):
            v.diverged += 1
            v.problems.append(f"call-{it}-{pos}: a denied re-run whose tool message is not a denial")
            continue
        actual[i]["content"] = expected[i]["content"] = "<denied re-run>"
    if actual != expected:
        v.diverged += 1
        for i, (a, b) in enumerate(zip(actual, expected)):
            if a != b:
                v.problems.append(f"transcript differs at message {i}: got {a!r}, reference {b!r}")
                break
        else:
            v.problems.append(f"transcript has {len(actual)} messages, reference {len(expected)}")
    elif got.iterations != ref.iterations or got.total_tokens != ref.total_tokens:
        v.diverged += 1
        v.problems.append(f"iterations/tokens {got.iterations}/{got.total_tokens}, reference {ref.iterations}/{ref.total_tokens}")
    return v


# -- statistics ---------------------------------------------------------------------------------

COUNTERS = (
    "runs",
    "processes",
    "kills",
    "kills_fault",
    "kills_external",
    "faults_not_reached",
    "external_not_landed",
    "resumes",
    "retry_exits",
    "start_failures",
    "approvals",
    "reruns_approved",
    "reruns_denied",
    "same_key_reruns",
    "duplicated_effects",
    "lost_results",
    "unexpected_effects",
    "diverged_transcripts",
    "unexpected_exits",
)
VIOLATIONS = ("duplicated_effects", "lost_results", "unexpected_effects", "diverged_transcripts", "unexpected_exits")


class Stats:
    """Counters per scenario, kills per fault point, and the problems found (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_scenario: dict[str, Counter] = {}
        self.points: Counter = Counter()
        self.problems: list[str] = []

    def add(self, scenario: str, **counts: int) -> None:
        with self.lock:
            c = self.by_scenario.setdefault(scenario, Counter())
            c.update({k: v for k, v in counts.items() if v})

    def point(self, name: str) -> None:
        with self.lock:
            self.points[name] += 1

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)

    def total(self) -> Counter:
        with self.lock:
            out: Counter = Counter()
            for c in self.by_scenario.values():
                out.update(c)
            return out

    def violations(self) -> int:
        t = self.total()
        return sum(t[k] for k in VIOLATIONS)

    def as_dict(self) -> dict:
        with self.lock:
            return {
                "scenarios": {s: {k: c.get(k, 0) for k in COUNTERS} for s, c in self.by_scenario.items()},
                "points": dict(self.points),
                "problems": list(self.problems),
            }

    def summary(self) -> str:
        t = self.total()
        lines = [f"{'scenario':<24}" + "".join(f"{k[:10]:>11}" for k in COUNTERS)]
        with self.lock:
            for s, c in sorted(self.by_scenario.items()):
                lines.append(f"{s:<24}" + "".join(f"{c.get(k, 0):>11}" for k in COUNTERS))
        lines.append(f"{'total':<24}" + "".join(f"{t.get(k, 0):>11}" for k in COUNTERS))
        lines.append("kills by point: " + ", ".join(f"{p}={n}" for p, n in sorted(self.points.items())))
        return "\n".join(lines)


# -- one chaos run ------------------------------------------------------------------------------


@dataclass
class Reference:
    scenario: Scenario
    state: EndState
    active_s: float  # wall time of the uninterrupted process, minus time waiting for the human
    commits: int  # checkpoints it committed (LangGraph commits per superstep, the vanilla loop per iteration)


@dataclass
class Exit:
    code: int | None
    killed_by: str | None  # "fault", "external" or None
    output: str
    leased: bool


class ChaosRun:
    """Drives one run through kills and resumes to the end. See the module docstring."""

    PROCESS_TIMEOUT_S = 120.0
    MAX_PROCESSES = 80

    def __init__(
        self,
        scenario: Scenario,
        *,
        dsn: str,
        store: Store,
        directory: Path,
        rng: random.Random,
        stats: Stats | None,
        kills: int,
        reference: Reference | None = None,
        label: str = "",
        on_tick: Callable[[ChaosRun, subprocess.Popen], None] | None = None,
        allowed_exits: tuple[int, ...] = (0, 75),
    ) -> None:
        self.scenario = scenario
        self.dsn = dsn
        self.store = store
        self.db = Db(dsn)
        self.rng = rng
        self.stats = stats
        self.kill_budget = kills
        self.reference = reference
        self.immediate_human = reference is None  # the reference run's human decides at once
        self.label = label or scenario.name
        self.uid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        self.run_name = f"chaos-{scenario.name.replace('_', '-')}-{self.uid[:8]}"
        self.run_id = f"default/{self.run_name}"
        self.path = scenario.manifest(directory, self.run_name, self.uid)
        self.on_tick = on_tick
        self.allowed_exits = allowed_exits
        self.denied_reruns: set[tuple[int, int]] = set()
        self.counts: Counter = Counter()
        self.waited_s = 0.0
        self.active_s = 0.0
        self.log: list[str] = []
        self._decide_at: dict[str, float] = {}

    # The human.
    def _human(self, st: RunState, now: float) -> None:
        """Decide every call the run awaits a decision on (a batch can await several at once: a
        gated call and an interrupted re-run, say), each after its own random delay."""
        if st.phase != "WaitingForApproval":
            return
        for a in self.store.awaiting(self.run_id):
            self._decide(a.call_id, a.reason, a.idempotency_key, now)

    def _decide(self, call_id: str, reason: str, key: str, now: float) -> None:
        if self.immediate_human:
            self._decide_at.setdefault(call_id, now)
        if call_id not in self._decide_at:
            # Sometimes at once, sometimes after the runner settled into waiting (or died).
            self._decide_at[call_id] = now + self.rng.choice([0.0, self.rng.uniform(0, 0.4), self.rng.uniform(0.3, 1.2)])
            return
        if now < self._decide_at[call_id]:
            return
        if self.store.get_decision(self.run_id, call_id) is not None:
            return
        if reason == "in_flight_not_idempotent":
            it, pos = (int(x) for x in call_id.split("-")[1:3])
            if outbox_has(self.db, self.scenario.ledger, key):
                self.store.decide(
                    self.run_id, call_id, "deny", reason="the effect is already there; do not repeat it", decided_by="chaos"
                )
                self.denied_reruns.add((it, pos))
                self.counts["reruns_denied"] += 1
            else:
                self.store.decide(self.run_id, call_id, "approve", decided_by="chaos")
                self.counts["reruns_approved"] += 1
        else:
            self.store.decide(self.run_id, call_id, "approve", decided_by="chaos")
            self.counts["approvals"] += 1

    def _choose(self) -> tuple[str | None, float | None, bool]:
        """(fault spec, external kill delay after the lease, wait for approval) for the next process."""
        wait = self.immediate_human or self.rng.random() < 0.75
        if self.counts["kills"] >= self.kill_budget:
            return None, None, wait
        r = self.rng.random()
        if r < 0.7:
            wait = True  # a --no-wait process stops at the first pause, short of most points
            point = self.rng.choice(FAULT_POINTS)
            left = self._left()
            if point in TOOL_POINTS:
                spec, n = point, sum(left["tools"].values())
                if self.rng.random() < 0.5 and left["tools"]:
                    tool = self.rng.choice(sorted(left["tools"]))
                    spec, n = f"{point}:{tool}", left["tools"][tool]
            elif point == "approval.waiting":
                spec, n = point, left["gated"]
            else:
                spec, n = point, left["commits"]
            # The n-th time the point is reached, uniform over what is likely left of the run.
            return f"{spec}@{self.rng.randint(1, max(1, n))}", None, wait
        return None, self.rng.uniform(0.0, self._kill_window()), wait

    def _left(self) -> dict:
        """What the run has left to do, from the reference: calls per tool, gated calls, commits."""
        if self.reference is None:
            return {"tools": {}, "gated": 1, "commits": 1}
        done = {(e.iteration, e.position) for e in self.store.journal(self.run_id) if e.state == "done"}
        todo = [j for j in self.reference.state.journal if (j["it"], j["pos"]) not in done]
        loaded = self.store.load_context(self.run_id)
        it = loaded[0].counters.iterations if loaded else 0
        share_left = max(0.0, 1 - it / self.reference.state.iterations)
        return {
            "tools": dict(Counter(j["tool"] for j in todo)),
            "gated": sum(1 for j in todo if j["gated"]),
            # a takeover commits once, then about the reference's commits per iteration still ahead
            "commits": 1 + int(self.reference.commits * share_left),
        }

    def _kill_window(self) -> float:
        """How long after taking the lease the next process is likely still working: the
        reference's active time, scaled by the share of iterations still to do."""
        if self.reference is None:
            return 1.0
        ref = self.reference.state.iterations
        done = self.store.load_context(self.run_id)
        it = done[0].counters.iterations if done else 0
        return self.reference.active_s * max(0.2, 1 - it / ref)

    def _process(self, first: bool, fault: str | None, kill_after: float | None, wait: bool) -> Exit:
        args = ["run", str(self.path)] if first else ["resume", self.run_name]
        if not wait:
            args.append("--no-wait")
        before = 0 if first else poll_state(self.db, self.run_id).epoch
        proc = spawn_cli(*args, dsn=self.dsn, fault=fault)
        started = time.monotonic()
        leased_at: float | None = None
        killed_by: str | None = None
        waiting_since: float | None = None
        try:
            while proc.poll() is None:
                now = time.monotonic()
                st = poll_state(self.db, self.run_id)
                if leased_at is None and st.epoch is not None and st.epoch > before:
                    leased_at = now
                if st.phase == "WaitingForApproval":
                    waiting_since = waiting_since or now
                elif waiting_since is not None:
                    self.waited_s += now - waiting_since
                    waiting_since = None
                if kill_after is not None and leased_at is not None and now >= leased_at + kill_after:
                    proc.send_signal(signal.SIGKILL)
                    killed_by = "external"
                    kill_after = None
                self._human(st, now)
                if self.on_tick:
                    self.on_tick(self, proc)
                if now - started > self.PROCESS_TIMEOUT_S:
                    proc.kill()
                    out, _ = proc.communicate()
                    return Exit(None, None, f"hung for {self.PROCESS_TIMEOUT_S:.0f}s, killed:\n{out}", leased_at is not None)
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
        if waiting_since is not None:
            self.waited_s += time.monotonic() - waiting_since
        if leased_at is not None:
            self.active_s += time.monotonic() - leased_at
        out, _ = proc.communicate()
        if proc.returncode == -signal.SIGKILL and killed_by is None and fault:
            killed_by = "fault"
        return Exit(proc.returncode, killed_by, out, leased_at is not None)

    def drive(self) -> None:
        """Start, kill, resume until Succeeded. Records counts in ``self.counts``."""
        for _ in range(self.MAX_PROCESSES):
            first = self.store.get_run(self.run_id) is None  # `run FILE` until the run is registered
            st = poll_state(self.db, self.run_id)
            if not first and st.phase == "WaitingForApproval" and self.rng.random() < 0.5:
                now = time.monotonic()
                for a in self.store.awaiting(self.run_id):  # decide them all before the next process
                    self._decide_at[a.call_id] = min(self._decide_at.get(a.call_id, 0.0), now)
                self._human(st, now)
            fault, kill_after, wait = self._choose()
            ex = self._process(first, fault, kill_after, wait)
            self.counts["processes"] += 1
            if not first:
                self.counts["resumes"] += 1
            how = fault or (f"kill +{kill_after:.3f}s" if kill_after is not None else "no fault")
            self.log.append(f"{'wait' if wait else 'no-wait'} {how}: exit {ex.code} ({ex.killed_by or '-'})")
            if ex.code == -signal.SIGKILL:
                if ex.killed_by is None:
                    self.counts["unexpected_exits"] += 1
                    self._problem(f"an unexplained SIGKILL:\n{ex.output[-2000:]}")
                    continue
                self.counts["kills"] += 1
                self.counts[f"kills_{ex.killed_by}"] += 1
                if self.stats is not None:
                    self.stats.point(fault.split("@")[0].split(":")[0] if ex.killed_by == "fault" else "external (random time)")
                continue
            if fault:
                self.counts["faults_not_reached"] += 1
            if kill_after is not None:
                self.counts["external_not_landed"] += 1
            if ex.code == 3:  # Postgres unreachable at start (a loaded machine, a restart): retriable
                self.counts["start_failures"] += 1
                self.log.append(f"  3: {ex.output.strip()[-300:]}")
                continue
            if ex.code == 75:
                self.counts["retry_exits"] += 1
                last = [line for line in ex.output.splitlines() if line.strip()][-1:] or [""]
                self.log.append(f"  75: {last[0][:300]}")
                continue
            if ex.code not in self.allowed_exits:
                self.counts["unexpected_exits"] += 1
                self._problem(f"exit code {ex.code}:\n{ex.output[-3000:]}")
                continue
            st = poll_state(self.db, self.run_id)
            if st.phase == "Succeeded":
                return
            if ex.code == 0 and st.phase != "WaitingForApproval":
                self.counts["unexpected_exits"] += 1
                self._problem(f"exit 0 with the run in phase {st.phase}:\n{ex.output[-2000:]}")
        self.counts["unexpected_exits"] += 1
        self._problem(
            f"not finished after {self.MAX_PROCESSES} processes: " + " | ".join(self.log[:10] + ["..."] + self.log[-10:])
        )

    def _problem(self, text: str) -> None:
        line = f"{self.label} ({self.run_id}): {text}"
        self.log.append(line)
        if self.stats is not None:
            self.stats.problem(line)

    def verdict(self, reference: Reference) -> Verdict:
        got = end_state(self.store, self.db, self.run_id, self.uid, self.scenario.ledger)
        return compare(reference.state, got, self.denied_reruns)

    def watch(self, proc: subprocess.Popen, timeout: float = 120.0) -> str:
        """Play the human for this run until ``proc`` exits; returns its output."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            self._human(poll_state(self.db, self.run_id), time.monotonic())
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            raise AssertionError(f"{self.label}: the runner did not exit in {timeout:.0f}s:\n{proc.communicate()[0][-3000:]}")
        return proc.communicate()[0]

    def close(self) -> None:
        self.db.close()


def reference_run(scenario: Scenario, *, dsn: str, store: Store, directory: Path, seed: int) -> Reference:
    """One uninterrupted process, approved as it asks: the oracle for the scenario."""
    rng = random.Random(f"{seed}:reference:{scenario.name}")
    run = ChaosRun(
        scenario, dsn=dsn, store=store, directory=directory, rng=rng, stats=None, kills=0, label=f"reference {scenario.name}"
    )
    run.drive()
    if run.counts["processes"] != 1:
        raise AssertionError(
            f"the reference run of {scenario.name} needed {run.counts['processes']} processes:\n" + "\n".join(run.log)
        )
    state = end_state(store, run.db, run.run_id, run.uid, scenario.ledger)
    # The run is alone in its database, so the identity of its last checkpoint counts its commits.
    [(commits,)] = run.db.query("SELECT max(checkpoint_id) FROM agentfast_checkpoints")
    run.close()
    if state.phase != "Succeeded":
        raise AssertionError(f"the reference run of {scenario.name} ended {state.phase}")
    return Reference(scenario, state, max(0.2, run.active_s - run.waited_s), commits)


# -- many runs --------------------------------------------------------------------------------


@dataclass
class ChaosConfig:
    seed: int
    kills: int  # stop starting new runs once this many kills happened
    budget_s: float  # ... or once this much time passed
    workers: int
    scenarios: tuple[Scenario, ...] = KILL_SCENARIOS
    min_runs: int = 0  # start at least this many runs (so every scenario is run) whatever the budget
    max_kills_per_run: int | None = None  # cap on a run's kill budget (the CI size keeps runs short)
    only: tuple[int, ...] = ()  # replay just these run indices (AGENTFAST_CHAOS_ONLY=13,27)


def run_many(
    pg_server: Any, cfg: ChaosConfig, directory: Path, stats: Stats, references: Any, say: Callable[[str], None] = print
) -> None:
    """Chaos runs on ``cfg.workers`` threads until the kill target or the time budget is reached.

    Each run ``i`` plays scenario ``i % len(scenarios)`` with ``random.Random(f"{seed}:{i}")``,
    whichever worker gets it; ``references`` (a ReferenceBook) gives each scenario's oracle.
    """
    started = time.monotonic()
    references.prefetch(cfg.scenarios, parallel=cfg.workers)
    refs = {sc.name: references[sc.name] for sc in cfg.scenarios}

    lock = threading.Lock()
    next_index = [0]
    errors: list[BaseException] = []

    def take() -> int | None:
        with lock:
            if cfg.only:
                if next_index[0] >= len(cfg.only):
                    return None
                next_index[0] += 1
                return cfg.only[next_index[0] - 1]
            i = next_index[0]
            t = stats.total()
            if i >= cfg.min_runs and (t["kills"] >= cfg.kills or time.monotonic() - started > cfg.budget_s):
                return None
            next_index[0] += 1
            return i

    def worker(w: int) -> None:
        name = create_database(pg_server, f"chaos_w{w}")
        dsn = pg_server.dsn_for(name)
        try:
            with Store(dsn, retry_for_s=120) as store:
                store.migrate()
                while not errors:
                    i = take()
                    if i is None:
                        return
                    sc = cfg.scenarios[i % len(cfg.scenarios)]
                    rng = random.Random(f"{cfg.seed}:{i}")
                    kills = rng.randint(*sc.max_kills)
                    if cfg.max_kills_per_run is not None:
                        kills = min(kills, cfg.max_kills_per_run)
                    ref = refs[sc.name]
                    run = ChaosRun(
                        sc,
                        dsn=dsn,
                        store=store,
                        directory=directory,
                        rng=rng,
                        stats=stats,
                        kills=kills,
                        reference=ref,
                        label=f"run {i} {sc.name}",
                    )
                    try:
                        run.drive()
                        v = run.verdict(ref)
                    finally:
                        run.close()
                    c = run.counts
                    stats.add(
                        sc.name,
                        runs=1,
                        processes=c["processes"],
                        kills=c["kills"],
                        kills_fault=c["kills_fault"],
                        kills_external=c["kills_external"],
                        faults_not_reached=c["faults_not_reached"],
                        external_not_landed=c["external_not_landed"],
                        resumes=c["resumes"],
                        retry_exits=c["retry_exits"],
                        start_failures=c["start_failures"],
                        approvals=c["approvals"],
                        reruns_approved=c["reruns_approved"],
                        reruns_denied=c["reruns_denied"],
                        same_key_reruns=v.same_key_reruns,
                        duplicated_effects=v.duplicated_effects,
                        lost_results=v.lost_results,
                        unexpected_effects=v.unexpected_effects,
                        diverged_transcripts=v.diverged,
                        unexpected_exits=c["unexpected_exits"],
                    )
                    for p in v.problems:
                        stats.problem(f"run {i} {sc.name} ({run.run_id}): {p}")
                    if v.problems or c["unexpected_exits"] or cfg.only:
                        stats.problem(f"run {i} {sc.name} schedule: " + " | ".join(run.log))
                    t = stats.total()
                    say(
                        f"run {i:>4} {sc.name:<22} kills {c['kills']:>2} processes {c['processes']:>2}"
                        f"  [total kills {t['kills']}, violations {stats.violations()}, {time.monotonic() - started:.0f}s]"
                    )
        except BaseException as err:  # surface a harness failure from the thread
            errors.append(err)
        finally:
            drop_database(pg_server, name)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(cfg.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def write_results(name: str, data: dict) -> None:
    """Save a test's numbers under ``AGENTFAST_CHAOS_RESULTS`` (hack/chaos.sh renders them)."""
    out = os.environ.get("AGENTFAST_CHAOS_RESULTS")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=2, default=str))
