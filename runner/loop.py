"""The runner's core: :class:`RunnerBase` (what every adapter shares); the adapters are in ``runner/adapters/``.

``RunnerBase`` owns the lease, the snapshot, model turns (persisted before any tool runs),
approvals, budgets, commits and endings; an adapter only decides how an iteration is driven.

The adapter contract lives here, on ``RunnerBase`` itself, rather than in a module of its own: an
adapter is a subclass (the core's durable steps, in their order, are the base class's methods, so a
separate protocol would only restate them). :class:`RunnerBase` documents both halves: what an
adapter implements (``adapter``, :meth:`~RunnerBase.drive`, optional hooks) and the public surface
the core offers it. An adapter uses only that surface, never a ``_private`` member of the core;
``runner/adapters/__init__.py`` maps ``spec.adapter`` to the adapter classes, and only the CLI
(the composition root) picks one.

Exit codes (:class:`Outcome`.exit_code), shared with the CLI and the operator's replacement policy (operator/lifecycle.py):
0 finished, cancelled or paused for approval, 1 failed for good (budget, deadline, model rejected
the request),
2 bad input, 75 retry me (SIGTERM, Postgres unavailable, model unavailable, the tool host died;
EX_TEMPFAIL),
76 another runner owns the run: it took the run over (lease lost), or a live runner holds it and
this one refused to take it over (``runner/liveness.py``).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from . import faults, logs, tracing
from .arguments import arguments_digest
from .budget import check_budget, check_spend, get_classifier, keep_cost_limit
from .conversation import (
    ASK_USER,
    END_CONVERSATION,
    ENDED_IDLE,
    ENDED_PREFIX,
    ENDED_TEXT,
    AskUserTool,
    EndConversationTool,
    as_question,
    how_it_ended,
    question_of,
)
from .decisions import END, REPLY
from .errors import AgentfastError, SettingError, UnknownRun
from .journal import NOT_WRITTEN, CallExecutor, NotWritten, RunEnding
from .liveness import EXIT_GRACE_S, ClaimStopped, RunnerAlive, RunnerClaim
from .model import ChatModel, ModelError, ModelReply, distinct_tool_call_ids
from .names import (
    DEFAULT_MAX_ITERATION_CRASHES,
    MAX_ITERATION_CRASHES_ENV,
    TERMINAL_PHASES,
    WAITING_PHASES,
    ExitCode,
    Phase,
    format_run_id,
)
from .payloads import PayloadTooLarge
from .snapshot import (
    AwaitedCall,
    Message,
    PendingToolCall,
    Prices,
    RunContext,
    RunStatus,
    Session,
    StateSnapshot,
    ToolResult,
    call_id,
    idempotency_key,
)
from .spec import AgentRun, SpecError
from .store import (
    Decision,
    EndRequests,
    JournalEntry,
    LeaseLost,
    LostReplies,
    RunRecord,
    SdkRow,
    Store,
    StoreUnavailable,
    Turn,
    cancelled_message,
    deadline_message,
)
from .toolhost import ToolHostLost
from .tools import ToolRegistry

log = logging.getLogger(__name__)


class Unread(enum.Enum):
    """_UNREAD's type: an enum member, so that ``ends is _UNREAD`` narrows ``ends``."""

    UNREAD = "unread"


_UNREAD: Final = Unread.UNREAD  # RunnerBase.halted: no end requests at hand, read them


@dataclass
class Outcome:
    """How a runner process ended: the run's phase, the process exit code and a message."""

    phase: str
    exit_code: int
    message: str
    pending: PendingToolCall | None = None


@dataclass
class ProgressEvent:
    """Sent to ``on_event`` as the run moves: kind is one of started, model_call, tool_result
    (a tool body ran), tool_denied (a human denied the call; detail ends with the reason; the
    kind is tool_denied_rerun when an earlier attempt was interrupted and may have taken effect),
    tool_completed (recorded done without running: by a human, or by the tool's recovery check),
    user_replied (the user answered the model's question: detail names who and says the reply),
    conversation_ended (the person ended the conversation at a question, or the idle timeout did),
    checkpoint, waiting (``pending`` lists every awaited call), finished."""

    kind: str
    context: RunContext
    detail: str = ""
    pending: PendingToolCall | None = None


def fail_invalid_spec(
    store: Store, run: AgentRun, message: str, *, force: bool = False, wait_for_holder_s: float | None = None
) -> Outcome:
    """End a registered run as ``Failed`` / ``InvalidSpec`` with ``message``, running nothing of it.

    For a spec the runner cannot resolve (a ref that does not import or raises, a tool's gate
    removed, a module or script the cluster does not allow): the failure is committed like any
    ending, so the operator shows it in status (its reason and our short message) and nothing
    retries it. A run already finished keeps its ending. Returns the Outcome (exit code 2 when
    recorded; 76 when a live runner owns the run; 75 when Postgres is unavailable).
    """
    return _InvalidSpecRunner(
        store,
        run,
        _NoModel(),
        ToolRegistry([]),
        wait_for_approval=False,
        force=force,
        message=message,
        wait_for_holder_s=wait_for_holder_s,
    ).run()


class _NoModel:
    """The model of a run refused before it starts: never asked."""

    def complete(self, messages: list[Message], tools: list[dict[str, Any]]) -> ModelReply:  # pragma: no cover - never called
        raise ModelError("a run refused before it starts has no model", retriable=False)

    def close(self) -> None:
        pass


def run_id_of(run: AgentRun) -> str:
    """The store key of an AgentRun: ``namespace/name`` (:func:`~.names.format_run_id`)."""
    return format_run_id(run.metadata.namespace, run.metadata.name)


def awaiting_message(awaited: list[AwaitedCall]) -> str:
    """The run's status message while it waits on ``awaited`` (non-empty, model order)."""
    if len(awaited) == 1:
        a = awaited[0]
        if a.reason == "awaiting_input":
            return f"{a.call_id}: the agent asks: {question_of(a.tool_call.arguments)[:400]}"
        return f"{a.call_id}: {a.tool_call.name}({a.tool_call.arguments[:200]})"
    calls = ", ".join(f"{a.call_id} {a.tool_call.name}" for a in awaited)
    return f"{len(awaited)} calls await a decision: {calls}"[:1000]


