"""The agentfast operator (kopf): one level-based reconcile per AgentRun.

Run it with ``kopf run --standalone --all-namespaces -m agentfast.operator.main`` (the chart's
Deployment does). Settings come from the environment (see :class:`Settings`).

- **Reconcile** (:func:`reconcile`) is level-based: it reads the AgentRun, the store and the
  runner pods, and makes them agree. It runs on create/update/resume, on every change of a runner
  pod (its runner stopped, it was deleted or evicted, it cannot start), and on a periodic resync
  (:func:`_resync_loop`), so a missed event is only a delay.
  It registers the run in the store, records ``spec.approvals`` and ``spec.replies`` as decisions (write-once, and
  a NOTIFY wakes the waiting runner), starts the next runner pod when the run needs one
  (``operator/lifecycle.py``: at the deletion event of a leaving pod, at once after a loss,
  backed off only from failures that repeat;
  one name per attempt, so a retry after the operator was killed mid-create gets 409, never a
  second runner), and publishes ``status``.
- **Progress** reaches ``status`` within a second or two of the runner's commit: a background
  thread LISTENs on ``agentfast_progress`` and republishes that run's status; the runner itself
  needs no Kubernetes credentials.
- **Status** has one writer, :func:`publish_status`, used by both paths; it posts a Kubernetes
  Event for each phase transition.
- **Ended runs**: their remaining runner pods (and NetworkPolicy) are deleted
  ``runner.podTTLSecondsAfterFinished`` after the end (:func:`_collect_runner_pods`), by a
  delayed reconcile (:func:`_look_again`), never by the resync, which skips ended runs.
- **Deletion**: the runner pods are garbage-collected through ownerReferences. With
  ``AGENTFAST_DELETE_DATA=true`` a finalizer makes sure the run's rows in Postgres go too;
  otherwise no finalizer is added (a delete never hangs on a stopped operator) and the data is
  kept for audit.
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, cast

import kopf
import kubernetes
import psycopg
from kubernetes.client.exceptions import ApiException

from agentfast.runner import logs
from agentfast.runner.adapters import register_fork
from agentfast.runner.decisions import InvalidDecision
from agentfast.runner.errors import AgentfastError
from agentfast.runner.liveness import runner_state, runs_held
from agentfast.runner.names import (
    API_VERSION,
    EVENT_NORMAL,
    EVENT_WARNING,
    GROUP,
    KIND,
    MODELCONFIG_PLURAL,
    PLURAL,
    TERMINAL_PHASES,
    VERSION,
    WAITING_PHASES,
    EventReason,
    Phase,
    format_run_id,
    parse_run_id,
)
from agentfast.runner.spec import (
    CALL_ID_PATTERN,
    DEFAULT_ALLOWED_MODULES,
    AgentRun,
    SpecError,
    allowed_modules_from_env,
    bundled_scripts,
    check_cluster_policy,
    mcp_commands_from_env,
    mcp_env_from_env,
    mcp_servers_from_env,
    parse_agentrun,
    parse_modelconfig,
    resolve_model_config,
)
from agentfast.runner.store import (
    PROGRESS_CHANNEL,
    DecisionConflict,
    DecisionUnusable,
    ForkRefused,
    InvalidDsn,
    RunExists,
    RunMark,
    Store,
    StoreUnavailable,
    UnknownCall,
    UnreadableState,
    cancelled_message,
    deadline_message,
)

from . import metrics, notify
from .credentials import ensure_runner_secret, revoke_unused
from .credentials import forget as forget_credential
from .identity import ensure_runner_service_account
from .lifecycle import RunnerPod, Step, ended_at, expired_pods, next_step
from .status import MAX_DECISIONS, status_from_store
from .workload import (
    ANNOTATION_RUN,
    API_TIMEOUT_S,
    LABEL_RUN,
    LABEL_RUN_UID,
    RUNNER_SECRET,
    EgressPolicy,
    RunnerConfig,
    build_network_policy,
    build_pod,
    pod_name,
    read_or_none,
    runner_name,
    runner_settings,
)

log = logging.getLogger("agentfast.operator")


@dataclass
class Settings:
    """Operator settings (environment variables in brackets)."""

    dsn: str = field(default_factory=lambda: os.environ.get("AGENTFAST_DSN", ""), repr=False)  # [AGENTFAST_DSN]; never in a repr
    delete_data: bool = field(default_factory=lambda: os.environ.get("AGENTFAST_DELETE_DATA", "false").lower() == "true")
    resync_s: float = field(default_factory=lambda: float(os.environ.get("AGENTFAST_RESYNC_SECONDS", "30")))
    # Namespaces to resync; empty: all (the chart sets it with the kopf --namespace flags).
    namespaces: list[str] = field(
        default_factory=lambda: [n for n in os.environ.get("AGENTFAST_WATCH_NAMESPACES", "").split(",") if n]
    )
    runner: RunnerConfig = field(default_factory=RunnerConfig.from_env)
    # Module prefixes refs may name (the chart's runner.allowedModules); never imported here (G12).
    allowed_modules: tuple[str, ...] = field(default_factory=lambda: _allowed_modules())  # [AGENTFAST_ALLOWED_MODULES]
    # The chart's mcp.servers (name -> URL) and mcp.allowedCommands (docs/mcp.md); never connected to here (G12).
    mcp_servers: dict[str, str] = field(default_factory=lambda: mcp_servers_from_env())  # [AGENTFAST_MCP_SERVERS]
    mcp_commands: tuple[str, ...] = field(default_factory=lambda: mcp_commands_from_env())  # [AGENTFAST_MCP_ALLOWED_COMMANDS]
    # The chart's mcp.allowedEnv: the variable names a run may give a stdio MCP server (none by default).
    mcp_env: tuple[str, ...] = field(default_factory=lambda: mcp_env_from_env())  # [AGENTFAST_MCP_ALLOWED_ENV]
    # Copy the runner's own text (the final answer, a model's error) into status.message/result
    # and Events (the chart's operator.statusSummary); off: only our own sentences, ids and counts.
    status_summary: bool = field(default_factory=lambda: os.environ.get("AGENTFAST_STATUS_SUMMARY", "false").lower() == "true")
    # The ValidatingAdmissionPolicy that checks who decides (the chart's <release>-approvals): a
    # spec.approvals entry is recorded only while it exists and a binding enforces it (Deny).
    approval_policy: str = field(default_factory=lambda: os.environ.get("AGENTFAST_APPROVAL_POLICY", "agentfast-approvals"))
    # Rows of an ended run whose AgentRun is gone are deleted after this, s (chart
    # operator.ttlSecondsAfterFinished; a run's spec.ttlSecondsAfterFinished wins; 0: keep).
    ttl_after_finished_s: int = field(default_factory=lambda: int(os.environ.get("AGENTFAST_TTL_SECONDS_AFTER_FINISHED", "0")))
    # Re-key each namespace's runner credential when it is older than this, s (chart
    # runner.credentialRotationHours; 0: never).
    credential_rotation_s: float = field(
        default_factory=lambda: float(os.environ.get("AGENTFAST_CREDENTIAL_ROTATION_HOURS", "168")) * 3600
    )
    # A NetworkPolicy per runner pod (the chart's networkPolicy.enabled); None: none.
    egress: EgressPolicy | None = field(default_factory=EgressPolicy.from_env)  # [AGENTFAST_NETWORK_POLICY]


def _allowed_modules() -> tuple[str, ...]:
    found = allowed_modules_from_env()
    return DEFAULT_ALLOWED_MODULES if found is None else found


SETTINGS = Settings()
#: Progress publishes in flight at once: each waits mostly on Postgres and the API server, so a
#: few overlap well on one core (bench/cluster_load.py: 4 could not keep up with 100 commits/s).
PUBLISH_WORKERS = 8
#: The operator's Postgres connections: the publishers, plus the resync, kopf's handlers and the
#: delayed reconciles.
STORE_CONNECTIONS = PUBLISH_WORKERS + 4


class _State:
    store: Store | None = None
    custom: kubernetes.client.CustomObjectsApi
    admission: kubernetes.client.AdmissionregistrationV1Api
    core: kubernetes.client.CoreV1Api
    networking: kubernetes.client.NetworkingV1Api
    stop = threading.Event()
    # (sessions opened, listening now) of the progress listener: the resync trusts the listener
    # to have published every commit only while one session lasted since its previous pass.
    listening: tuple[int, bool] = (0, False)


STATE = _State()


# -- wiring ------------------------------------------------------------------------------------


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf's settings for this operator: where it keeps its progress (annotations), how it
    watches (timeouts, runner pods only) and whether it observes the cluster (not when it serves
    named namespaces: ``AGENTFAST_WATCH_NAMESPACES``)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="agentfast.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="agentfast.dev", key="last-handled-configuration"
    )
    settings.persistence.finalizer = "agentfast.dev/cleanup"
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's say only on trouble
    # kopf logs every handler's success per object at INFO: thousands of lines a minute with 1,000
    # runs (CPU, and the container log rotated away within minutes). Its warnings and errors stay.
    logging.getLogger("kopf.objects").setLevel(os.environ.get("AGENTFAST_KOPF_LOG_LEVEL", "WARNING"))
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.inactivity_timeout = 300  # re-open a silently stalled watch
    # Named namespaces (operator.watchNamespaces): the chart grants a Role in each and nothing
    # cluster-wide to list namespaces or CRDs, so kopf serves exactly those names and the
    # resources present at start, without trying (and warning) to observe the cluster.
    settings.scanning.disabled = bool(SETTINGS.namespaces)
    # Watch runner pods only, filtered by the API server, not every pod of the cluster.
    settings.watching.label_selectors[lambda r: r.group == "" and r.plural == "pods"] = f"{LABEL_RUN_UID},{LABEL_RUN}"


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    logs.reformat_handlers()  # kopf's own log handler, with our JSON or console lines (runner/logs.py)
    configure_kopf(settings)
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    STATE.custom = kubernetes.client.CustomObjectsApi()
    STATE.core = kubernetes.client.CoreV1Api()
    STATE.admission = kubernetes.client.AdmissionregistrationV1Api()
    STATE.networking = kubernetes.client.NetworkingV1Api()
    if not SETTINGS.dsn:
        raise kopf.PermanentError("AGENTFAST_DSN is not set: the operator needs the runs' Postgres")
    try:
        STATE.store = Store(SETTINGS.dsn, pool_max=STORE_CONNECTIONS)
        STATE.store.migrate()
    except InvalidDsn as err:  # quotes none of the DSN; retrying cannot help
        raise kopf.PermanentError(f"AGENTFAST_DSN: {err}") from None
    except StoreUnavailable as err:  # e.g. the bundled Postgres is still starting: kopf retries
        raise kopf.TemporaryError(str(err), delay=5) from None
    metrics.collect_store(STATE.store)  # the acting replica serves the runs' figures (operator/metrics.py)
    STATE.stop.clear()
    notify.start(
        SETTINGS.dsn, STATE.stop, lambda run, msg: _event({"metadata": run}, EVENT_WARNING, notify.EVENT_REASON_FAILED, msg)
    )
    for target in (_progress_listener, _resync_loop):
        threading.Thread(target=target, name=f"agentfast{target.__name__}", daemon=True).start()


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    STATE.stop.set()
    if STATE.store is not None:
        STATE.store.close()


@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-create")
@kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile-update")
@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-resume")
def on_agentrun(body: kopf.Body, **_: Any) -> None:
    run_id = format_run_id(body["metadata"]["namespace"], body["metadata"]["name"])
    with metrics.reconciling("agentrun"), logs.bound(run=run_id):
        reconcile(dict(body))


@kopf.on.event("", "v1", "pods", labels={LABEL_RUN_UID: kopf.PRESENT, LABEL_RUN: kopf.PRESENT})
def on_runner_pod(body: kopf.Body, **_: Any) -> None:
    """A runner pod changed (its runner stopped, it is being deleted or evicted, it cannot start):
    reconcile its run at once, so a lost runner is replaced within the watch's latency."""
    meta = body["metadata"]
    # The label holds the name only when it fits a label (63 characters); the annotation always does.
    name = (meta.get("annotations") or {}).get(ANNOTATION_RUN) or meta["labels"][LABEL_RUN]
    # as the watch showed it last
    run = _BODIES.get(format_run_id(meta["namespace"], name)) or _get_agentrun(meta["namespace"], name)
    if run is not None and run["metadata"]["uid"] == meta["labels"][LABEL_RUN_UID]:  # not a pod of an earlier run of that name
        with metrics.reconciling("runner_pod"), logs.bound(run=format_run_id(meta["namespace"], name)):
            reconcile(run)


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_agentrun_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    """An AgentRun is gone (the watch's DELETED event; no finalizer is needed for it): a run that
    had not ended is ``Cancelled`` in the store, its rows kept (unless deleteDataOnDelete removed
    them already), any runner still holding it fenced off."""
    meta = body["metadata"]
    key = format_run_id(meta.get("namespace"), meta.get("name"))
    if event.get("type") != "DELETED":
        _BODIES[key] = dict(body)  # the progress path publishes from it, without a GET per commit
        return
    if _BODIES.get(key, {}).get("metadata", {}).get("uid") == meta.get("uid"):
        _BODIES.pop(key, None)
    _forget_run(str(meta.get("uid")))
    if STATE.store is None:
        return
    run_id = format_run_id(meta["namespace"], meta["name"])
    record = STATE.store.get_run(run_id)
    if record is not None and record.run_uid == meta.get("uid"):  # not a newer AgentRun of that name
        STATE.store.cancel_run(run_id, f"the AgentRun {meta['name']} was deleted before the run ended; nothing more runs")


