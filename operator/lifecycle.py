"""What to do next with a run's runner pods: the replacement policy (pure; the operator acts on it).

The runner commits every iteration (G1) and resumes at the exact step (G2), so a lost runner pod
costs only the time to start the next one. :func:`next_step` therefore starts the next pod
without backoff when the loss says nothing about the next attempt, and as early as it can:

- a pod that is **leaving** (``metadata.deletionTimestamp`` set: deleted, evicted, preempted,
  taken off a lost node; or a ``DisruptionTarget`` condition True) is replaced at the deletion
  event, while its runner is still stopping, not once its container has exited: the old runner
  got SIGTERM, starts no new tool call and lets go of the run within a second or so (a tool call
  in flight finishes first, for at most the grace period), and the new runner's claim waits for
  it (``runner/liveness.py``; ``AGENTFAST_WAIT_FOR_HOLDER_SECONDS``, ``workload.holder_wait_s``)
  before it takes the run over. Two runners
  may overlap for that while; only one holds the run's lock, and the fencing epoch (G6) keeps a
  runner that lost the run from committing anything. Once a newer pod exists, the leaving one
  stopping starts nothing more: the newest pod's state decides;
- a pod that stopped on its own with exit 75 ("retry me": SIGTERM, Postgres or the model
  unavailable), 143 or 137 without an OOM kill (a killed container), or any exit after the runner
  ran a while, is replaced once it has stopped; so is a leaving pod first seen past its deletion
  deadline (its node stopped answering), should no newer pod exist.

A failure that would repeat is counted and backed off (5 s, 10 s, 20 s, ... capped at 5 min), and
``restart_limit`` failures in a row fail the run: an OOM kill (the same step would need the same
memory) and a runner that dies within :data:`FAST_FAILURE_S` of starting (a broken image, a
store that refuses it). Exit 1 or 2 is the run's own ending (budget, model, bad input: the runner
committed it); exit 76 means another runner holds the run, so the next pod starts only once the
store says no runner is alive, never as a retry loop. Exit 0 with the run still waiting for a
human means the runner released its pod (``spec.suspendAfter``): the next pod starts once every
awaited call is decided. A replacement for a leaving pod is not counted (a deletion says nothing
about the next attempt) and resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from agentfast.runner.names import TERMINAL_PHASES, WAITING_PHASES, ExitCode, Phase

from .workload import ANNOTATION_ATTEMPT, ANNOTATION_COUNTED, RUNNER_CONTAINER

#: A runner that dies sooner than this after its container started failed at start (counted).
FAST_FAILURE_S = 10.0
BACKOFF_BASE_S = 5.0
BACKOFF_CAP_S = 300.0
#: A deleting pod still there this long past its deletion deadline is taken as lost (its kubelet is gone).
DELETION_SLACK_S = 5.0
#: Exit codes: the run's own ending (it committed Failed: budget, model, bad input), "retry me",
#: "another runner holds the run" (runner/names.py).
RUN_ENDED_EXITS = frozenset({ExitCode.FAILED, ExitCode.BAD_INPUT})
#: Container waiting reasons that need a person (a missing Secret, an image that cannot be pulled).
CANNOT_START = frozenset(
    {
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RunContainerError",
    }
)


@dataclass(frozen=True)
class RunnerPod:
    """What the policy needs of one runner pod (from the API's Pod object)."""

    name: str
    attempt: int
    counted: int  # failures in a row counted against the restart limit, this pod's predecessors'
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    created_at: datetime
    deletion_due: datetime | None = None  # metadata.deletionTimestamp: the pod is being deleted, gone by then
    disrupted: str | None = None  # the DisruptionTarget condition's reason (EvictionByEvictionAPI, ...)
    started_at: datetime | None = None  # the runner container's start
    exit_code: int | None = None  # the runner container terminated with this code
    exit_reason: str | None = None  # OOMKilled, Error, Completed, ...
    finished_at: datetime | None = None
    waiting_reason: str | None = None  # the runner container waits: CreateContainerConfigError, ...
    waiting_message: str = ""

    @classmethod
    def from_api(cls, pod: Any) -> RunnerPod:
        """From a ``kubernetes.client.V1Pod``."""
        meta, status = pod.metadata, pod.status
        annotations = meta.annotations or {}
        runner = next((c for c in (status.container_statuses or []) if c.name == RUNNER_CONTAINER), None) if status else None
        terminated = runner.state.terminated if runner and runner.state else None
        waiting = runner.state.waiting if runner and runner.state else None
        running = runner.state.running if runner and runner.state else None
        disrupted = (
            next(
                (
                    c.reason or "Disrupted"
                    for c in (status.conditions or [])
                    if c.type == "DisruptionTarget" and c.status == "True"
                ),
                None,
            )
            if status
            else None
        )
        return cls(
            name=meta.name,
            attempt=int(annotations.get(ANNOTATION_ATTEMPT, "1")),
            counted=int(annotations.get(ANNOTATION_COUNTED, "0")),
            phase=(status.phase if status else None) or "Pending",
            created_at=meta.creation_timestamp or datetime.now(UTC),
            deletion_due=meta.deletion_timestamp,
            disrupted=disrupted,
            started_at=(terminated.started_at if terminated else running.started_at if running else None),
            exit_code=terminated.exit_code if terminated else None,
            exit_reason=terminated.reason if terminated else None,
            finished_at=terminated.finished_at if terminated else None,
            waiting_reason=waiting.reason if waiting else None,
            waiting_message=(waiting.message or "") if waiting else "",
        )

    def leaving(self) -> bool:
        """It is going away: being deleted (``deletionTimestamp``) or marked by a disruption
        (eviction, preemption, the taint manager, the kubelet: ``DisruptionTarget`` True)."""
        return self.deletion_due is not None or self.disrupted is not None

    def stopped(self, now: datetime) -> bool:
        """Its runner is not running and will not run: ended, or deleted past its deadline."""
        if self.phase in ("Succeeded", "Failed") or self.exit_code is not None:
            return True
        return self.deletion_due is not None and now >= self.deletion_due + timedelta(seconds=DELETION_SLACK_S)

    def loss(self) -> str:
        """How the pod was lost, in a few words (Events, status)."""
        if self.exit_reason == "OOMKilled":
            return "OOM-killed"
        if self.disrupted:
            return {
                "EvictionByEvictionAPI": "evicted",
                "PreemptionByScheduler": "preempted",
                "DeletionByTaintManager": "evicted from a lost node",
            }.get(self.disrupted, f"disrupted ({self.disrupted})")
        if self.exit_code is None:
            return "deleted" if self.deletion_due is not None else "gone"
        if self.deletion_due is not None:
            return f"deleted (its runner exited {self.exit_code})"
        return f"exited {self.exit_code}" + (
            f" ({self.exit_reason})" if self.exit_reason not in (None, "Error", "Completed") else ""
        )

    def counts(self) -> bool:
        """Whether this loss counts against the restart limit (it would repeat)."""
        if self.exit_reason == "OOMKilled":
            return True
        if self.disrupted or self.deletion_due is not None or self.exit_code in (None, ExitCode.RETRY, 137, 143):
            return False
        ran = (self.finished_at - self.started_at).total_seconds() if self.finished_at and self.started_at else 0.0
        return ran < FAST_FAILURE_S


@dataclass(frozen=True)
class Step:
    """What to do: ``create`` pod ``attempt`` (carrying ``counted``; ``lost`` is the pod it
    replaces, if any); ``later`` (look again in ``delay_s``); ``fail`` the run (``reason``,
    ``message``); or ``none``. ``blocked`` = (reason, message) when the live pod cannot start;
    ``suspended`` when the run released its pod while it waits for a human."""

    action: str
    attempt: int = 0
    counted: int = 0
    lost: RunnerPod | None = None
    delay_s: float = 0.0
    reason: str = ""
    message: str = ""
    blocked: tuple[str, str] | None = None
    suspended: bool = False


def backoff_s(counted: int) -> float:
    """The wait before attempt number ``counted`` of a failure that repeats, s (0 for none)."""
    return 0.0 if counted <= 0 else min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (counted - 1))