def arguments_changed_message(e: JournalEntry, d: Decision) -> str:
    """Why an approved call did not run: its arguments' digest is not its decision's (G13)."""
    now = arguments_digest(e.tool_call.arguments)
    return (
        f"{e.call_id} {e.tool_call.name} was approved by {d.decided_by or 'a human'} on arguments with digest"
        f" {(d.arguments_digest or '')[:19]}..., but the arguments it would run with have digest {now[:19]}...:"
        " they changed after they were shown, so the call never ran (docs/security.md, G13)"
    )


def max_iteration_crashes(env: dict[str, str] | None = None) -> int:
    """``AGENTFAST_MAX_ITERATION_CRASHES`` (default 5): how many runners may crash in the same
    iteration, one after the other, before the next one ends the run ``Failed`` (reason
    ``CrashLoop``) instead of trying it again. Raises SettingError unless it is an integer >= 1."""
    raw = ((os.environ if env is None else env).get(MAX_ITERATION_CRASHES_ENV) or "").strip()
    if not raw:
        return DEFAULT_MAX_ITERATION_CRASHES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SettingError(f"{MAX_ITERATION_CRASHES_ENV}: {raw[:32]!r} is not an integer >= 1")
    return value


class BudgetExceeded(AgentfastError):
    """Raised before a model call when a budget limit is reached; ends the run as Failed."""