@kopf.on.delete(GROUP, VERSION, PLURAL, id="delete-data", optional=not SETTINGS.delete_data)
def on_delete(body: kopf.Body, **_: Any) -> None:
    if SETTINGS.delete_data and STATE.store is not None:
        STATE.store.delete_run(format_run_id(body["metadata"]["namespace"], body["metadata"]["name"]))


# -- the reconcile ---------------------------------------------------------------------------------


def reconcile(body: dict[str, Any]) -> None:
    """Make the store, the runner pods and ``status`` agree with the AgentRun ``body``.

    Raises kopf.TemporaryError when Postgres is unreachable (kopf retries with backoff).
    """
    assert STATE.store is not None
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        # Being deleted: nothing is registered, decided or (re)created for it any more (a pod
        # event during deletion would otherwise re-create rows the delete handler removed).
        return
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    run_id = format_run_id(namespace, name)
    doc = {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        # spec.approvals, spec.replies and spec.cancel are requests, recorded in the store, not the run's definition.
        "spec": {k: v for k, v in body.get("spec", {}).items() if k not in ("approvals", "replies", "cancel")},
    }
    admitted = (uid, meta.get("generation", 1))
    record = _ADMITTED.get(admitted)
    if record is None:
        try:
            # G12: the shape and the admin's allow-list only; nothing the spec names is imported or
            # read here. Whether its refs resolve is learned in the runner pod (Failed/InvalidSpec).
            run = parse_agentrun(doc, check_imports=False)
            check_cluster_policy(
                run,
                SETTINGS.allowed_modules,
                bundled_scripts(),
                mcp_servers=SETTINGS.mcp_servers,
                mcp_commands=SETTINGS.mcp_commands,
                mcp_env=SETTINGS.mcp_env,
            )
            runner_settings(doc, SETTINGS.runner)  # spec.runner: an allowed image (by name only), a request within its limit
            doc = _with_model_config(run, doc, run_id, uid)
        except ModelConfigNotFound as err:  # an admin may still create it: the resync retries
            publish_status(body, None, None, override=(Phase.PENDING, "ModelConfigNotFound", str(err)))
            return
        except SpecError as err:  # permanent: nothing to run, nothing to retry
            publish_status(body, None, None, override=(Phase.FAILED, "InvalidSpec", str(err)))
            return
        except StoreUnavailable as err:
            raise kopf.TemporaryError(f"Postgres unavailable: {err}", delay=10) from None
    try:
        if record is None:
            try:
                record = _register(body, run_id, doc)
            except (ForkRefused, RunExists) as err:  # spec.forkFrom names no state to start from: permanent
                publish_status(body, None, None, override=(Phase.FAILED, "InvalidSpec", str(err)))
                return
            _ADMITTED[admitted] = record
        _record_approvals(body, run_id)
        _end_if_asked(body, run_id)
        ctx, pending, extra = _load_status(run_id)
    except StoreUnavailable as err:
        raise kopf.TemporaryError(f"Postgres unavailable: {err}", delay=10) from None
    except UnreadableState as err:  # a newer release's (or a corrupt) checkpoint: never acted on, never half-read
        publish_status(body, None, None, override=(Phase.FAILED, "UnreadableState", str(err)))
        return
    override, pod_info = None, None
    if ctx is None or ctx.status.phase not in TERMINAL_PHASES:
        try:
            ensure_runner_secret(namespace, STATE.store, STATE.core, SETTINGS.dsn)  # before its first pod needs it
            # runner.serviceAccount.create
            ensure_runner_service_account(namespace, STATE.core, SETTINGS.runner, timeout_s=API_TIMEOUT_S)
            with _lock_for(f"pods:{uid}"):  # one decision at a time per run: never two pods for one attempt
                override, pod_info = _drive_runner(body, record, ctx, pending, extra)
        except StoreUnavailable as err:
            raise kopf.TemporaryError(f"Postgres unavailable: {err}", delay=10) from None
    if (override[0] if override else ctx.status.phase if ctx is not None else None) in TERMINAL_PHASES:
        deleted_at = _collect_runner_pods(body)
        if deleted_at is not None:
            old = body.get("status") or {}
            pod_info = {
                **(pod_info or {"name": old.get("runnerPod"), "suspended": False, "blocked": None}),
                "deleted_at": deleted_at,
            }
    publish_status(body, ctx, pending, override=override, pod=pod_info, **extra)
    _RECONCILED_AT[uid] = time.monotonic()