def next_step(
    pods: list[RunnerPod], now: datetime, *, phase: str | None, all_decided: bool, runner_alive: bool, restart_limit: int
) -> Step:
    """The next step for a run in ``phase`` (None: no checkpoint yet) whose runner pods are ``pods``.

    ``all_decided``: every call the run awaits has a decision (only read while it waits);
    ``runner_alive``: the store sees a live runner holding the run (``runner/liveness.py``).
    """
    if phase in TERMINAL_PHASES:
        return Step("none")
    staying = [p for p in pods if not p.stopped(now) and not p.leaving()]
    if staying:  # a runner runs or starts (beside a leaving one, the replacement already made)
        current = max(staying, key=lambda p: p.attempt)
        if current.waiting_reason in CANNOT_START:
            return Step(
                "none",
                blocked=(
                    current.waiting_reason,
                    f"runner pod {current.name} cannot start: {current.waiting_message or current.waiting_reason}",
                ),
            )
        return Step("none")
    if not pods:
        return Step("create", attempt=1)
    last = max(pods, key=lambda p: p.attempt)
    attempt = last.attempt + 1
    if not last.stopped(now):  # the newest pod is leaving, its runner still stopping: start the next one now, beside it
        return Step("create", attempt=attempt, lost=last)
    # The newest pod has stopped (an older one may still be leaving: its runner, if alive, holds the run).
    if last.exit_code == 0 and last.deletion_due is None:
        if phase in WAITING_PHASES and not all_decided:
            return Step("none", suspended=True)
        return Step("create", attempt=attempt)  # it paused and is decided now (or ended a step early): go on
    if last.exit_code in RUN_ENDED_EXITS and last.deletion_due is None:
        return Step(
            "fail",
            reason="RunnerFailed",
            message=f"runner pod {last.name} exited {last.exit_code} before the run recorded its end",
        )
    if last.exit_code == ExitCode.LEASE_LOST and runner_alive:
        return Step(
            "later", delay_s=5.0, reason="RunnerElsewhere", message="another runner holds this run; waiting for it to end"
        )
    counted = last.counted + 1 if last.counts() else 0
    if counted > restart_limit:
        return Step(
            "fail",
            reason="RestartLimit",
            message=f"the runner failed {counted} times in a row, last {last.loss()} "
            f"(pod {last.name}); the limit is {restart_limit}",
        )
    wait = backoff_s(counted) - (now - (last.finished_at or now)).total_seconds()
    if wait > 0:
        return Step(
            "later",
            delay_s=wait,
            reason="BackingOff",
            message=f"runner pod {last.name} {last.loss()}; failure {counted} of at most {restart_limit}, next attempt in {wait:.0f} s",
        )
    return Step("create", attempt=attempt, counted=counted, lost=last)