class ConversationEnded(AgentfastError):
    """Raised before a model call in a ``spec.conversation`` run whose previous batch ended the
    conversation (:func:`~.conversation.how_it_ended`): :meth:`RunnerBase.run` ends the run
    ``Succeeded`` with ``reason`` (EndedByUser, EndedByAgent, IdleTimeout) and ``message``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


#: ``Decision.decided_by`` of the ``end`` the runner makes itself when the person does not answer
#: within ``spec.conversationIdleTimeout`` (never stored as a decision: runners record none).
IDLE_DECIDER = "agentfast:idle-timeout"


class RunnerBase(ABC):
    """What every adapter shares: lease, snapshot, model turns, approvals, commits, endings.

    Drives one run to completion, to a pause for approval, or to a retriable stop. Subclasses
    implement :meth:`drive`. ``stop``: set it (the CLI does on SIGTERM) and the runner starts
    no new tool call, commits what it has, and returns exit code 75. ``wait_for_approval``:
    False returns at the first pause (exit 0, phase WaitingForApproval) instead of waiting.
    ``suspend_after_s``: waiting longer than this (s) returns the same way (a runner pod then
    frees itself, ``spec.suspendAfter``); None: wait as long as it takes. ``wait_for_holder_s``:
    how long the claim waits for a runner still holding the run to let go (:meth:`run`; None:
    ``liveness.EXIT_GRACE_S``). ``tools``: the registry, or a function that returns it (the tool
    host's: it imports the tools while this runner takes the run over), called once the takeover
    is committed and before anything runs; a SpecError it raises ends the run ``InvalidSpec``.

    Safe points (:meth:`halted`): at the top of every iteration, before every tool call and
    while waiting for a decision, the runner also reads the run's cancel request and age from
    the store, in the same transaction as the write just before it where there is one (the
    previous checkpoint; before a call, the write that marks it started, which refuses to once
    either ends the run: :class:`~.journal.RunEnding`). A cancel request ends the run ``Cancelled`` (reason ``Cancelled``, exit 0): no new
    tool call starts, a call in flight finishes and its result is kept, a pending call stays
    undecided and never runs. A run older than ``spec.activeDeadlineSeconds`` (wall clock since
    it was registered) ends ``Failed`` (reason ``DeadlineExceeded``, exit 1).

    **The adapter contract.** An adapter subclasses this class, is constructed with the arguments
    above and run once with :meth:`run`. It implements:

    - ``adapter``: its ``spec.adapter`` value, recorded in the run's session;
    - :meth:`drive`: drive the run from its snapshot (committed, the run claimed) to an Outcome;
    - optionally :meth:`start_with_turn` (write a call's intent with the model turn),
      :meth:`sdk_rows` / :meth:`sdk_rows_stored` (an SDK's own state, committed with the checkpoint).

    The core offers it, and an adapter uses nothing else of the core: the attributes ``snap``
    (the :class:`StateSnapshot` in memory, committed by :meth:`commit`), ``store``, ``run_id``,
    ``spec``, ``tools`` (a :class:`ToolRegistry`), ``stop`` (threading.Event) and ``executor``
    (the :class:`~.journal.CallExecutor` running journaled calls, set before :meth:`drive`); the
    safe points :meth:`halted`, :meth:`halt_known`, :meth:`take_ends` and :meth:`halt_outcome`;
    model turns :meth:`model_turn`, :meth:`planned_entries`, :meth:`take_intent`; tool calls
    :meth:`triage`, :meth:`decisions`, :meth:`apply_decision`; and :meth:`commit`,
    :meth:`finish`, :meth:`emit`. These raise what the store, the model and the tool host raise
    (StoreUnavailable, LeaseLost, RunEnding, PayloadTooLarge, ModelError, BudgetExceeded,
    ConversationEnded, ToolHostLost); :meth:`run` turns each into its Outcome, so an adapter lets them propagate.
    """

    adapter = "base"

    def __init__(
        self,
        store: Store,
        run: AgentRun,
        model: ChatModel,
        tools: ToolRegistry | Callable[[], ToolRegistry],
        *,
        wait_for_approval: bool = True,
        stop: threading.Event | None = None,
        on_event: Callable[[ProgressEvent], None] | None = None,
        force: bool = False,
        suspend_after_s: float | None = None,
        wait_for_holder_s: float | None = None,
    ):
        self.store = store
        self.force = force
        self.wait_for_holder_s = EXIT_GRACE_S if wait_for_holder_s is None else wait_for_holder_s
        self.suspend_after_s = suspend_after_s or None
        self.run_spec = run
        self.spec = run.spec
        self.run_id = run_id_of(run)
        self.model = model
        self.tools: ToolRegistry = self._with_builtins(tools) if isinstance(tools, ToolRegistry) else ToolRegistry([])
        self._resolve_tools: Callable[[], ToolRegistry] | None = None if isinstance(tools, ToolRegistry) else tools
        self.wait_for_approval = wait_for_approval
        self.stop = stop or threading.Event()
        self.on_event = on_event or (lambda e: None)
        self.snap: StateSnapshot
        self._stored = 0
        self._turns_before = 0  # the last iteration whose model reply an earlier runner may have saved
        self._last_turn: Turn | None = None  # the last turn this runner saved or read
        self._planned: tuple[int, list[JournalEntry]] | None = None  # its journal entries, if this runner saved it
        # (iteration, position, what the write returned) of a call whose intent the turn's write recorded
        self._intent: tuple[int, int, EndRequests | None] | None = None
        self._ends_read: EndRequests | None | Literal[Unread.UNREAD] = _UNREAD  # read by the last commit for the next halted()
        self._active_since: float | None = None
        self._ending: tuple[str, str, str] | None = None  # (phase, reason, message) a safe point found
        self._deadline_mono: float | None = None  # time.monotonic() when spec.activeDeadlineSeconds passes
        self.trace: tracing.RunTracer = tracing.RunTracer()  # this attempt's spans (runner/tracing.py); run() sets it
        self._claim: RunnerClaim | None = None
        self.max_crashes = max_iteration_crashes()  # SettingError at start, before any work
        self._attempt_at: int | None = None  # the iteration start_attempt recorded; None: not recorded
        self._crashed = False  # this attempt ends as a crash (the tool host died): end_attempt is not called
        self._lost = LostReplies()  # replies answered but lost to crashes before this runner (read at the takeover)
        self._idle_ends: dict[str, Decision] = {}  # decision id -> the end spec.conversationIdleTimeout made

    # -- entry point -------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Run until finished, paused or stopped. Never raises for run-level failures.

        First claims the run (``runner/liveness.py``): a runner already holding it is given
        ``wait_for_holder_s`` seconds to let go; one still alive then ends this one with exit 76
        and a message naming the holder, unless ``force`` (a ``stop`` meanwhile: exit 75, nothing taken).
        Raises UnreadableState (exit 2) when the stored state is not readable by this release.
        """
        # Every log line names the run (runner/logs.py); an earlier run's epoch and iteration go.
        logs.bind(run=self.run_id, epoch=None, iteration=None)
        record = self.store.get_run(self.run_id)
        if record is None:
            raise UnknownRun(f"run {self.run_id} is not registered in the store")
        try:
            claim = RunnerClaim.acquire(self.store, self.run_id, force=self.force, wait_s=self.wait_for_holder_s, stop=self.stop)
        except RunnerAlive as err:
            return Outcome("Owned", ExitCode.LEASE_LOST, str(err))
        except ClaimStopped as err:
            return Outcome("Stopped", ExitCode.RETRY, str(err))
        except StoreUnavailable as err:
            return Outcome("Unavailable", ExitCode.RETRY, f"Postgres unavailable; nothing is lost, resume later: {err}")
        self.trace, self._claim = tracing.run_tracer(self.run_id, record.run_uid), claim
        outcome: Outcome | None = None
        try:
            outcome = self._run_claimed(record)
            self._end_attempt()
            return outcome
        finally:
            ended = (outcome.phase, outcome.exit_code, outcome.message) if outcome is not None else (None, None, "")
            self.trace.attempt_ended(getattr(self, "snap", None), *ended)
            claim.release()

    def _run_claimed(self, record: RunRecord) -> Outcome:
        self.store.load_context(self.run_id)  # unreadable state (UnreadableState) stops us before the takeover
        try:
            self.lease = self.store.acquire_lease(self.run_id)
            logs.bind(epoch=self.lease.epoch)
            snap = self.store.load_snapshot(self.run_id)
            # Fenced now: any later turn is this runner's own, so only these are read back.
            self._turns_before = self.store.last_turn_iteration(self.run_id)
            # Replies earlier runners were answered and lost: they count against the budget.
            self._lost = self.store.lost_replies(self.run_id) if snap is not None else LostReplies()
            self._active_since = time.monotonic()
            if snap is None:
                self.snap = self._initial_snapshot(record.run_uid)
                self._trace_attempt()
                self.commit()
            else:
                self.snap = snap
                self._stored = len(snap.messages)
                if snap.context.status.phase in TERMINAL_PHASES:
                    return self._outcome_of_terminal()
                # A fork's checkpoint was written by Store.fork_run (epoch 0): the first runner that
                # takes it (epoch 1) starts the fork, it does not resume it (issue 31 item 6).
                if self.lease.epoch > 1:
                    snap.context.counters.resumes += 1
                # Always the registered document's (its ModelConfig's, or the scripted model's):
                # whatever a copied or older checkpoint held, e.g. a fork of a source priced at 0.
                snap.context.prices = self._prices()
                self._trace_attempt()
                self.commit()  # the takeover is visible at once (status.restarts), not at the next step
            crash_loop = self._start_attempt()  # issue 30 item 4: an iteration that keeps killing its runner ends the run
            if crash_loop is not None:
                return crash_loop
            warm = getattr(self.model, "warm", None)  # the model client's imports, off the takeover's path
            if warm is not None:
                warm()
            if self._resolve_tools is not None:  # the run is ours and the old runner fenced: now wait for the tools
                self.tools, self._resolve_tools = self._with_builtins(self._resolve_tools()), None
            self.executor = CallExecutor(
                self.store, self.lease, record.run_uid, self.tools, deadline_s=self.spec.activeDeadlineSeconds, trace=self.trace
            )
            self.emit("started")
            return self.drive()
        except BudgetExceeded as err:
            return self.finish(Phase.FAILED, "BudgetExceeded", str(err))
        except ConversationEnded as err:  # the person, the model or the idle timeout ended it
            return self.finish(Phase.SUCCEEDED, err.reason, err.message)
        except RunEnding as err:  # a cancel or the deadline, found by the write that would have started a call
            self.halted(err.ends)
            return self.halt_outcome("stop requested before a tool call; resume to continue")
        except LeaseLost as err:
            log.error("lease lost: %s", err)
            return Outcome(
                "LeaseLost", ExitCode.LEASE_LOST, f"another runner took this run over; stopping without effects ({err})"
            )
        except StoreUnavailable as err:
            return Outcome("Unavailable", ExitCode.RETRY, f"Postgres unavailable; nothing is lost, resume later: {err}")
        except ToolHostLost as err:  # a call in flight may have taken effect: left started, settled on resume (G4)
            self._crashed = True  # counted against AGENTFAST_MAX_ITERATION_CRASHES, as the host's death was a crash
            return self._retry_exit(f"the tool host died ({err}); resume to continue")
        except ModelError as err:
            if err.retriable:
                return self._retry_exit(f"model unavailable: {err}")
            return self.finish(Phase.FAILED, "ModelError", f"the model rejected the request: {err}")
        except PayloadTooLarge as err:  # permanent: retrying would fail the same way, for ever
            return self._fail_too_large(err)
        except SpecError as err:  # user code named by the spec (a classifier, a graph factory) failed: G12
            if not hasattr(self, "snap"):
                self.snap = self._initial_snapshot(record.run_uid, classify=False)
            return self.finish(Phase.FAILED, "InvalidSpec", str(err), exit_code=ExitCode.BAD_INPUT)

    def _start_attempt(self) -> Outcome | None:
        """Record this attempt at the run's current iteration (``Store.start_attempt``); when
        :attr:`max_crashes` runners in a row crashed in it already, end the run ``Failed`` (reason
        ``CrashLoop``, exit 1) instead of trying it again. Returns that Outcome, else None."""
        it = self.snap.context.counters.iterations + 1
        crashes = self.store.start_attempt(self.lease, it)
        self._attempt_at = it
        if crashes < self.max_crashes:
            return None
        return self.finish(
            Phase.FAILED,
            "CrashLoop",
            f"iteration {it} crashed its runner {crashes} times in a row (the limit, {MAX_ITERATION_CRASHES_ENV},"
            f" is {self.max_crashes}); the run stops instead of trying it again: look at the runner's log of those attempts",
        )

    def _end_attempt(self) -> None:
        """Tell the store this attempt ended without crashing (``Store.end_attempt``), unless it
        did crash (the tool host died) or never started one. Best effort: a store that is gone or
        a lease taken over leaves the attempt counted as a crash, as a death would."""
        if self._attempt_at is None or self._crashed:
            return
        try:
            self.store.end_attempt(self.lease, self.snap.context.counters.iterations + 1)
        except (StoreUnavailable, LeaseLost) as err:
            log.warning("could not record the attempt's end: %s", err)

    def _trace_attempt(self) -> None:
        """Start this attempt's span (runner/tracing.py), recorded in the takeover commit that follows."""
        claim = self._claim
        self.trace.attempt_started(
            self.snap,
            run_name=self.run_spec.metadata.name,
            epoch=self.lease.epoch,
            runner_id=claim.runner_id if claim is not None else "",
            left_behind=claim.left_behind if claim is not None else None,
        )

    @abstractmethod
    def drive(self) -> Outcome:
        """The adapter's loop: from ``snap`` (committed, the run claimed, ``executor`` set) to how
        the run ends: :meth:`finish`, :meth:`halt_outcome` or the Outcome :meth:`decisions`
        returned. Exceptions propagate to :meth:`run`, which ends the run by them."""
        raise NotImplementedError

    def _fail_too_large(self, err: PayloadTooLarge) -> Outcome:
        """End the run ``Failed`` (reason ``PayloadTooLarge``, exit 1) for a value the store
        cannot keep. If the snapshot in memory itself cannot be committed (the value is in it),
        the last committed one ends the run instead (none yet: the same context with an empty
        transcript, as ``Store.end_run`` does). Raises LeaseLost, StoreUnavailable."""
        message = f"{err}; the run cannot go on without it"
        try:
            return self.finish(Phase.FAILED, "PayloadTooLarge", message)
        except PayloadTooLarge:
            snap = self.store.load_snapshot(self.run_id)
            if snap is None:  # its very first commit (the input itself) was refused
                snap = StateSnapshot(run_id=self.run_id, context=self.snap.context, messages=[])
            self.snap, self._stored = snap, len(snap.messages)
            return self.finish(Phase.FAILED, "PayloadTooLarge", message)

    # -- model turns and tool plans ------------------------------------------------------------

    def _with_builtins(self, tools: ToolRegistry) -> ToolRegistry:
        """``tools`` plus the runtime's own: ``ask_user`` and ``end_conversation`` when
        ``spec.conversation`` is on."""
        if not self.spec.conversation:
            return tools
        return tools.with_builtin(AskUserTool()).with_builtin(EndConversationTool())

    def _check_conversation_ended(self, it: int, messages: list[Message]) -> None:
        """Raise ConversationEnded when the batch of iteration ``it - 1`` (the last assistant
        message of ``messages``) ended the conversation: its ``end_conversation`` call finished,
        or a question of it was ended (by the person or the idle timeout). Read from the journal,
        so a runner resuming after the batch finds it again. A no-op outside conversations."""
        if not self.spec.conversation or it <= 1:
            return
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        if last is None or not any(c.name in (ASK_USER, END_CONVERSATION) for c in last.tool_calls):
            return
        results = [e.result for e in self.store.journal(self.run_id, it - 1) if e.result is not None]
        ended = how_it_ended(last, results)
        if ended is not None:
            raise ConversationEnded(*ended)

    def model_turn(self, it: int, messages: list[Message]) -> Turn:
        """The model's reply for iteration ``it``: the persisted one on a resume, else a new one.

        A new reply is asked only after the budget check (G7); it is persisted with the intent of
        each call it asks for before any tool runs. ``it``: 1 for the first model call of the run;
        ``messages``: the transcript the model is sent. Raises BudgetExceeded, ModelError;
        ConversationEnded (before anything else) when the previous batch ended the conversation.
        """
        logs.bind(iteration=it)
        self._check_conversation_ended(it, messages)  # before the budget: an ended conversation asks nothing
        turn = None
        self.trace.iteration(it)
        if self._last_turn is not None and self._last_turn.iteration == it:
            turn = self._last_turn  # a graph node re-executed (LangGraph) asks for its turn again
        elif it <= self._turns_before:  # saved by an earlier runner: a resume reuses that reply
            turn = self.store.load_turn(self.run_id, it)
        if turn is None:
            reason = check_budget(self.counted_context())
            if reason:
                raise BudgetExceeded(reason)
            self.emit("model_call", f"iteration {it}")
            faults.point("model.before_call")
            with self.trace.chat(it, self.spec.model.name) as span:
                reply = self.model.complete(messages, self.tools.schemas)
                span.reply(reply)
            # Paid for now: its usage is recorded before anything that can crash (issue 30 item 4).
            prices = self.snap.context.prices
            cost = prices.cost(reply.prompt_tokens, reply.completion_tokens) if prices is not None else None
            self.store.record_reply(self.lease, it, reply.prompt_tokens, reply.completion_tokens, cost)
            faults.point("model.after_call")
            message = as_question(reply.message, it) if self.spec.conversation else reply.message
            # Ids a provider repeated are made unique before they are stored or sent back (the wire).
            message = distinct_tool_call_ids(message, messages, it)
            turn = Turn(it, message, reply.prompt_tokens, reply.completion_tokens)
            plan = self._plan(it, turn.message)
            start = self.start_with_turn(plan)
            if start is None:
                turn = self.store.save_turn(self.lease, turn, plan)  # as stored: see runner/storable.py
            else:  # the first call's intent in the same write (what mark_started would write next)
                turn, ends = self.store.save_turn_and_mark_started(
                    self.lease, turn, plan, start, deadline_s=self.executor.deadline_s
                )
                self._intent = (it, start, ends)
            # The journal now holds exactly this plan (of the stored message): the batch needs no read.
            self._planned = (it, self._plan(it, turn.message))
        self._last_turn = turn
        self._account(turn)
        return turn

    def start_with_turn(self, plan: list[JournalEntry]) -> int | None:
        """The position of the call whose intent is written with the turn (its run comes next,
        with nothing but computing between), or None: the intents are written one by one."""
        return None

    def take_intent(self, it: int, position: int) -> EndRequests | None | Literal[NotWritten.NOT_WRITTEN]:
        """What the turn's write returned for call ``position`` of iteration ``it``, if it
        recorded that call's intent (once), else ``journal.NOT_WRITTEN``."""
        intent, self._intent = self._intent, None
        return intent[2] if intent is not None and intent[:2] == (it, position) else NOT_WRITTEN

    def counted_context(self) -> RunContext:
        """The run's context as the budget sees it: ``snap.context`` (whose usage counts saved
        turns only, as checkpoints keep it) with the replies lost before this runner took the run
        over added to its usage (``usage.lost_replies`` says how many). A copy when there are
        any, never committed: each reply is counted once, through its turn or as lost."""
        ctx, lost = self.snap.context, self._lost
        if not lost.count:
            return ctx
        return ctx.model_copy(update={"usage": ctx.usage.plus(lost.prompt_tokens, lost.completion_tokens, lost.count)})

    def _account(self, turn: Turn) -> None:
        """Add a turn's tokens to usage once, and count it as a model call.

        Both are derived from the persisted turns (one per iteration), not from what this process
        did: after a kill and resume they are what an uninterrupted run shows. A reply whose turn
        was never persisted is asked again; the lost one was paid for, and counts as a lost reply
        (``Store.record_reply``, :meth:`counted_context`), never here.
        """
        ctx = self.snap.context
        ctx.counters.model_calls = max(ctx.counters.model_calls, turn.iteration)
        if ctx.turns_accounted < turn.iteration:
            ctx.usage.prompt_tokens += turn.prompt_tokens
            ctx.usage.completion_tokens += turn.completion_tokens
            ctx.usage.total_tokens += turn.prompt_tokens + turn.completion_tokens
            ctx.turns_accounted = turn.iteration

    def _plan(self, it: int, message: Message) -> list[JournalEntry]:
        uid = self.snap.context.session.run_uid
        entries = []
        for pos, call in enumerate(message.tool_calls):
            tool = self.tools.get(call.name)
            entries.append(
                JournalEntry(
                    iteration=it,
                    position=pos,
                    call_id=call_id(it, pos),
                    idempotency_key=idempotency_key(uid, it, pos),
                    tool_call=call,
                    gated=bool(tool and tool.requires_approval),
                    idempotent=bool(tool is None or tool.idempotent),
                    state="planned",
                    attempts=0,
                    result=None,
                )
            )
        return entries

    def planned_entries(self, it: int) -> list[JournalEntry] | None:
        """The journal entries of iteration ``it`` as this runner just saved them (taken once:
        they go stale as the calls run), or None when the journal must be read."""
        planned, self._planned = self._planned, None
        return planned[1] if planned is not None and planned[0] == it else None

    def triage(self, e: JournalEntry) -> ToolResult | str:
        """How one journaled call of the current batch goes on.

        Returns its result if it is done, or if it was interrupted in flight and its tool's
        recovery check finds the effect happened (recorded now); "run" if it runs now without a
        human (also an interrupted call whose check says the effect did not happen); "human" if
        it awaits a decision (gated, or non-idempotent and interrupted with no answer from a
        check). A human's decision on an interrupted call's re-run wins over its check.
        """
        if e.state == "done" and e.result is not None:
            return e.result
        if e.state == "started" and (
            not self.executor.in_flight_unsafe(e) or self.store.get_decision(self.run_id, self.executor.decision_id(e)) is None
        ):
            found = self.executor.recover(e)
            if isinstance(found, ToolResult):
                self.emit("tool_completed", f"{e.call_id} {e.tool_call.name}: its recovery check found the effect done")
                return found
            if found is True:
                return "run"
        return "human" if self.executor.needs_human(e) else "run"

    def decisions(self, waiting: list[JournalEntry], siblings: list[ToolResult]) -> dict[int, Decision] | Outcome:
        """The human decision on every call of a batch that awaits one, by position.

        ``waiting``: those calls, in the model's order; ``siblings``: the batch's results so far
        (G5). All undecided calls are made pending at once (:meth:`_pause`) and the run waits
        until every one is decided, in any order. Returns an Outcome instead when not waiting
        for approvals, or stopped while waiting. Raises BudgetExceeded instead of asking anyone
        when the run is already over ``max_tokens`` or ``max_cost`` (the reply that asked for
        the calls and replies lost to crashes counted: :func:`~.budget.check_spend`): a person
        is never asked to approve a call of a run that cannot go on.
        """
        ids = {e.position: self.executor.decision_id(e) for e in waiting}
        found = self.store.get_decisions(self.run_id, list(ids.values()))
        undecided = [e for e in waiting if ids[e.position] not in found]
        if undecided and self._idle_left_s(undecided) == 0.0:  # the person was gone before this runner came
            found = {**found, **self._end_idle(undecided)}
            undecided = []
        if undecided:
            over = check_spend(self.counted_context())
            if over:
                raise BudgetExceeded(f"{over}; no one was asked to decide on {', '.join(ids[e.position] for e in undecided)}")
            outcome = self._pause(undecided, siblings)
            if outcome is not None:
                return outcome
            suspend_at = time.monotonic() + self.suspend_after_s if self.suspend_after_s else None
            idle_left = self._idle_left_s(undecided)
            idle_at = time.monotonic() + idle_left if idle_left is not None else None
            while True:
                until = min((t for t in (self._deadline_at(), suspend_at, idle_at) if t is not None), default=None)
                got = self.store.wait_for_decisions(self.run_id, list(ids.values()), self.stop, until=until)
                if got is not None:
                    break
                if idle_at is not None and time.monotonic() >= idle_at and not self.halted():
                    # spec.conversationIdleTimeout: a reply that came meanwhile still wins
                    got = self.store.get_decisions(self.run_id, list(ids.values()))
                    got = {**got, **self._end_idle([e for e in undecided if self.executor.decision_id(e) not in got])}
                    break
                if self.halted():  # stopped, cancelled or past the deadline
                    self._active_since = time.monotonic()
                    return self.halt_outcome("stop requested (SIGTERM) while waiting for approval; resume to continue")
                if suspend_at is not None and time.monotonic() >= suspend_at:
                    # spec.suspendAfter: free the pod and the connections; a decision starts a new runner
                    self._active_since = time.monotonic()
                    return Outcome(
                        Phase(self.snap.context.status.phase),
                        ExitCode.OK,
                        f"suspended: no decision within {self.suspend_after_s:g} s; "
                        "the runner exits and a decision starts a new one",
                        self.snap.pending,
                    )
                # else woke a hair before the store's clock reached the deadline: wait on
            self._active_since = time.monotonic()  # time spent waiting for a human is not billed
            found = got
        if self.snap.context.status.phase in WAITING_PHASES:
            said = ", ".join(f"{i}: {found[i].decision}" for i in ids.values())
            self.snap.context.status = RunStatus(phase=Phase.RUNNING, reason="Decided", message=said[:1000])
        return {pos: found[i] for pos, i in ids.items()}

    def _idle_left_s(self, undecided: list[JournalEntry]) -> float | None:
        """Seconds left before ``spec.conversationIdleTimeout`` ends the conversation, counted
        from when the latest of ``undecided`` was first awaited (``AwaitedCall.requested_at``, kept
        across runners; now for one not pending yet), 0.0 when it has passed; None when it does not
        apply: no timeout, or a call of ``undecided`` is not a question (a human's approval is
        awaited too, and the person is not the one who keeps the run waiting)."""
        timeout = self.spec.conversationIdleTimeout
        if timeout is None or not undecided or not all(self._is_question(e) for e in undecided):
            return None
        now_ms = int(time.time() * 1000)
        pending = {a.call_id: a.requested_at for a in self.snap.pending.awaiting} if self.snap.pending else {}
        since = max(pending.get(self.executor.decision_id(e), now_ms) for e in undecided)
        return max(0.0, (since + timeout * 1000 - now_ms) / 1000)

    def _end_idle(self, undecided: list[JournalEntry]) -> dict[str, Decision]:
        """The ``end`` decisions the idle timeout makes on ``undecided`` (questions), by decision
        id; kept in memory only (:meth:`decision_on`), never stored: runners record no decision.
        A resumed runner makes them again, since the timeout has passed for good."""
        made = {}
        for e in undecided:
            cid = self.executor.decision_id(e)
            made[cid] = Decision(call_id=cid, decision="end", reason="idle timeout", decided_by=IDLE_DECIDER)
        self._idle_ends.update(made)
        return made

    def decision_on(self, decision_id: str) -> Decision | None:
        """The decision on awaited call ``decision_id``: the store's, else the ``end`` the idle
        timeout made in this runner (:meth:`decisions`), else None. Raises StoreUnavailable."""
        return self.store.get_decision(self.run_id, decision_id) or self._idle_ends.get(decision_id)

    def _pause(self, undecided: list[JournalEntry], siblings: list[ToolResult]) -> Outcome | None:
        """Commit every undecided call as pending (once), then return (no wait) or let the caller wait."""
        ctx = self.snap.context
        old = self.snap.pending
        before = {a.call_id: a for a in old.awaiting} if old else {}
        awaited = []
        for e in undecided:
            cid = self.executor.decision_id(e)
            awaited.append(
                AwaitedCall(
                    call_id=cid,
                    iteration=e.iteration,
                    position=e.position,
                    tool_call=e.tool_call,
                    idempotency_key=e.idempotency_key,
                    reason="in_flight_not_idempotent"
                    if self.executor.in_flight_unsafe(e)
                    else "awaiting_input"
                    if self._is_question(e)
                    else "requires_approval",
                    **({"requested_at": before[cid].requested_at} if cid in before else {}),
                )
            )
        if old is None or old.call_ids != [a.call_id for a in awaited]:
            self.snap.pending = PendingToolCall.of(awaited, siblings)
            ctx.counters.approvals_requested += sum(1 for a in awaited if a.call_id not in before)
            if all(a.reason == "awaiting_input" for a in awaited):
                ctx.status = RunStatus(phase=Phase.WAITING_FOR_INPUT, reason="AwaitingInput", message=awaiting_message(awaited))
            else:
                ctx.status = RunStatus(
                    phase=Phase.WAITING_FOR_APPROVAL, reason="AwaitingApproval", message=awaiting_message(awaited)
                )
            self.commit()
        faults.point("approval.waiting")
        # From here on the run waits for a human, also while the CLI asks at its own prompt (an
        # on_event callback): waiting time, not active time against max_duration_ms.
        self._account_active()
        self._active_since = None
        assert self.snap.pending is not None  # set above, or the same batch's record kept
        self.emit("waiting", ", ".join(self.snap.pending.call_ids), pending=self.snap.pending)
        if not self.wait_for_approval:
            return Outcome(Phase(ctx.status.phase), ExitCode.OK, ctx.status.message, pending=self.snap.pending)
        self.trace.waiting(self.snap.pending.call_ids)
        return None

    def _is_question(self, e: JournalEntry) -> bool:
        """Whether ``e`` is the model's question to the user (the built-in ``ask_user``)."""
        return isinstance(self.tools.get(e.tool_call.name), AskUserTool)

    def apply_decision(self, e: JournalEntry, d: Decision) -> ToolResult | None:
        """Carry out a human's decision on an awaited call; None if halted (:meth:`halted`:
        stopped, cancelled, past the deadline) before an approved run, or if the approved call's
        arguments are not the ones its decision was made on (G13: the decision's
        ``arguments_digest``): the call never runs and :meth:`halt_outcome` ends the run
        ``Failed``/``ArgumentsChanged``."""
        name = e.tool_call.name
        if d.decision == "approve":
            if self.halted():
                return None
            if d.arguments_digest is not None and arguments_digest(e.tool_call.arguments) != d.arguments_digest:
                # G13: whatever wrote them, these are not the arguments the approver was shown.
                self._ending = (Phase.FAILED, "ArgumentsChanged", arguments_changed_message(e, d))
                return None
            result = self.executor.execute(e)
            self.emit("tool_result", f"{e.call_id} {name}")
        elif d.decision == REPLY:
            result = self.executor.reply(e, d.result or "", d.decided_by)
            self.emit("user_replied", f"{e.call_id}: {d.decided_by or 'the user'} replied: {d.result or ''}")
        elif d.decision == END:  # the conversation ends here; the next model turn finds it (ConversationEnded)
            idle = d.decided_by == IDLE_DECIDER and self._idle_ends.get(d.call_id) is d
            by = ENDED_IDLE if idle else f"{ENDED_PREFIX}user:{d.decided_by}" if d.decided_by else f"{ENDED_PREFIX}user"
            result = self.executor.end_question(e, ENDED_TEXT, by)
            who = "nobody answered within spec.conversationIdleTimeout" if idle else f"{d.decided_by or 'the user'} ended it"
            self.emit("conversation_ended", f"{e.call_id}: {who}")
        elif d.decision == "complete":
            result = self.executor.complete(e, d.result or "", d.decided_by)
            self.emit("tool_completed", f"{e.call_id} {name}: recorded as already done by {d.decided_by or 'a human'}")
        else:
            attempted = e.attempts > 0  # the denial of an unsafe re-run: it ran, or may have
            decided_id = self.executor.decision_id(e)
            result = self.executor.deny(e, d.reason)
            self.emit("tool_denied_rerun" if attempted else "tool_denied", f"{decided_id} {name}: {d.reason or ''}")
        return result

    # -- safe points: stop, cancel, deadline -------------------------------------------------------

    def halted(self, ends: EndRequests | None | Literal[Unread.UNREAD] = _UNREAD) -> bool:
        """Whether the run must start nothing more now: ``stop`` is set (SIGTERM), or the store
        holds a cancel request for it, or it is past ``spec.activeDeadlineSeconds``. The last two
        are remembered (:meth:`halt_outcome` ends the run with them). ``ends``: the run's
        :class:`EndRequests` as a write just read them (the same transaction); else one query
        to the store. Raises StoreUnavailable."""
        if self._ending is None:
            if ends is _UNREAD:
                ends = self.store.end_requests(self.run_id)
            deadline = self.spec.activeDeadlineSeconds
            if ends is not None and ends.cancel is not None:
                self._ending = (Phase.CANCELLED, "Cancelled", cancelled_message(ends.cancel))
            elif ends is not None and deadline is not None and ends.age_s >= deadline:
                self._ending = (Phase.FAILED, "DeadlineExceeded", deadline_message(deadline, ends.age_s))
            elif ends is not None and deadline is not None:
                self._deadline_mono = time.monotonic() + (deadline - ends.age_s) + 0.01
        return self.halt_known()

    def halt_known(self) -> bool:
        """Whether :meth:`halted` would say so without asking the store: ``stop`` is set, or a
        safe point already found a cancel request or the deadline. Reads nothing."""
        return self._ending is not None or self.stop.is_set()

    def take_ends(self) -> EndRequests | None | Literal[Unread.UNREAD]:
        """The end requests the last commit read for the :meth:`halted` that follows it (once)."""
        ends, self._ends_read = self._ends_read, _UNREAD
        return ends

    def _deadline_at(self) -> float | None:
        """``time.monotonic()`` at which ``spec.activeDeadlineSeconds`` passes, or None (none, or
        not known yet: :meth:`halted` learns it)."""
        if self.spec.activeDeadlineSeconds is None:
            return None
        if self._deadline_mono is None:
            self.halted()
        return self._deadline_mono

    def halt_outcome(self, stopped: str) -> Outcome:
        """How the run ends at a safe point where :meth:`halted` said so: cancelled (exit 0) or
        past its deadline (Failed, exit 1) when the store said so, else stopped by SIGTERM (exit
        75 with the message ``stopped``). A cancelled run keeps its pending call as it was:
        undecided, never run (as ``Store.cancel_run`` does)."""
        if self._ending is None:
            return self._retry_exit(stopped)
        phase, reason, message = self._ending
        if phase == Phase.CANCELLED:
            return self.finish(phase, reason, message, exit_code=ExitCode.OK, keep_pending=True)
        return self.finish(phase, reason, message)

    # -- commits and endings ---------------------------------------------------------------------

    def _initial_snapshot(self, run_uid: str, *, classify: bool = True) -> StateSnapshot:
        """The first snapshot of a run. ``classify``: let the spec's classifier set the budget
        (user code: anything it raises, BaseException included, becomes SpecError); False keeps
        the declared budget (a run refused before it starts)."""
        classification = None
        declared = budget = self.spec.budget.limits()
        if classify:
            classifier = get_classifier(self.spec.budget.classifier)
            try:
                classification = classifier(self.spec)
            except BaseException as err:  # noqa: BLE001 - user code must not end the runner's process
                log.warning("classifier %s raised %s", self.spec.budget.classifier, type(err).__name__, exc_info=True)
                raise SpecError(
                    f"spec.budget.classifier: calling {self.spec.budget.classifier} raised {type(err).__name__}"
                ) from None
            budget = keep_cost_limit(classification.applied, declared)
            if budget.max_cost is not None and self._prices() is None:  # a declared one was refused with the spec
                raise SpecError(
                    f"spec.budget.classifier: {self.spec.budget.classifier} set max_cost {budget.max_cost:g}, but the run's"
                    " model has no prices, so its cost cannot be counted"
                )
        ctx = RunContext(
            session=Session(run_uid=run_uid, adapter=self.adapter, model=self.spec.model.name),
            budget=budget,
            classification=classification,
            status=RunStatus(phase=Phase.RUNNING, reason="Started"),
            prices=self._prices(),
        )
        messages = []
        if self.spec.systemPrompt:
            messages.append(Message(role="system", content=self.spec.systemPrompt))
        messages.append(Message(role="user", content=self.spec.input))
        return StateSnapshot(run_id=self.run_id, context=ctx, messages=messages)

    def _prices(self) -> Prices | None:
        """The run's prices as the snapshot keeps them (``RunContext.prices``), from its document."""
        prices = self.run_spec.prices()
        return None if prices is None else Prices.model_validate(prices.model_dump())

    def _account_active(self) -> None:
        if self._active_since is not None:
            now = time.monotonic()
            self.snap.context.usage.duration_ms += int((now - self._active_since) * 1000)
            self._active_since = now

    def commit(self, *, then_halted: bool = False) -> None:
        """Commit the snapshot (G1). ``then_halted``: the caller's next step is :meth:`halted`
        (:meth:`take_ends` gives it the run's end requests, read by the commit itself). Raises
        LeaseLost, StoreUnavailable, PayloadTooLarge; RuntimeError if the transcript shrank."""
        self._account_active()
        self.snap.saved_at = int(time.time() * 1000)
        self.trace.checkpoint(self.snap)
        faults.point("checkpoint.before_commit")
        if len(self.snap.messages) < self._stored:
            raise RuntimeError(
                f"the transcript shrank from {self._stored} to {len(self.snap.messages)} messages; it is append-only"
            )
        rows = self.sdk_rows()
        if then_halted:
            _, self._ends_read = self.store.commit_checkpoint_then_read_end_requests(
                self.lease, self.snap, stored_messages=self._stored, sdk_rows=rows
            )
        else:
            self.store.commit_checkpoint(self.lease, self.snap, stored_messages=self._stored, sdk_rows=rows)
        self._stored = len(self.snap.messages)
        self.sdk_rows_stored(rows)
        faults.point("checkpoint.after_commit")
        self.emit("checkpoint")

    def sdk_rows(self) -> list[SdkRow]:
        """The rows of the SDK's state that ``snap.sdk_state`` names and that are not stored yet;
        :meth:`commit` writes them with the checkpoint. Empty for a loop-owning adapter."""
        return []

    def sdk_rows_stored(self, rows: list[SdkRow]) -> None:
        """Called once :meth:`commit` has committed ``rows``: they need not be sent again."""
        return None  # a hook: nothing to forget unless sdk_rows gave rows

    def finish(
        self, phase: str, reason: str, message: str, *, exit_code: int | None = None, keep_pending: bool = False
    ) -> Outcome:
        """End the run: set its status (``message`` cut to 1000 characters), commit, emit
        ``finished``. ``exit_code``: None gives 0 for Succeeded, else 1. ``keep_pending``: keep
        ``snap.pending`` (a cancelled run's undecided calls). Raises what :meth:`commit` raises."""
        if not keep_pending:
            self.snap.pending = None
        self.snap.context.status = RunStatus(phase=phase, reason=reason, message=message[:1000])
        self.commit()
        self.emit("finished", message)
        if exit_code is None:
            exit_code = ExitCode.OK if phase == Phase.SUCCEEDED else ExitCode.FAILED
        return Outcome(phase, exit_code, message)

    def _outcome_of_terminal(self) -> Outcome:
        st = self.snap.context.status
        ok = st.phase == Phase.SUCCEEDED.value or (st.phase == Phase.CANCELLED.value and st.reason == "Cancelled")
        return Outcome(st.phase, ExitCode.OK if ok else ExitCode.FAILED, st.message)

    def _retry_exit(self, message: str) -> Outcome:
        return Outcome("Interrupted", ExitCode.RETRY, message)

    def emit(self, kind: str, detail: str = "", pending: PendingToolCall | None = None) -> None:
        """Send a :class:`ProgressEvent` (``kind``: one of its kinds) to ``on_event``, and log it
        (INFO: a pod's log tells the run's course); never raises."""
        # The kind only: a detail may be the run's own text (an answer, a tool's output), which
        # stays in Postgres, as it stays out of status unless statusSummary (G9).
        log.info("%s", kind)
        try:
            self.on_event(ProgressEvent(kind, self.snap.context, detail, pending))
        except (Exception, SystemExit):  # a display problem must never stop a run (rich exits 1 on a broken pipe)
            log.exception("progress callback failed")


class _InvalidSpecRunner(RunnerBase):
    """Claims a run only to end it as Failed/InvalidSpec (see :func:`fail_invalid_spec`)."""

    def __init__(self, *args: Any, message: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.message = message
        self.adapter = self.spec.adapter  # the session records the run's own adapter

    def _initial_snapshot(self, run_uid: str, *, classify: bool = True) -> StateSnapshot:
        return super()._initial_snapshot(run_uid, classify=False)  # the classifier is user code too

    def drive(self) -> Outcome:
        return self.finish(Phase.FAILED, "InvalidSpec", self.message, exit_code=ExitCode.BAD_INPUT)