#: (uid, generation) -> the run's registered record, once its spec was validated and registered. The
#: spec is immutable but for approvals, replies and cancel (CEL), which are requests, not the run's
#: definition, so a run is validated and registered once per generation, not on every reconcile.
_ADMITTED: dict[tuple[str, int], Any] = {}


def _register(body: dict[str, Any], run_id: str, doc: dict[str, Any]) -> Any:
    """Register the run ``doc`` in the store (idempotent) and return its record. An earlier
    AgentRun of the same name whose rows were kept is archived under another id first, never
    wiped (audit), with an EarlierRunKept Event. Raises StoreUnavailable."""
    assert STATE.store is not None
    uid = body["metadata"]["uid"]
    fork = (doc.get("spec") or {}).get("forkFrom")

    def create() -> Any:
        if fork is None:
            return STATE.store.create_run(run_id, uid, doc)  # type: ignore[union-attr]
        # spec.forkFrom (docs/fork.md): the run starts as a copy of its source's state, same namespace only
        # (parse_agentrun refused another). Only rows are copied: nothing the spec names is imported (G12).
        return register_fork(STATE.store, parse_agentrun(doc, check_imports=False), run_id, uid, doc)  # type: ignore[arg-type]

    record = create()
    if record.run_uid != uid:
        kept_as = STATE.store.archive_run(run_id)
        record = create()
        _event(
            body,
            EVENT_NORMAL,
            EventReason.EARLIER_RUN_KEPT,
            f"the rows of an earlier AgentRun named {body['metadata']['name']} are kept as"
            f" {kept_as} (agentfast history {kept_as})",
        )
    return record


def _forget_run(uid: str) -> None:
    """Drop what the operator keeps in memory about the AgentRun ``uid`` (it was deleted)."""
    for key in [k for k in _ADMITTED if k[0] == uid]:
        _ADMITTED.pop(key, None)
    for table in (_EMITTED, _LOST_AT, _RESUMED, _RESYNCED, _RECONCILED_AT):
        table.pop(uid, None)


def idle_due(body: dict[str, Any], pending: Any, now_ms: int | None = None) -> bool:
    """Whether ``spec.conversationIdleTimeout`` (s) has passed for the run's awaited calls
    ``pending`` (a PendingToolCall): every one is a question to the person, the latest asked that
    long ago (``requested_at``, ms; ``now_ms`` default: now). A run suspended while it waits
    (no runner pod) then gets a runner again, which ends the conversation (IdleTimeout)."""
    timeout = (body.get("spec") or {}).get("conversationIdleTimeout")
    if not isinstance(timeout, int) or pending is None or not pending.awaiting:
        return False
    if not all(a.reason == "awaiting_input" for a in pending.awaiting):
        return False
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    latest: int = max(a.requested_at for a in pending.awaiting)
    return now_ms >= latest + timeout * 1000