# -- after the run: its runner pods' time to live ----------------------------------------------------

#: The condition whose ``lastTransitionTime`` says when a run reached each terminal phase.
END_CONDITIONS: dict[str, str] = {Phase.SUCCEEDED: "Ready", Phase.FAILED: "Failed", Phase.CANCELLED: "Cancelled"}


def ended_at(status: dict[str, Any], now: datetime) -> datetime:
    """When the run ended, as its AgentRun's ``status`` says: the ``lastTransitionTime`` of the
    condition of its terminal phase (written by the operator when it first published the end;
    kept in the object, so an operator restart does not reset the clock). ``now`` when status does
    not show the end yet (the reconcile asking is about to publish it) or the time is unreadable."""
    ctype = END_CONDITIONS.get(status.get("phase") or "")
    found = next(
        (
            c.get("lastTransitionTime")
            for c in status.get("conditions") or []
            if c.get("type") == ctype and c.get("status") == "True"
        ),
        None,
    )
    if not found:
        return now
    try:
        return datetime.fromisoformat(str(found).replace("Z", "+00:00"))
    except ValueError:
        return now


def expired_pods(pods: list[RunnerPod], now: datetime, *, ended: datetime, ttl_s: float) -> tuple[list[RunnerPod], float | None]:
    """The runner pods of a run that ended at ``ended`` whose time is up (the chart's
    ``runner.podTTLSecondsAfterFinished``, ``ttl_s``), and in how many seconds the next one is
    due (None: none left to wait for). A pod's time counts from the run's end, or from when its
    runner stopped if that was later (a runner exits just after it commits the end); a pod that
    never stopped (one that could not start, say) from the run's end. A pod already being deleted
    is left to its deletion."""
    due: list[RunnerPod] = []
    wait: float | None = None
    for p in pods:
        if p.deletion_due is not None:
            continue
        since = max(ended, p.finished_at) if p.finished_at is not None else ended
        left = (since - now).total_seconds() + ttl_s
        if left <= 0:
            due.append(p)
        else:
            wait = left if wait is None else min(wait, left)
    return due, wait
