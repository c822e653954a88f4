"""Names shared by the runner, the operator and the CLI: one home for each.

Phases, exit codes, the run id's format, the CRD's coordinates and the operator's Event reasons
were bare strings and numbers repeated across modules; they are named here once (issue 16 item 4).
The operator may import this module; it imports nothing of the project and only the standard
library, so the CLI pays nothing for it (tests/test_cli_imports.py). ``Phase`` and ``EventReason``
are ``StrEnum``s: each member *is* its string, so stored rows, the CRD's status, its printer
columns and CEL rules see exactly the strings they saw before; tests/test_names.py pins them
against the CRDs.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Phase(StrEnum):
    """An AgentRun's ``status.phase`` (and the phase stored in the run's ``RunStatus``).

    Source: the CRD's ``status.phase`` enum (charts/agentfast/crds/agentruns.agentfast.dev.yaml)
    and ``runner/snapshot.py``'s ``Phase`` literal, which must list the same values in this order.
    """

    #: Created; no runner has started it yet (or its runner pod is still starting).
    PENDING = "Pending"
    #: A runner holds it and iterates.
    RUNNING = "Running"
    #: A gated call awaits a human decision (approve, deny, complete) through ``spec.approvals`` or the CLI.
    WAITING_FOR_APPROVAL = "WaitingForApproval"
    #: The model asked the user a question (``ask_user``, or a question in ``spec.conversation``)
    #: and nothing else awaits a decision: the run waits for a reply (``agentfast reply``, ``spec.replies``).
    WAITING_FOR_INPUT = "WaitingForInput"
    #: Ended: the model gave its final answer.
    SUCCEEDED = "Succeeded"
    #: Ended for good: budget, deadline, a model that rejected the request, an invalid spec.
    FAILED = "Failed"
    #: Ended at a human's request (``spec.cancel``, ``agentfast cancel``) or because the AgentRun was deleted.
    CANCELLED = "Cancelled"


#: The phases of a run that waits for a human: a decision on a gated call, or a reply (docs/conversation.md).
WAITING_PHASES: frozenset[str] = frozenset({Phase.WAITING_FOR_APPROVAL, Phase.WAITING_FOR_INPUT})

#: The phases a run never leaves (its runner exits and is not replaced).
TERMINAL_PHASES: frozenset[str] = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED})


class ExitCode(IntEnum):
    """A runner process's (and the CLI's) exit code. The operator's replacement policy reads it
    (operator/lifecycle.py): 75 and 76 are never counted as a failure of the run.

    Source: the exit-code contract of runner/loop.py and runner/cli.py's module docstrings; 75 is
    sysexits.h's ``EX_TEMPFAIL`` ("try again later").
    """

    #: Finished, cancelled, or paused for approval (a decision later resumes it).
    OK = 0
    #: The run failed for good (budget, deadline, the model rejected the request).
    FAILED = 1
    #: Bad input (an invalid spec, unreadable stored state) or a refused CLI command.
    BAD_INPUT = 2
    #: The CLI could not reach Postgres at start (the runner itself says RETRY instead).
    NO_POSTGRES = 3
    #: Retry me: interrupted with nothing lost (SIGTERM, Postgres or the model unavailable, the tool
    #: host died); resume to continue. EX_TEMPFAIL.
    RETRY = 75
    #: Another runner owns the run: it took the run over (this one's lease was lost, G6), or a live
    #: runner holds it and this one refused to take it over (runner/liveness.py).
    LEASE_LOST = 76


# -- the run id ---------------------------------------------------------------------------------

#: The namespace of a run named without one (``agentfast approve NAME``), as kubectl's default.
DEFAULT_NAMESPACE = "default"


def format_run_id(namespace: str, name: str) -> str:
    """The store's key of the AgentRun ``namespace``/``name``: ``NAMESPACE/NAME``.

    Source: an AgentRun is namespaced and its name unique in its namespace; neither a namespace
    (a DNS label) nor an object name (a DNS subdomain) may hold ``/``, so the key is unambiguous.
    """
    return f"{namespace}/{name}"


def parse_run_id(ref: str, default_namespace: str = DEFAULT_NAMESPACE) -> tuple[str, str]:
    """``(namespace, name)`` of a run id (:func:`format_run_id`'s inverse) or of a bare ``NAME``, which is
    in ``default_namespace``. The name is what follows the last ``/``."""
    namespace, slash, name = ref.rpartition("/")
    return (namespace if slash else default_namespace), name


# -- the CRDs' coordinates ----------------------------------------------------------------------
# Source: charts/agentfast/crds/*.yaml (spec.group, spec.versions[].name, spec.names); the
# DESIGN's "group agentfast.dev, version v1alpha1".

GROUP = "agentfast.dev"
VERSION = "v1alpha1"
#: ``apiVersion`` of an AgentRun or a ModelConfig document.
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AgentRun"
PLURAL = "agentruns"
MODELCONFIG_KIND = "ModelConfig"
MODELCONFIG_PLURAL = "modelconfigs"


# -- Kubernetes Events ---------------------------------------------------------------------------

#: An Event's ``type`` (core/v1 Event: Normal or Warning).
EVENT_NORMAL, EVENT_WARNING = "Normal", "Warning"


class EventReason(StrEnum):
    """The ``reason`` of an Event the operator posts on an AgentRun (operator/main.py). A phase
    transition's Event has the new :class:`Phase` as its reason instead.

    Source: operator/main.py's Events, as ``kubectl describe agentrun`` shows them; the tests check
    them by their strings.
    """

    #: A run with the name of an earlier one (another uid) started; the earlier rows are kept (audit).
    EARLIER_RUN_KEPT = "EarlierRunKept"
    #: The operator created a runner pod.
    RUNNER_CREATED = "RunnerCreated"
    #: The runner pod was lost (deleted, evicted, its node gone) and a new one is being started.
    RUNNER_LOST = "RunnerLost"
    #: A new runner resumed the run after a loss.
    RESUMED = "Resumed"
    #: A decision from ``spec.approvals`` was recorded.
    DECIDED = "Decided"
    #: A ``spec.approvals`` entry voided: no binding enforces the approval admission policy, so who wrote it was not checked.
    APPROVAL_POLICY_MISSING = "ApprovalPolicyMissing"
    #: A ``spec.approvals`` key that is not a call id.
    INVALID_CALL_ID = "InvalidCallId"
    #: A ``spec.approvals`` entry without ``decidedBy``.
    UNATTRIBUTED_DECISION = "UnattributedDecision"
    #: A ``spec.approvals`` entry that contradicts the decision already recorded (decisions are write-once).
    DECISION_CONFLICT = "DecisionConflict"
    #: A ``spec.approvals`` entry for a call that does not await a decision now.
    NOT_AWAITING_DECISION = "NotAwaitingDecision"
    #: A ``spec.approvals`` entry that cannot be recorded as given (runner/decisions.py's rules).
    INVALID_DECISION = "InvalidDecision"
    #: A ``spec.approvals`` or ``spec.replies`` entry the run can no longer use: it has ended, a
    #: cancel was asked for, or it is past ``spec.activeDeadlineSeconds`` (refused, never recorded).
    DECISION_UNUSABLE = "DecisionUnusable"


#: The runner's variable (the chart's ``runner.maxIterationCrashes``): an iteration that crashed its
#: runner this many times in a row ends the run ``Failed`` with reason ``CrashLoop`` (runner/loop.py).
MAX_ITERATION_CRASHES_ENV = "AGENTFAST_MAX_ITERATION_CRASHES"
DEFAULT_MAX_ITERATION_CRASHES = 5