def _drive_runner(
    body: dict[str, Any], record: Any, ctx: Any, pending: Any, extra: dict[str, Any]
) -> tuple[tuple[str, str, str] | None, dict[str, Any]]:
    """Act on :func:`lifecycle.next_step` for the run's runner pods: create the next one (with a
    RunnerLost Event when it replaces a lost one), look again later (backoff, another runner still
    holding the run), or fail the run. Returns ``(override, pod)`` for publish_status."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    pods = [
        RunnerPod.from_api(p)
        for p in STATE.core.list_namespaced_pod(
            namespace, label_selector=f"{LABEL_RUN_UID}={uid}", _request_timeout=API_TIMEOUT_S
        ).items
    ]
    decided = extra.get("decided") or {}
    now = datetime.now(UTC)
    runner = extra.get("runner")
    step = next_step(
        pods,
        now,
        phase=ctx.status.phase if ctx is not None else None,
        all_decided=pending is not None and (all(c in decided for c in pending.call_ids) or idle_due(body, pending)),
        runner_alive=bool(runner is not None and runner.alive),
        restart_limit=SETTINGS.runner.restart_limit,
    )
    latest = max(pods, key=lambda p: p.attempt).name if pods else None
    info: dict[str, Any] = {"name": latest, "suspended": step.suspended, "blocked": step.blocked}
    if step.blocked and step.blocked[0] == "CreateContainerConfigError" and f'"{RUNNER_SECRET}"' in step.blocked[1]:
        # Our own Secret is missing although ensure_runner_secret trusted it (its namespace was
        # deleted and made again within credentials.RECHECK_S): make it now; the kubelet retries.
        forget_credential(namespace)
        ensure_runner_secret(namespace, STATE.store, STATE.core, SETTINGS.dsn)
    if step.action == "create":
        lost_at = None
        if step.lost is not None:
            lost_at = step.lost.finished_at or now
            at = f" at iteration {ctx.counters.iterations}" if ctx is not None else ""
            _event(
                body,
                EVENT_WARNING,
                EventReason.RUNNER_LOST,
                f"runner pod {step.lost.name} {step.lost.loss()}{at}; starting "
                f"{pod_name(name, step.attempt)}" + (f" (failure {step.counted} in a row)" if step.counted else ""),
            )
        elif ctx is not None and ctx.status.phase not in WAITING_PHASES:
            lost_at = now  # its pod vanished before we saw it stop
            _event(
                body,
                EVENT_WARNING,
                EventReason.RUNNER_LOST,
                f"the runner pod of this run is gone; starting {pod_name(name, step.attempt)}",
            )
        if lost_at is not None:
            _LOST_AT[uid] = lost_at
        try:
            _create_pod(body, (record.spec.get("modelConfig") or {}).get("apiKeySecretRef"), step, lost_at)
        except RunnerPodRefused as err:  # a missing ServiceAccount, a quota: say so, try again in 30 s
            info["blocked"] = ("RunnerPodRefused", str(err))
            _look_again(namespace, name, 30)
            return None, info
        _prune_pods(namespace, pods, keep_from=step.attempt - 1)
        info["name"] = pod_name(name, step.attempt)
    elif step.action == "later":
        info["blocked"] = (step.reason, step.message)
        _look_again(namespace, name, step.delay_s)
    elif step.action == "fail":
        # Recorded as the run's ending in the store, as a runner records its own: the run stays
        # Failed whatever becomes of its pods (once deleted, by hand or after their time to live,
        # they would otherwise read as "no pod yet" and start it again), and `agentfast status`
        # says what the AgentRun says.
        assert STATE.store is not None
        STATE.store.end_run(format_run_id(namespace, name), Phase.FAILED, step.reason, step.message)
        return (Phase.FAILED, step.reason, step.message), info
    return None, info


#: uid -> when its runner pod was lost, for the Resumed Event's "time lost" (in memory: after an
#: operator restart a Resumed Event just lacks the figure).
_LOST_AT: dict[str, datetime] = {}


class _Later:
    """Delayed reconciles: at most one pending per AgentRun (the earliest asked for), kept in a
    heap served by one thread rather than a thread per pending wake-up, since many runs may wait
    at once, and for long (a backoff of up to 5 min; an ended run, for its pods' time to live:
    an hour by default). Due reconciles run on a few workers, so one slow API call does not hold
    up the others. In memory: after a restart kopf's resume pass reconciles every AgentRun, which
    asks again for what is still due."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._due: dict[str, float] = {}  # NS/NAME -> time.monotonic() when due
        self._heap: list[tuple[float, str]] = []
        self._thread: threading.Thread | None = None
        self._workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentfast-later")

    def add(self, key: str, delay_s: float) -> None:
        due = time.monotonic() + max(0.5, delay_s)
        with self._cv:
            if key in self._due and self._due[key] <= due:
                return
            self._due[key] = due
            heapq.heappush(self._heap, (due, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="agentfast-later", daemon=True)
                self._thread.start()
            self._cv.notify()

    def pending(self) -> dict[str, float]:
        """NS/NAME -> seconds until its reconcile (for tests and logs)."""
        now = time.monotonic()
        with self._cv:
            return {k: due - now for k, due in self._due.items()}

    def _serve(self) -> None:
        while True:
            with self._cv:
                while True:
                    while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
                        heapq.heappop(self._heap)  # superseded by an earlier one, or fired
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        _, key = heapq.heappop(self._heap)
                        del self._due[key]
                        break
                    self._cv.wait(wait)
            self._workers.submit(self._fire, key)

    @staticmethod
    def _fire(key: str) -> None:
        namespace, name = parse_run_id(key)
        try:
            run = _get_agentrun(namespace, name)
            if run is not None:
                reconcile(run)
        except Exception:
            log.exception("the delayed reconcile of %s failed", key)


_LATER = _Later()


def _look_again(namespace: str, name: str, delay_s: float) -> None:
    """Reconcile the AgentRun again in ``delay_s`` (at least 0.5 s; one pending per run, the
    earliest asked for)."""
    _LATER.add(format_run_id(namespace, name), delay_s)


class ModelConfigNotFound(AgentfastError):
    """The ModelConfig an AgentRun names does not exist (yet) in its namespace. ``str(err)`` is
    the sentence status shows."""


def _with_model_config(run: AgentRun, doc: dict[str, Any], run_id: str, uid: str) -> dict[str, Any]:
    """The document to register for ``run``: for a run already registered under this uid, the
    registered one (a run keeps the ModelConfig it started with; see docs/architecture.md); for a
    new run naming ``spec.model.config``, ``doc`` plus ``modelConfig``, the non-secret part of that
    ModelConfig read now from the run's namespace (:func:`resolve_model_config`: nothing it names
    is read or fetched, and the operator never reads a Secret); ``doc`` itself for a scripted run.

    Raises ModelConfigNotFound (run stays Pending), SpecError (the model is not one the
    ModelConfig allows, or it names the DSN's Secret key: Failed/InvalidSpec), StoreUnavailable.
    """
    if run.spec.model.config is None:
        return doc
    assert STATE.store is not None
    existing = STATE.store.get_run(run_id)
    if existing is not None and existing.run_uid == uid and existing.spec.get("modelConfig"):
        return existing.spec
    namespace, name = run.metadata.namespace, run.spec.model.config
    obj = read_or_none(STATE.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, MODELCONFIG_PLURAL, name)
    if obj is None:
        raise ModelConfigNotFound(
            f"spec.model.config names ModelConfig {name!r}, which does not exist in namespace {namespace!r};"
            " the run starts once an admin creates it (kubectl get modelconfigs)"
        )
    resolved = resolve_model_config(run, parse_modelconfig(obj))
    key = resolved.modelConfig.apiKeySecretRef if resolved.modelConfig else None
    if key is not None and (
        (key.name, key.key) == (SETTINGS.runner.dsn_secret, SETTINGS.runner.dsn_secret_key) or key.name == RUNNER_SECRET
    ):
        raise SpecError(
            f"spec.model.config: ModelConfig {name!r} names the Secret key holding the runs' Postgres DSN"
            f" ({key.name}/{key.key}) as its API key; refused"
        )
    return resolved.model_dump(mode="json", exclude_none=True, exclude={"status"})


def _load_status(run_id: str) -> tuple[Any, Any, dict[str, Any]]:
    """``(ctx, pending, extra)`` for publish_status: the latest checkpoint, and in ``extra`` whether
    a runner is alive and the decisions already recorded for the paused batch (two cheap queries).
    Raises UnreadableState, StoreUnavailable."""
    assert STATE.store is not None
    loaded = STATE.store.load_context(run_id)
    if loaded is None:
        return None, None, {}
    ctx, pending = loaded
    found = STATE.store.get_decisions(run_id, pending.call_ids) if pending is not None else {}
    # A run that still reads Waiting... but can use no decision (past its deadline, a cancel asked
    # for): status says why and lists no call as pending, so the admission policy admits none.
    closed = STATE.store.decisions_closed(run_id) if ctx.status.phase in WAITING_PHASES else None
    return (
        ctx,
        pending,
        {
            "runner": runner_state(STATE.store, run_id),
            "decided": {c: d.decision for c, d in found.items()},
            "decisions": STATE.store.decision_log(run_id, last=MAX_DECISIONS),
            "closed": (closed.reason, closed.message) if closed is not None else None,
        },
    )


_warned: set[tuple[str, str]] = set()
#: How a decision made through spec.approvals is attributed in the store: this prefix and the
#: user name the admission policy checked against the requesting user (``kubernetes:alice``).
KUBE_DECIDER_PREFIX = "kubernetes:"


_policy_checked: dict[str, Any] = {"at": -1e9, "missing": None}
POLICY_RECHECK_S = 10.0


def approval_policy_missing() -> str | None:
    """Why decisions from ``spec.approvals`` cannot be trusted now, or None when the admission
    policy ``SETTINGS.approval_policy`` exists and a binding enforces it (validationActions has
    Deny; a binding with matchResources is assumed to cover the run's namespace). Only the
    policy checks the approval right and that decidedBy is the requesting user; without it, an
    entry is whatever its writer claimed. Checked at most every :data:`POLICY_RECHECK_S` s.
    Raises kubernetes ApiException on an API error other than 404 (a transient error must not
    void decisions).
    """
    now = time.monotonic()
    if now - _policy_checked["at"] < POLICY_RECHECK_S:
        cached: str | None = _policy_checked["missing"]
        return cached
    name = SETTINGS.approval_policy
    try:
        STATE.admission.read_validating_admission_policy(name, _request_timeout=API_TIMEOUT_S)
        bindings = STATE.admission.list_validating_admission_policy_binding(_request_timeout=API_TIMEOUT_S).items
    except ApiException as err:
        if err.status != 404:
            raise
        missing: str | None = f"the admission policy {name} is not installed"
    else:
        enforcing = [b for b in bindings if b.spec and b.spec.policy_name == name and "Deny" in (b.spec.validation_actions or [])]
        missing = None if enforcing else f"no binding enforces the admission policy {name} (validationActions: [Deny])"
    _policy_checked.update(at=now, missing=missing)
    return missing


def _decisions_in_spec(body: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """The human decisions an AgentRun's spec carries, as ``(field, call id, entry)``:
    ``spec.approvals`` (call id -> ``{decision, reason, result, decidedBy}``) and ``spec.replies``
    (a list of ``{callId, text, repliedBy}``, each taken as ``{decision: reply, result: text,
    decidedBy: repliedBy}``, or ``{callId, end: true, repliedBy}``, taken as ``{decision: end}``:
    the person ends the conversation). An entry that is not a mapping is skipped (the CRD's schema holds)."""
    spec = body.get("spec", {})
    found = [("spec.approvals", k, d) for k, d in (spec.get("approvals") or {}).items() if isinstance(d, dict)]
    for r in spec.get("replies") or []:
        if isinstance(r, dict):
            if r.get("end") is True:  # the person ends the conversation at this question
                entry = {"decision": "end", "result": None, "decidedBy": r.get("repliedBy")}
            else:
                entry = {"decision": "reply", "result": r.get("text"), "decidedBy": r.get("repliedBy")}
            found.append(("spec.replies", str(r.get("callId", "")), entry))
    return found


def _record_approvals(body: dict[str, Any], run_id: str) -> None:
    """Record ``spec.approvals`` and ``spec.replies`` in the store, whose rules decide
    (Store.decide): only for a call awaiting a decision (a reply: a question) now, once. Replays
    of a recorded decision (every reconcile) are no-ops; a refused entry gets at most one Warning
    Event per (run, key) in an operator's life, whatever the reason and however many reconciles
    see it. A key that is not a call id is never sent to the store (the CRD bounds how many
    entries there can be). An entry the run can no longer use (it has ended, a cancel was asked
    for, it is past ``spec.activeDeadlineSeconds``: ``DecisionUnusable``) is refused with that
    reason in a Warning Event ``DecisionUnusable`` and voided, never recorded.

    While the admission policy is missing or not enforced (:func:`approval_policy_missing`), no
    entry is recorded and every undecided one is voided for good (``Store.void_decision``): it
    was admitted without the check of who wrote it, and must not fire once the policy is back."""
    entries = _decisions_in_spec(body)
    if entries and (missing := approval_policy_missing()):
        for field_name, call_id, _ in entries:
            if re.match(CALL_ID_PATTERN, call_id) and STATE.store.get_decision(run_id, call_id) is None:  # type: ignore[union-attr]
                STATE.store.void_decision(run_id, call_id, f"written while {missing}")  # type: ignore[union-attr]
                _warn_once(
                    body,
                    call_id,
                    EventReason.APPROVAL_POLICY_MISSING,
                    f"{field_name}: {call_id} is void: {missing}, so who wrote it was not checked; it is never recorded",
                )
        return
    shown = {
        p.get("callId"): p.get("argumentsDigest")
        for p in (body.get("status") or {}).get("pendingApprovals") or []
        if isinstance(p, dict)
    }
    for field_name, call_id, d in entries:
        if not re.match(CALL_ID_PATTERN, call_id):
            _warn_once(
                body,
                call_id,
                EventReason.INVALID_CALL_ID,
                f"{field_name}: {call_id[:48]!r} is not a call id (e.g. call-2-0); ignored",
            )
            continue
        decider = d.get("decidedBy")
        if not isinstance(decider, str) or not decider:
            # The CRD requires decidedBy/repliedBy and the admission policy checks it against the
            # requesting user; an entry without one was written past both, so it is nobody's decision.
            _warn_once(body, call_id, EventReason.UNATTRIBUTED_DECISION, f"{field_name}: {call_id} names nobody; ignored")
            continue
        try:
            made = STATE.store.decide(  # type: ignore[union-attr]
                run_id,
                call_id,
                d.get("decision", ""),
                reason=d.get("reason"),
                result=d.get("result"),
                decided_by=f"{KUBE_DECIDER_PREFIX}{decider}",
                once=True,
                # G13: bound to the arguments the decider was shown: the digest the entry names
                # (kubectl agentfast and the inbox send the one they displayed), else the one
                # status showed when the entry was written; the store refuses it if the call's
                # arguments are not those now, and the runner runs the call only with them.
                arguments_digest=_digest_or_none(d.get("argumentsDigest")) or shown.get(call_id),
            )
            _event(body, EVENT_NORMAL, EventReason.DECIDED, f"{call_id} ({made.decision}) decided by {decider}"[:1024])
        except DecisionConflict as err:
            if not err.same:
                _warn_once(body, call_id, EventReason.DECISION_CONFLICT, str(err))
        except DecisionUnusable as err:  # past the deadline, cancelled, ended: refused with why, never recorded
            _warn_once(body, call_id, EventReason.DECISION_UNUSABLE, f"{field_name}: {err}")
        except UnknownCall as err:
            _warn_once(body, call_id, EventReason.NOT_AWAITING_DECISION, str(err))
        except InvalidDecision as err:
            _warn_once(body, call_id, EventReason.INVALID_DECISION, f"{call_id}: {err}")


def _digest_or_none(value: Any) -> str | None:
    """``value`` if it is a digest as runner/arguments.py writes them (the CRD's pattern), else None."""
    return value if isinstance(value, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", value) else None


def cancel_requester(body: dict[str, Any]) -> str:
    """Who set ``spec.cancel``, as far as the object tells: the field manager that owns the field
    (``kubectl-patch``, ``kubectl-agentfast``...), from ``metadata.managedFields``. The user is not
    known here (no admission policy attributes spec.cancel, unlike a decision); the API server's
    audit log has it."""
    managers = [
        m
        for m in body.get("metadata", {}).get("managedFields") or []
        if "f:cancel" in ((m.get("fieldsV1") or {}).get("f:spec") or {})
    ]
    manager = max(managers, key=lambda m: m.get("time") or "").get("manager") if managers else None
    return "kubernetes (spec.cancel" + (f", field manager {manager})" if manager else ")")


def _end_if_asked(body: dict[str, Any], run_id: str) -> None:
    """The operator's part of ``spec.cancel`` and ``spec.activeDeadlineSeconds`` for a run not yet
    ended (a no-op otherwise, and when neither is set).

    ``spec.cancel: true`` is recorded as the run's cancel request (``Store.request_cancel``,
    idempotent; it wakes a runner waiting for a decision). A live runner carries it out at its
    next safe point; with none (``runner_state``: not started yet, lost, or waiting without a
    pod) the run is ended here at once (``Store.cancel_run``, reason ``Cancelled``), so no runner
    is ever created for it. Likewise a run past its deadline with no live runner is ended
    ``Failed``/``DeadlineExceeded`` here (the resync calls this every period); a live runner
    checks the deadline itself. The phase change posts the one ``Cancelled`` (or ``Failed``)
    Event through :func:`publish_status`. Raises StoreUnavailable, UnreadableState."""
    assert STATE.store is not None
    spec = body.get("spec") or {}
    cancel = spec.get("cancel") is True
    deadline = spec.get("activeDeadlineSeconds")
    if not cancel and not isinstance(deadline, int):
        return
    loaded = STATE.store.load_context(run_id)
    if loaded is not None and loaded[0].status.phase in TERMINAL_PHASES:
        return
    if cancel:
        STATE.store.request_cancel(run_id, cancel_requester(body))
    ends = STATE.store.end_requests(run_id)
    if ends is None or runner_state(STATE.store, run_id).alive:
        return
    if ends.cancel is not None:
        STATE.store.cancel_run(run_id, cancelled_message(ends.cancel), reason="Cancelled")
    elif isinstance(deadline, int) and ends.age_s >= deadline:
        STATE.store.end_run(run_id, Phase.FAILED, "DeadlineExceeded", deadline_message(deadline, ends.age_s))


def _warn_once(body: dict[str, Any], call_id: str, reason: str, message: str) -> bool:
    """Post a Warning Event for approval key ``call_id`` of this AgentRun (by uid) unless one was
    posted already; returns whether it posted."""
    key = (str(body["metadata"].get("uid")), call_id)
    if key in _warned:
        return False
    _warned.add(key)
    _event(body, EVENT_WARNING, reason, message[:1024])
    return True


def _create_pod(body: dict[str, Any], model_key: dict[str, str] | None, step: Step, lost_at: datetime | None) -> None:
    """Create runner pod ``step.attempt`` (and first, when enabled, its NetworkPolicy, so the pod
    never runs without it), owned by the AgentRun. ``model_key``: the registered ModelConfig's
    apiKeySecretRef. A 409 (an earlier attempt of this reconcile made it) is success. Raises
    RunnerPodRefused on a 403, ApiException otherwise."""
    namespace = body["metadata"]["namespace"]
    if SETTINGS.egress is not None:
        policy = build_network_policy(body, SETTINGS.egress)
        kopf.adopt(policy, owner=body)  # type: ignore[arg-type]  # kopf types owner as its Body; it reads any mapping
        try:
            STATE.networking.create_namespaced_network_policy(namespace, policy, _request_timeout=API_TIMEOUT_S)  # type: ignore[arg-type]  # the client serializes a dict as it does a V1NetworkPolicy
        except ApiException as err:
            if err.status != 409:
                raise
    pod = build_pod(
        body,
        SETTINGS.runner,
        attempt=step.attempt,
        counted_failures=step.counted,
        lost_at=lost_at.isoformat() if lost_at else None,
        allowed_modules=SETTINGS.allowed_modules,
        model_key=model_key,
        mcp_servers=SETTINGS.mcp_servers,
        mcp_commands=SETTINGS.mcp_commands,
        mcp_env=SETTINGS.mcp_env,
    )
    kopf.adopt(pod, owner=body)  # type: ignore[arg-type]  # kopf types owner as its Body; it reads any mapping
    try:
        STATE.core.create_namespaced_pod(namespace, pod, _request_timeout=API_TIMEOUT_S)  # type: ignore[arg-type]  # the client serializes a dict as it does a V1Pod
    except ApiException as err:
        if err.status == 409:
            return
        if err.status == 403:  # e.g. the runner ServiceAccount does not exist (yet) there, a quota: retried
            raise RunnerPodRefused(f"the API server refused runner pod {pod['metadata']['name']}: {_api_message(err)}") from None
        raise
    if step.attempt == 1:
        _event(body, EVENT_NORMAL, EventReason.RUNNER_CREATED, f"created runner pod {pod['metadata']['name']}")


class RunnerPodRefused(AgentfastError):
    """The API server refused to create a runner pod (403: its ServiceAccount is missing, a quota).
    ``str(err)`` is the sentence status shows."""


def _api_message(err: ApiException) -> str:
    """The ``message`` of an API error's Status body (at most 512 characters), else its reason."""
    try:
        return str(json.loads(err.body or "{}").get("message") or err.reason)[:512]
    except (ValueError, AttributeError):
        return str(err.reason)[:512]


def _prune_pods(namespace: str, pods: list[RunnerPod], keep_from: int) -> None:
    """Delete stopped runner pods older than attempt ``keep_from`` (the last stopped one stays,
    for ``kubectl logs``, until the run has ended ``runner.podTTLSecondsAfterFinished`` ago:
    :func:`_collect_runner_pods`)."""
    _delete_pods(namespace, [p for p in pods if p.attempt < keep_from and p.deletion_due is None])


def _delete_pods(namespace: str, pods: list[RunnerPod]) -> bool:
    """Delete these runner pods (gone already is fine); False when the API server refused one
    (logged)."""
    ok = True
    for p in pods:
        try:
            STATE.core.delete_namespaced_pod(p.name, namespace, _request_timeout=API_TIMEOUT_S)
        except ApiException as err:
            if err.status != 404:
                ok = False
                log.warning("could not delete runner pod %s/%s: %s", namespace, p.name, err.reason)
    return ok


#: When an ended run's pods could not all be deleted (an API error), look again this much later, s.
COLLECT_RETRY_S = 60.0


def _collect_runner_pods(body: dict[str, Any]) -> str | None:
    """For an ended run: delete its runner pods once ``runner.podTTLSecondsAfterFinished`` has
    passed since it ended (:func:`lifecycle.expired_pods`; the end as status records it,
    :func:`lifecycle.ended_at`), and then its NetworkPolicy; until then, look again when the next
    one is due. Returns the time (ISO 8601) when nothing of the runner was left, for
    ``status.runnerPodsDeletedAt``, else None. Nothing is done with the setting at -1 (keep) or
    once status has ``runnerPodsDeletedAt``: an ended run gets no new pod, so a reconcile of a
    run whose pods are collected (kopf's resume pass, a late pod event) costs no API call here,
    and the resync skips ended runs altogether (:func:`_settled`)."""
    ttl = SETTINGS.runner.pod_ttl_s
    old = body.get("status") or {}
    if ttl is None or old.get("runnerPodsDeletedAt"):
        return None
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    now = datetime.now(UTC)
    with _lock_for(f"pods:{uid}"):
        pods = [
            RunnerPod.from_api(p)
            for p in STATE.core.list_namespaced_pod(
                namespace, label_selector=f"{LABEL_RUN_UID}={uid}", _request_timeout=API_TIMEOUT_S
            ).items
        ]
        due, wait = expired_pods(pods, now, ended=ended_at(old, now), ttl_s=ttl)
        if not _delete_pods(namespace, due):
            _look_again(namespace, name, COLLECT_RETRY_S)
            return None
        if due:
            log.info("deleted %d runner pod(s) of %s/%s: the run ended over %d s ago", len(due), namespace, name, ttl)
        if wait is not None:
            _look_again(namespace, name, wait)
            return None
        if not _delete_network_policy(body):
            _look_again(namespace, name, COLLECT_RETRY_S)
            return None
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def _delete_network_policy(body: dict[str, Any]) -> bool:
    """Delete the run's egress NetworkPolicy (``build_network_policy``) if there is one and it is
    this AgentRun's (its ownerReference; a policy of that name someone else made is left alone).
    A no-op without ``networkPolicy.enabled`` (the chart grants the delete only then; a policy
    left from before is the AgentRun's and goes with it). False when the API server refused."""
    if SETTINGS.egress is None:
        return True
    meta = body["metadata"]
    namespace, policy = meta["namespace"], runner_name(meta["name"])
    try:
        found = read_or_none(STATE.networking.read_namespaced_network_policy, policy, namespace)
        if found is None or not any(o.uid == meta["uid"] for o in (found.metadata.owner_references or [])):
            return True
        STATE.networking.delete_namespaced_network_policy(
            policy,
            namespace,
            body=kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=found.metadata.uid)),
            _request_timeout=API_TIMEOUT_S,
        )
    except ApiException as err:
        if err.status in (404, 409):  # gone meanwhile, or replaced by another (its uid differs)
            return True
        log.warning("could not delete the NetworkPolicy %s/%s: %s", namespace, policy, err.reason)
        return False
    return True


def _get_agentrun(namespace: str, name: str) -> dict[str, Any] | None:
    run: dict[str, Any] | None = read_or_none(STATE.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
    return run


# -- status, its one writer ----------------------------------------------------------------------


_publish_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    """One lock per AgentRun: its status writes (listener, reconcile) never interleave."""
    with _locks_guard:
        return _publish_locks.setdefault(key, threading.Lock())


def publish_status(
    body: dict[str, Any],
    ctx: Any,
    pending: Any,
    *,
    override: tuple[str, str, str] | None = None,
    runner: Any = None,
    decided: dict[str, str] | None = None,
    decisions: list[dict[str, Any]] | None = None,
    pod: dict[str, Any] | None = None,
    closed: tuple[str, str] | None = None,
) -> None:
    """Patch ``status`` (merge patch on the status subresource) and post one Event per transition
    (phase or awaited calls), and a Resumed Event when a runner took the run over after a loss.
    ``pod``: what the reconcile learned of the runner pods (``name``, ``suspended``, ``blocked``);
    None (the progress path) keeps what status says of them. ``closed``: (reason, message) when
    the run can use no decision any more (status_from_store)."""
    meta = body["metadata"]
    old = body.get("status") or {}
    if pod is None:
        pod = {"name": old.get("runnerPod"), "suspended": _condition_true(old, "Suspended"), "blocked": None}
    new = status_from_store(
        ctx,
        pending,
        generation=meta.get("generation", 1),
        old=old,
        override=override,
        runner=runner,
        decided=decided,
        decisions=decisions,
        run_id=format_run_id(meta["namespace"], meta["name"]),
        summary=SETTINGS.status_summary,
        suspended=bool(pod.get("suspended")),
        blocked=pod.get("blocked"),
        closed=closed,
    )
    if pod.get("name"):
        new["runnerPod"] = pod["name"]
    if pod.get("deleted_at"):  # set once; later patches leave it (a merge patch keeps what it does not name)
        new["runnerPodsDeletedAt"] = pod["deleted_at"]
    notify.offer(body, pending, new["pendingApprovals"])  # before the no-change return: a restart re-offers
    if all(old.get(k) == v for k, v in new.items()):
        return
    key = format_run_id(meta["namespace"], meta["name"])
    with _lock_for(key):
        # Two paths publish (a reconcile, a store notification), each from its own read of the
        # store: one read before the run ended must not take an ended run's status back (a run
        # asked to cancel read as "WaitingForApproval, no decision can be used" after Cancelled).
        latest = _BODIES.get(key) or {}
        same_run = (latest.get("metadata") or {}).get("uid") == meta.get("uid")
        if same_run and (latest.get("status") or {}).get("phase") in TERMINAL_PHASES and new["phase"] not in TERMINAL_PHASES:
            return
        try:
            patched = STATE.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], {"status": new}, _request_timeout=API_TIMEOUT_S
            )
            if isinstance(patched, dict) and patched.get("metadata", {}).get("uid") == meta.get("uid"):
                _BODIES[key] = patched
        except ApiException as err:
            if err.status == 404:  # deleted meanwhile
                return
            raise
        uid = meta.get("uid", "")
        said = (new["phase"], new.get("awaiting"))
        if _EMITTED.get(uid) != said and (old.get("phase"), old.get("awaiting")) != said:
            _EMITTED[uid] = said
            kind = EVENT_WARNING if new["phase"] == Phase.FAILED else EVENT_NORMAL
            detail = f" {new['awaiting']}" if new.get("awaiting") else ""
            _event(body, kind, new["phase"], f"{new['phase']}{detail}: {new.get('message', '')}"[:1024])
        if new.get("restarts", 0) > max(old.get("restarts", 0), _RESUMED.get(uid, 0)) and ctx is not None:
            _RESUMED[uid] = new["restarts"]
            lost_at = _LOST_AT.pop(uid, None)
            lost = f" after {(datetime.now(UTC) - lost_at).total_seconds():.1f} s without a runner" if lost_at else ""
            _event(
                body,
                EVENT_NORMAL,
                EventReason.RESUMED,
                f"a new runner resumed the run at iteration {ctx.counters.iterations}{lost}",
            )


#: uid -> the (phase, awaiting) of the last transition Event posted: one Event per transition, even
#: when two publishes race with the same stale ``old`` status.
_EMITTED: dict[str, tuple[str, str | None]] = {}
#: uid -> the restart count whose Resumed Event was posted (the same guard, for Resumed).
_RESUMED: dict[str, int] = {}
#: NS/NAME -> the AgentRun as the watch (or our last status patch) showed it last.
_BODIES: dict[str, dict[str, Any]] = {}


def _condition_true(status: dict[str, Any], ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True" for c in status.get("conditions") or [])


def _event(body: dict[str, Any], kind: str, reason: str, message: str) -> None:
    meta = body["metadata"]
    event = kubernetes.client.CoreV1Event(
        metadata=kubernetes.client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
        involved_object=kubernetes.client.V1ObjectReference(
            api_version=API_VERSION, kind=KIND, name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid")
        ),
        reason=reason,
        message=message,
        type=kind,
        source=kubernetes.client.V1EventSource(component="agentfast-operator"),
        first_timestamp=datetime.now(UTC),
        count=1,
    )
    try:
        STATE.core.create_namespaced_event(meta["namespace"], event, _request_timeout=API_TIMEOUT_S)
    except ApiException as err:
        log.warning("could not post event %s for %s: %s", reason, meta["name"], err.reason)


def _progress_listener() -> None:
    """Republish a run's status as soon as its runner commits (Postgres NOTIFY), not on a poll.

    One LISTEN connection, kept open; notifications arriving within 0.1 s are coalesced (one
    publish per run) and published by a few workers in parallel, so a burst of commits from many
    runners does not queue behind one API round trip after another. A notification only wakes:
    the status is always re-read from the store. A dropped connection is re-opened, and what was
    missed meanwhile is caught by the resync.
    """
    assert STATE.store is not None
    workers = ThreadPoolExecutor(max_workers=PUBLISH_WORKERS, thread_name_prefix="agentfast-publish")
    while not STATE.stop.is_set():
        try:
            with psycopg.connect(STATE.store.dsn, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f"LISTEN {PROGRESS_CHANNEL}")
                STATE.listening = (STATE.listening[0] + 1, True)  # a new session: what came before it may be missed
                while not STATE.stop.is_set():
                    tokens = {n.payload for n in conn.notifies(timeout=0.1)}
                    # Payloads are run tokens, not names (a LISTEN is anyone's): one read maps them.
                    batch = set(STATE.store.runs_for_tokens(tokens).values()) if tokens else set()
                    if batch:
                        notified = time.monotonic()
                        list(workers.map(functools.partial(_publish_run, notified=notified), batch))
        except Exception:  # a dropped connection or an API hiccup: log, back off, listen again
            STATE.listening = (STATE.listening[0], False)
            log.exception("progress listener failed; restarting")
            STATE.stop.wait(2.0)


def _publish_run(run_id: str, notified: float | None = None) -> None:
    """Publish ``run_id``'s status from the store. The AgentRun is the one the watch delivered
    last (a GET only for one not seen yet): one API request per commit, the status patch. A
    body a moment stale costs at most a redundant patch; the Events are guarded against repeats.
    ``notified``: time.monotonic() when the commit's NOTIFY arrived (the status lag metric)."""
    namespace, name = parse_run_id(run_id)
    try:
        body = _BODIES.get(run_id) or _get_agentrun(namespace, name)
        if body is None:
            return
        try:
            ctx, pending, extra = _load_status(run_id)
        except UnreadableState as err:
            publish_status(body, None, None, override=(Phase.FAILED, "UnreadableState", str(err)))
            return
        if ctx is not None:
            publish_status(body, ctx, pending, **extra)
            if notified is not None:
                metrics.STATUS_LAG_SECONDS.observe(time.monotonic() - notified)
    except Exception as err:
        metrics.count_postgres_error("publish", err)
        _UNPUBLISHED.add(run_id)  # the next resync reconciles it
        log.exception("publishing the status of %s failed", run_id)


#: Runs whose progress publish failed (an API or Postgres error): reconciled by the next resync.
_UNPUBLISHED: set[str] = set()


def _resync_loop() -> None:
    """Every ``resync_s``: reconcile every AgentRun, so a missed event is only a delay.

    Here rather than in a kopf timer because kopf adds a finalizer to every object a timer
    serves, and a finalizer makes deletes hang while the operator is down.
    """
    while not STATE.stop.wait(SETTINGS.resync_s):
        try:
            with metrics.reconciling("resync"):
                _resync()
        except Exception:
            log.exception("resync failed")


def _retain(live: dict[str, str]) -> None:
    """Runs whose AgentRun is gone (``live``: NS/NAME -> uid of every AgentRun this operator
    serves): an unfinished one is Cancelled (its deletion happened while the operator was down);
    an ended one past its retention (``spec.ttlSecondsAfterFinished``, else the chart's
    ``operator.ttlSecondsAfterFinished``) has its rows deleted. Only namespaces this operator
    watches are touched. Rows of a live AgentRun are never deleted: it would be registered and
    run again."""
    assert STATE.store is not None

    def ours(run_id: str) -> bool:
        return not SETTINGS.namespaces or parse_run_id(run_id)[0] in SETTINGS.namespaces

    for run_id in STATE.store.orphans(live):
        if ours(run_id):
            STATE.store.cancel_run(run_id, "its AgentRun was deleted before the run ended; nothing more runs")
    for run_id, uid in STATE.store.expired_runs(SETTINGS.ttl_after_finished_s):
        if ours(run_id) and live.get(run_id) != uid:
            STATE.store.delete_run(run_id)
            log.info("deleted the rows of %s (uid %s): past its retention", run_id, uid)


def _list_agentruns() -> list[dict[str, Any]]:
    """Every AgentRun this operator serves, in pages of 500 (a large cluster is never one response)."""
    items: list[dict[str, Any]] = []
    namespaces: Sequence[str | None] = SETTINGS.namespaces or [None]
    for ns in namespaces:
        token = None
        while True:
            kw: dict[str, Any] = {"limit": 500, "_request_timeout": API_TIMEOUT_S, **({"_continue": token} if token else {})}
            # cast: the client types a custom object list as object; it is the API's JSON object.
            page = cast(
                dict[str, Any],
                STATE.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, **kw)
                if ns
                else STATE.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kw),
            )
            items += page["items"]
            token = page.get("metadata", {}).get("continue")
            if not token:
                break
    return items


def _settled(body: dict[str, Any]) -> bool:
    """An AgentRun whose status already shows its run ended, for its current generation: the store
    cannot change for it any more, so the resync leaves it alone (only retention looks at it)."""
    st = body.get("status") or {}
    return st.get("phase") in TERMINAL_PHASES and st.get("observedGeneration") == body["metadata"].get("generation")


_resync_state: dict[str, Any] = {"passes": 0, "listener": None}
#: uid -> when a reconcile of it last completed (time.monotonic()), whatever started it.
_RECONCILED_AT: dict[str, float] = {}
#: uid -> (generation, store control mark, checkpoint) when the resync last reconciled the run.
_RESYNCED: dict[str, tuple[int, Any, Any]] = {}
#: Each pass fully reconciles one in this many runs (by uid), changed or not: every run at least
#: every FULL_EVERY passes (5 min at the default 30 s), the net under anything no event announced.
FULL_EVERY = 10


def _resync_due(body: dict[str, Any], mark: RunMark | None, listener_whole: bool, full_slot: int) -> bool:
    """Whether the resync reconciles the AgentRun ``body`` this pass: when something changed that
    no event may have delivered, or its turn for a full reconcile came. ``mark``: its
    ``Store.change_marks`` entry, its control part extended with whether its runner lock is held
    (a runner SIGKILLed outside a pod sends no event; None: not registered yet, e.g. its
    ModelConfig is missing); ``listener_whole``: the progress listener kept one session since the
    previous pass, so every checkpoint since was published from its NOTIFY."""
    meta = body["metadata"]
    uid, run_id = meta["uid"], format_run_id(meta["namespace"], meta["name"])
    last = _RESYNCED.get(uid)
    if mark is None or mark.run_uid != uid or last is None or run_id in _UNPUBLISHED:
        return True
    if last[0] != meta.get("generation", 1) or last[1] != mark.control:
        return True  # a spec change (approvals, replies, cancel), a takeover, a decision, a cancel request
    if mark.checkpoint_id != last[2] and not listener_whole:
        return True
    if (body.get("spec") or {}).get("activeDeadlineSeconds") is not None:
        return True  # a deadline passes without any event
    if (body.get("spec") or {}).get("conversationIdleTimeout") is not None:
        return True  # so does a conversation's idle timeout (idle_due)
    return hash(uid) % FULL_EVERY == full_slot


def _resync() -> None:
    """One pass: reconcile the AgentRuns that need it (:func:`_resync_due`), then retention and
    credentials. Its cost grows with the runs that changed, not with all runs: progress reaches
    status through the listener, pods and spec changes through watch events."""
    assert STATE.store is not None
    started = time.monotonic()
    listener_before = STATE.listening
    items = _list_agentruns()
    marks = STATE.store.change_marks()
    held = runs_held(STATE.store, list(marks))
    marks = {run_id: replace(m, control=(*m.control, run_id in held)) for run_id, m in marks.items()}
    listener_whole = listener_before[1] and listener_before == _resync_state.get("listener")
    full_slot = _resync_state["passes"] % FULL_EVERY
    previous_start, _resync_state["started"] = _resync_state.get("started", 0.0), started
    reconciled = 0
    for body in items:
        meta = body["metadata"]
        if meta.get("deletionTimestamp") or _settled(body):
            continue
        run_id = format_run_id(meta["namespace"], meta["name"])
        mark = marks.get(run_id)
        uid = meta["uid"]
        if uid not in _RESYNCED and mark is not None and mark.run_uid == uid and _RECONCILED_AT.get(uid, -1.0) >= previous_start:
            # An event reconciled it since the previous pass (a new run; kopf's resume pass at
            # start): that is its baseline, so a burst of new runs is not reconciled twice.
            _RESYNCED[uid] = (meta.get("generation", 1), mark.control, mark.checkpoint_id)
            continue
        if not _resync_due(body, mark, listener_whole, full_slot):
            continue
        reconciled += 1
        _UNPUBLISHED.discard(run_id)
        try:
            reconcile(body)
            if mark is not None:
                _RESYNCED[meta["uid"]] = (meta.get("generation", 1), mark.control, mark.checkpoint_id)
        except Exception:
            log.exception("resync of %s failed", run_id)
    _resync_state.update(passes=_resync_state["passes"] + 1, listener=listener_before)
    live_uids = {b["metadata"]["uid"] for b in items}
    for uid in [u for u in _RESYNCED if u not in live_uids]:  # deleted while no DELETED event reached us
        _forget_run(uid)
    # A pass that outlasts its period means the resync is the operator's limit (bench/cluster_load.py reads this).
    log.info("resync: %d AgentRuns, %d reconciled in %.2f s", len(items), reconciled, time.monotonic() - started)
    _retain({format_run_id(b["metadata"]["namespace"], b["metadata"]["name"]): b["metadata"]["uid"] for b in items})
    # Least standing privilege (G11): a namespace's runner credential lives while it has AgentRuns.
    in_use = {b["metadata"]["namespace"] for b in items}
    for namespace in revoke_unused(STATE.store, STATE.core, in_use, SETTINGS.credential_rotation_s):
        log.info("revoked the runner credential of namespace %s (no AgentRun left there)", namespace)
