"""What the approvals inbox shows and does (``agentfast ui``, docs/ui.md), from one of two sources.

- :class:`LocalInbox`: a :class:`~agentfast.runner.store.Store` (the embedded server, or
  ``--dsn``). Decisions are recorded by the store's rules, attributed to the local user.
- :class:`KubeInbox`: AgentRuns read and patched through the Kubernetes API with the person's
  own credentials: their kubeconfig (``agentfast ui --kube``, and the ``--kube`` commands of the
  CLI), or the bearer token their browser sends to an inbox the chart deployed. So the RBAC, the
  approval admission policy and the recorded ``decidedBy`` are theirs, never the inbox's. What
  only Postgres holds (the transcript, the results of the siblings that already ran) comes from
  a store when one is configured, and only for an AgentRun the person could read, with the same uid.

Both give the same shapes (:class:`RunRow`, :class:`RunView`) and raise :class:`Refused` with a
message for a person when a decision is not recorded. Nothing here renders: text from models and
tools is returned as it is, and escaping is the page's business (runner/ui.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from . import boundedjson
from .arguments import arguments_digest
from .errors import AgentfastError
from .names import GROUP, PLURAL, TERMINAL_PHASES, VERSION, WAITING_PHASES, format_run_id, parse_run_id

if TYPE_CHECKING:
    from .decisions import DecisionsClosed
    from .snapshot import Message, ToolResult
    from .store import Store


class Refused(AgentfastError):
    """A decision (or a read) that was not done, with why, for the person who asked."""


@dataclass(frozen=True)
class PendingCall:
    """One call awaiting a person now. ``arguments``: the raw JSON text the model produced (it may
    be malformed); ``reason``: ``requires_approval``, ``in_flight_not_idempotent`` (it may already
    have run: complete it or deny it) or ``awaiting_input`` (the model's question: reply)."""

    call_id: str
    tool: str
    arguments: str
    reason: str
    #: The digest (runner/arguments.py) of the call's whole arguments, which a decision made on
    #: this view binds to (G13); None where the source did not give one (status of an older operator).
    digest: str | None = None
    #: Set when ``arguments`` is cut (status holds at most 512 characters): says so, how long the
    #: whole text is, and where it is.
    note: str | None = None
    #: When the call began to await a person (ms since the Unix epoch); None where not known.
    requested_at: int | None = None

    @property
    def question(self) -> str | None:
        """The question of an ``ask_user`` call, else None."""
        if self.reason != "awaiting_input":
            return None
        from .conversation import question_of

        return question_of(self.arguments)

    @property
    def pretty_arguments(self) -> str:
        """``arguments`` indented when they are JSON, else as the model sent them."""
        return pretty_json(self.arguments)


@dataclass(frozen=True)
class RunRow:
    """One run as the inbox lists it. ``key``: ``NAMESPACE/NAME`` (names.format_run_id)."""

    key: str
    phase: str
    reason: str
    message: str
    iteration: int | None
    pending: tuple[PendingCall, ...] = ()
    #: Why the run, not ended yet, can use no decision any more (past its deadline, a cancel
    #: asked for: :func:`.decisions.decisions_closed`); its calls are then not offered. None: it can.
    closed: str | None = None
    #: The run's uid (a decision from the list binds to it, as one from the run's page); None where not known.
    uid: str | None = None
    #: Whether a runner holds the run now: ``alive`` or ``none``; None where not known (a cluster's list).
    runner: str | None = None
    #: What the run has spent against its budget (``tokens 3000 / 8000, cost 0.042 / 0.03 USD``:
    #: runner/budget.py ``spend_summary``), shown beside the calls awaiting a decision; None when not known.
    spend: str | None = None

    @property
    def ended(self) -> bool:
        return self.phase in TERMINAL_PHASES


@dataclass(frozen=True)
class RunView:
    """One run in full. ``messages`` is None where the transcript cannot be read here (a cluster
    inbox without a store); ``siblings``: results of the paused batch's calls that already ran
    (G5), shown beside the calls awaiting a decision; ``decisions``: oldest first, dicts with
    ``call_id``, ``decision``, ``reason`` (None when not known), ``decided_by``."""

    row: RunRow
    uid: str
    messages: tuple[Message, ...] | None
    siblings: tuple[ToolResult, ...] = ()
    decisions: tuple[dict[str, Any], ...] = field(default_factory=tuple)


def closed_in_agentrun(body: dict[str, Any], now: datetime | None = None) -> DecisionsClosed | None:
    """Why the AgentRun ``body`` (as the API server returned it) can use no decision any more,
    by :func:`.decisions.decisions_closed`'s rule, or None: ``status.phase`` terminal, ``spec.cancel``
    true, or ``now`` (default: this machine's clock, UTC) past ``metadata.creationTimestamp`` plus
    ``spec.activeDeadlineSeconds``. The operator, which records the decision, applies the same rule
    to the store's own clock and refuses what this misses."""
    from .decisions import decisions_closed

    meta, spec, st = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    deadline = spec.get("activeDeadlineSeconds")
    age_s = None
    created = meta.get("creationTimestamp")
    if isinstance(deadline, int) and isinstance(created, str):
        try:
            born = datetime.fromisoformat(created.replace("Z", "+00:00"))
        except ValueError:
            born = None
        if born is not None:
            age_s = ((now or datetime.now(UTC)) - born).total_seconds()
    return decisions_closed(
        phase=st.get("phase") or "Pending",
        phase_reason=st.get("reason") or "",
        cancel_by="kubernetes (spec.cancel)" if spec.get("cancel") is True else None,
        age_s=age_s,
        deadline_s=deadline if isinstance(deadline, int) else None,
    )


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def visible(text: str) -> str:
    """``text`` with every invisible or reordering character (Unicode categories Cc but newline
    and tab, Cf: bidi overrides and isolates, zero-width spaces and joiners; Co, Cs) shown as
    ``\\u{XXXX}``, so arguments cannot read differently from what the tool gets ("Trojan
    Source", CVE-2021-42574). For text a person approves: tool arguments and results."""
    return "".join(
        f"\\u{{{ord(c):04X}}}"
        if (cat := unicodedata.category(c)) in ("Cf", "Co", "Cs") or (cat == "Cc" and c not in "\n\t")
        else c
        for c in text
    )


def pretty_json(text: str) -> str:
    """``text`` indented when it is JSON, else unchanged; then :func:`visible`."""
    try:
        text = json.dumps(boundedjson.loads(text, what="arguments"), indent=2, ensure_ascii=False)
    except (ValueError, TypeError):
        pass
    return visible(text)


def _transcript(store: Store, key: str) -> tuple[tuple[Message, ...], tuple[ToolResult, ...]]:
    """The run's transcript and its paused batch's executed sibling results, from its latest
    checkpoint. A paused run's transcript ends with the model's message that asked for the
    awaited calls (its turn; the checkpoint's messages gain it when the batch is done), so the
    person deciding reads what the model said with them."""
    snap = store.load_snapshot(key)
    if snap is None:
        return (), ()
    messages = list(snap.messages)
    siblings: tuple[ToolResult, ...] = ()
    if snap.pending is not None:
        siblings = tuple(snap.pending.executed_sibling_results)
        asked = {c.id for c in messages[-1].tool_calls} if messages else set()
        if snap.pending.tool_call.id not in asked:
            turn = store.load_turn(key, snap.pending.iteration)
            if turn is not None:
                messages.append(turn.message)
    return tuple(messages), siblings


class LocalInbox:
    """The inbox of a store: every run in it. ``user``: whom decisions are attributed to."""

    mode = "local"

    def __init__(self, store: Store, user: str) -> None:
        self.store = store
        self.user = user

    def runs(self, namespace: str | None = None) -> list[RunRow]:
        """Every run of the store (of ``namespace`` only, when given), newest first. Raises StoreUnavailable."""
        from .liveness import runs_held

        rows = []
        listed = [(rec, info) for rec, info in reversed(self.store.list_runs())]
        listed = [(rec, info) for rec, info in listed if namespace is None or parse_run_id(rec.run_id)[0] == namespace]
        held = runs_held(self.store, [rec.run_id for rec, _ in listed])  # one query for every run's runner
        for rec, info in listed:
            row = self._row(rec.run_id)
            if row is None:
                phase = "unreadable" if info is not None and not info.readable else "Pending"
                row = RunRow(rec.run_id, phase, "", "", info.iteration if info else None)
            rows.append(replace(row, uid=rec.run_uid, runner="alive" if rec.run_id in held else "none"))
        return rows

    def _row(self, key: str) -> RunRow | None:
        from .store import UnreadableState

        try:
            loaded = self.store.load_context_and_awaiting(key)
        except UnreadableState:
            return None
        if loaded is None:
            return None
        ctx, awaiting = loaded
        pending = tuple(
            PendingCall(
                a.call_id,
                a.tool_call.name,
                a.tool_call.arguments,
                a.reason,
                arguments_digest(a.tool_call.arguments),
                requested_at=a.requested_at,
            )
            for a in awaiting
        )
        from .snapshot import spend_summary

        st = ctx.status
        closed = self.store.decisions_closed(key) if not pending and st.phase in WAITING_PHASES else None
        # A run paused on calls is in their iteration (call-N-P: N), one more than it committed (as status shows it).
        iteration = max([ctx.counters.iterations, *(a.iteration for a in awaiting)])
        if closed is not None:  # it still reads Waiting..., but nothing it waited for can come any more
            return RunRow(key, st.phase, closed.reason, st.message, iteration, (), closed.message, spend=spend_summary(ctx))
        return RunRow(key, st.phase, st.reason or st.phase, st.message, iteration, pending, spend=spend_summary(ctx))

    def version(self, key: str | None = None, namespace: str | None = None) -> str:
        """A digest that changes whenever what :meth:`run` (``key``) or :meth:`runs`
        (``namespace``) shows changes, in one query (Store.change_marks: a checkpoint, a decision,
        a takeover, a cancel request), whatever the number of messages or runs; a live page
        compares it every second."""
        marks = self.store.change_marks()
        if key is not None:
            return _digest(marks.get(key))
        return _digest(sorted((k, m) for k, m in marks.items() if namespace is None or parse_run_id(k)[0] == namespace))

    def run(self, key: str) -> RunView | None:
        """The run ``key`` in full, or None when the store has no such run."""
        record = self.store.get_run(key)
        if record is None:
            return None
        row = self._row(key) or RunRow(key, "Pending", "", "", None)
        messages, siblings = _transcript(self.store, key) if row.phase != "Pending" else ((), ())
        decisions = tuple(
            {"call_id": d["call_id"], "decision": d["decision"], "reason": d["reason"], "decided_by": d["decided_by"]}
            for d in self.store.decision_log(key)
        )
        return RunView(row, record.run_uid, messages, siblings, decisions)

    def decide(
        self,
        key: str,
        call_id: str,
        decision: str,
        *,
        reason: str | None = None,
        result: str | None = None,
        uid: str | None = None,
        digest: str | None = None,
    ) -> str:
        """Record ``decision`` on ``call_id`` of the run ``key`` (the store's rules: only for a call
        awaiting one now, once; decisions.check_decision's limits). ``uid``: the run the person
        reviewed; refused if the run under ``key`` has another. ``digest``: of the arguments the
        person was shown (:attr:`PendingCall.digest`); refused if the call's are not those now
        (G13). Returns what was recorded, as a sentence. Raises Refused."""
        from .decisions import InvalidDecision, check_decision
        from .store import DecisionConflict, UnknownCall

        record = self.store.get_run(key)
        if record is None:
            raise Refused(f"no run {key}")
        if uid is not None and uid != record.run_uid:
            raise Refused(f"run {key} was re-created since you reviewed it (uid {uid} is gone); nothing was decided")
        try:
            reason, result = check_decision(decision, reason, result)
            d = self.store.decide(
                key,
                call_id,
                decision,  # type: ignore[arg-type]
                reason=reason,
                result=result,
                decided_by=self.user,
                arguments_digest=digest,
            )
        except (UnknownCall, DecisionConflict, InvalidDecision) as e:
            raise Refused(str(e)) from None
        said = f" ({d.reason})" if d.reason else ""
        said += f" with result {d.result}" if d.result is not None and d.decision != "reply" else ""
        return f"{d.call_id}: {d.decision}{said} recorded for {key} by {d.decided_by}"


# -- the cluster ---------------------------------------------------------------------------------


def _spend_of_status(body: dict[str, Any]) -> str | None:
    """An AgentRun's spend against its budget, as :func:`~.budget.spend_summary` words it, from
    what its status and spec say: ``status.usage.totalTokens`` against ``spec.budget.max_tokens``
    (the declared limit), ``status.cost`` (``amount``, ``currency``, ``maxCost``). None before the
    operator wrote any usage."""
    from .snapshot import format_cost

    st = body.get("status") or {}
    usage = st.get("usage") or {}
    if "totalTokens" not in usage:
        return None
    limit = ((body.get("spec") or {}).get("budget") or {}).get("max_tokens")
    line = f"tokens {usage['totalTokens']}" + (f" / {limit}" if limit is not None else "")
    cost = st.get("cost") or {}
    if "amount" not in cost or not cost.get("currency"):
        return line + ", cost not counted (no prices)"
    cur = str(cost["currency"])
    amount = format_cost(float(cost["amount"]), cur).removesuffix(f" {cur}")
    if cost.get("maxCost") is None:
        return line + f", cost {amount} {cur} (no max_cost)"
    return line + f", cost {amount} / {format_cost(float(cost['maxCost']), cur).removesuffix(f' {cur}')} {cur}"


def _api_failures() -> tuple[type[BaseException], ...]:
    """What a call to the API server raises when it fails: its answer (ApiException) or no answer
    (urllib3's errors: unreachable, TLS, timeout). KubeInbox turns both into Refused, never a 500."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return (ApiException, HTTPError)


def _api_error(e: BaseException) -> str:
    """The API server's message in an ApiException (its Status body), else its reason."""
    body = getattr(e, "body", None)
    try:
        return str(json.loads(body).get("message")) if body else str(getattr(e, "reason", e))
    except (ValueError, AttributeError):
        return str(getattr(e, "reason", e))


class KubeInbox:
    """The inbox of a namespace's AgentRuns, as the person whose credentials ``api_client`` carries.

    ``namespace``: the one listed when none is asked for. ``store``: where transcripts are read,
    or None (then :attr:`RunView.messages` is None). Every read and patch goes through the API
    server as that person: what they may not read raises Refused, what the approval admission
    policy refuses raises Refused with its message (charts/agentfast/templates/approval-policy.yaml).
    """

    mode = "kube"

    def __init__(self, api_client: Any, namespace: str, store: Store | None = None) -> None:
        import kubernetes

        self.api = kubernetes.client.CustomObjectsApi(api_client)
        self._auth = kubernetes.client.AuthenticationV1Api(api_client)
        self.namespace = namespace
        self.store = store
        self._user: str | None = None

    @classmethod
    def from_kubeconfig(cls, namespace: str | None = None, store: Store | None = None) -> KubeInbox:
        """As the kubeconfig's current context (its namespace unless ``namespace``), else as the
        pod's service account in a cluster. Raises Refused when the kubernetes client is missing."""
        try:
            import kubernetes
        except ImportError:
            raise Refused("--kube needs the kubernetes client: pip install 'agentfast[operator]'") from None
        try:
            kubernetes.config.load_kube_config()
            ns = namespace or kubernetes.config.list_kube_config_contexts()[1]["context"].get("namespace", "default")
        except kubernetes.config.ConfigException:
            kubernetes.config.load_incluster_config()
            ns = namespace or "default"
        return cls(kubernetes.client.ApiClient(), ns, store)

    @property
    def user(self) -> str:
        """The user name the API server authenticates these credentials as (a SelfSubjectReview,
        the API of ``kubectl auth whoami``; authentication.k8s.io/v1, GA in Kubernetes 1.28): what
        ``decidedBy`` must say, since the admission policy compares it with the requesting user.
        Raises Refused."""
        if self._user is None:
            import kubernetes

            failed = _api_failures()

            try:
                review = self._auth.create_self_subject_review(kubernetes.client.V1SelfSubjectReview())
            except failed as e:
                raise Refused(f"cannot learn who you are from the API server (kubectl auth whoami): {_api_error(e)}") from None
            info = review.status.user_info if review.status is not None else None
            if info is None or info.username is None:
                raise Refused("cannot learn who you are from the API server (kubectl auth whoami): its answer names no user")
            self._user = info.username
        return self._user

    def _where(self, key: str) -> tuple[str, str]:
        return parse_run_id(key, self.namespace)

    def agentrun(self, key: str, uid: str | None = None, *, nothing_done: str) -> tuple[str, str, dict[str, Any]]:
        """``(namespace, name, body)`` of the AgentRun ``key`` (``NAME`` or ``NAMESPACE/NAME``).
        Raises Refused when it cannot be read, or when ``uid`` is given and it has another (it was
        re-created since the person reviewed it: ``nothing_done`` says what was not done)."""
        failed = _api_failures()

        ns, name = self._where(key)
        try:
            body: dict[str, Any] = self.api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)  # type: ignore[assignment]
        except failed as e:
            raise Refused(f"cannot read agentrun {ns}/{name}: {_api_error(e)}") from None
        if uid is not None and uid != body["metadata"]["uid"]:
            raise Refused(
                f"agentrun {ns}/{name} has uid {body['metadata']['uid']}, not {uid}: it was re-created since you reviewed it; {nothing_done}"
            )
        return ns, name, body

    @staticmethod
    def _row(body: dict[str, Any]) -> RunRow:
        meta, st = body["metadata"], body.get("status") or {}
        pending = tuple(
            PendingCall(
                p.get("callId", ""),
                p.get("tool", ""),
                p.get("arguments", ""),
                p.get("reason", "requires_approval"),
                p.get("argumentsDigest") or None,
                (p.get("argumentsNote") or "the arguments shown are cut") if p.get("argumentsTruncated") else None,
            )
            for p in st.get("pendingApprovals") or []
        )
        phase = st.get("phase") or "Pending"
        closed = closed_in_agentrun(body) if phase not in TERMINAL_PHASES else None
        return RunRow(
            format_run_id(meta["namespace"], meta["name"]),
            phase,
            (closed.reason if closed else st.get("reason")) or phase,
            st.get("message") or "",
            st.get("iteration"),
            () if closed else pending,
            closed.message if closed else None,
            uid=meta.get("uid"),
            spend=_spend_of_status(body),
        )

    def runs(self, namespace: str | None = None) -> list[RunRow]:
        """The AgentRuns of ``namespace`` (default: this inbox's), newest first. Raises Refused."""
        failed = _api_failures()

        ns = namespace or self.namespace
        try:
            got: dict[str, Any] = self.api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)  # type: ignore[assignment]
        except failed as e:
            raise Refused(f"cannot list agentruns in namespace {ns}: {_api_error(e)}") from None
        items = sorted(got.get("items", []), key=lambda b: b["metadata"].get("creationTimestamp") or "", reverse=True)
        return [self._row(b) for b in items]

    def version(self, key: str | None = None, namespace: str | None = None) -> str:
        """A digest that changes whenever what :meth:`run` (``key``) or :meth:`runs`
        (``namespace``) shows changes: the AgentRuns' resourceVersions (the operator writes status
        at each checkpoint and decision). Raises Refused."""
        failed = _api_failures()

        try:
            if key is not None:
                ns, name = self._where(key)
                try:
                    body: dict[str, Any] = self.api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)  # type: ignore[assignment]
                except failed as e:
                    if getattr(e, "status", None) == 404:
                        return _digest(None)
                    raise
                return _digest(body["metadata"].get("resourceVersion"))
            got: dict[str, Any] = self.api.list_namespaced_custom_object(GROUP, VERSION, namespace or self.namespace, PLURAL)  # type: ignore[assignment]
        except failed as e:
            raise Refused(f"cannot read agentruns: {_api_error(e)}") from None
        return _digest(sorted((b["metadata"]["name"], b["metadata"].get("resourceVersion")) for b in got.get("items", [])))

    def run(self, key: str) -> RunView | None:
        """The AgentRun ``key`` in full as status shows it, with its transcript and sibling results
        from the store when this inbox has one and the store's run has the AgentRun's uid. None
        when there is no such AgentRun; raises Refused when the person may not read it."""
        failed = _api_failures()

        ns, name = self._where(key)
        try:
            body: dict[str, Any] = self.api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)  # type: ignore[assignment]
        except failed as e:
            if getattr(e, "status", None) == 404:
                return None
            raise Refused(f"cannot read agentrun {ns}/{name}: {_api_error(e)}") from None
        row, uid = self._row(body), body["metadata"]["uid"]
        decisions = tuple(
            {"call_id": d.get("callId"), "decision": d.get("decision"), "reason": None, "decided_by": d.get("decidedBy")}
            for d in (body.get("status") or {}).get("decisions") or []
        )
        messages: tuple[Message, ...] | None = None
        siblings: tuple[ToolResult, ...] = ()
        if self.store is not None:
            # Read only after the API server let this person read the AgentRun, and only the
            # store's run of that very AgentRun (a re-created one has another uid).
            record = self.store.get_run(row.key)
            if record is not None and record.run_uid == uid:
                messages, siblings = _transcript(self.store, row.key)
            else:
                messages = ()
        return RunView(row, uid, messages, siblings, decisions)

    def decide(
        self,
        key: str,
        call_id: str,
        decision: str,
        *,
        reason: str | None = None,
        result: str | None = None,
        uid: str | None = None,
        digest: str | None = None,
    ) -> str:
        """Patch the person's decision into the AgentRun ``key``; the operator records it in
        Postgres and the runner resumes. ``approve``, ``deny``, ``complete``: a merge patch of
        ``spec.approvals[call_id]``; ``reply``: a JSON patch appending ``{callId, text,
        repliedBy}`` to ``spec.replies`` (``end``: ``{callId, end: true, repliedBy}``) (a merge patch would replace the list, which the CRD keeps
        append-only). ``decidedBy``/``repliedBy`` is :attr:`user`.

        Refused before patching when status does not list the call as awaiting this kind of
        decision, or spec already holds one for it; refused by the API server (its message) when
        the person lacks the approval right (verb approve on agentruns/approval) or the call no
        longer awaits. Every patch carries the AgentRun's ``metadata.uid`` (``uid`` when given:
        the one the person reviewed), so it is refused if the AgentRun was deleted and re-created
        under the same name, with other input, in between. Returns what was patched, as a
        sentence naming the call's tool and arguments. Raises Refused.

        ``digest`` (G13): of the arguments the person was shown; refused when status now shows
        the call with another. The patch carries ``argumentsDigest``: ``digest``, else the one
        status shows (the arguments this command prints), and the operator records the decision
        only while the call's arguments have it."""
        from .decisions import END, REPLY, InvalidDecision, check_decision

        try:
            reason, result = check_decision(decision, reason, result)
        except InvalidDecision as e:
            raise Refused(str(e)) from None
        nothing = "no reply was sent" if decision in (REPLY, END) else "nothing was decided"
        ns, name, body = self.agentrun(key, uid, nothing_done=nothing)
        seen_uid = body["metadata"]["uid"]
        closed = closed_in_agentrun(body)
        if closed is not None:
            raise Refused(f"{call_id} of agentrun {ns}/{name} cannot be decided: {closed.message}; {nothing}")
        listed = {p.call_id: p for p in self._row(body).pending}
        spec = body.get("spec") or {}
        if decision == REPLY:
            assert result is not None
            return self._reply(ns, name, body, listed, call_id, result)
        if decision == END:  # the person ends the conversation: an end entry of spec.replies
            return self._reply(ns, name, body, listed, call_id, None)
        earlier = (spec.get("approvals") or {}).get(call_id)
        if earlier is not None:
            said = earlier.get("decision", "?") + (f" ({earlier['reason']})" if earlier.get("reason") else "")
            raise Refused(
                f"{call_id} of agentrun {ns}/{name} was already decided: {said}; a decision is write-once, so this one was not recorded"
            )
        if call_id not in listed:
            now = f"awaiting a decision now: {', '.join(listed)}" if listed else "no call of this run awaits a decision now"
            raise Refused(f"{call_id} of agentrun {ns}/{name} does not await a decision (status.pendingApprovals); {now}")
        call = listed[call_id]
        if digest is not None and call.digest is not None and digest != call.digest:
            raise Refused(
                f"{call_id} of agentrun {ns}/{name}: its arguments are not the ones you were shown (status shows"
                f" {call.digest[:19]}..., you saw {digest[:19]}...); {nothing}: read the call again"
            )
        bound = digest or call.digest
        entry = {
            "decision": decision,
            **({"reason": reason} if reason else {}),
            **({"result": result} if result is not None else {}),
            "decidedBy": self.user,
            **({"argumentsDigest": bound} if bound else {}),
        }
        self.patch(ns, name, seen_uid, nothing, {"metadata": {"uid": seen_uid}, "spec": {"approvals": {call_id: entry}}})
        return (
            f"agentrun.agentfast.dev/{name} (uid {seen_uid}) patched: {call_id} {decision}"
            + (f" ({reason})" if reason else "")
            + f" by {entry['decidedBy']}: {call.tool}({call.arguments})"
            + (f" [{call.note}]" if call.note else "")
        )

    def awaiting_decision(self, body: dict[str, Any]) -> list[PendingCall]:
        """The calls of the AgentRun ``body`` that status lists as awaiting a decision (approve,
        deny or complete: not the questions awaiting a reply), in status's order."""
        return [c for c in self._row(body).pending if c.reason != "awaiting_input" and c.call_id]

    def questions(self, body: dict[str, Any]) -> dict[str, str]:
        """Call id -> question, of the AgentRun ``body``'s calls awaiting a reply (status lists
        them; those ``spec.replies`` already answers are left out)."""
        answered = {r.get("callId") for r in (body.get("spec") or {}).get("replies") or [] if isinstance(r, dict)}
        return {
            c.call_id: c.question or ""
            for c in self._row(body).pending
            if c.reason == "awaiting_input" and c.call_id and c.call_id not in answered
        }

    def question_now(self, body: dict[str, Any], call_id: str | None) -> str:
        """The call id a reply to the AgentRun ``body`` answers: ``call_id`` when given, else the
        one question that awaits a reply now (status lists it and ``spec.replies`` does not answer
        it yet). Never one to come. Raises Refused, saying why: the run can use no decision
        (:func:`closed_in_agentrun`), its question was already answered, none or several await."""
        meta = body["metadata"]
        where = f"agentrun {meta.get('namespace')}/{meta.get('name')}"
        closed = closed_in_agentrun(body)
        if closed is not None:
            raise Refused(f"{where} takes no reply: {closed.message}; no reply was sent")
        if call_id is not None:
            return call_id
        questions = self.questions(body)
        if len(questions) == 1:
            return next(iter(questions))
        if questions:
            listed = "; ".join(f"{c}: {' '.join(q.split())[:80]}" for c, q in questions.items())
            raise Refused(f"{where} asks {len(questions)} questions; say which one with --call: {listed}")
        replies = [r for r in (body.get("spec") or {}).get("replies") or [] if isinstance(r, dict)]
        asked = {c.call_id for c in self._row(body).pending if c.reason == "awaiting_input"}
        last = replies[-1] if replies else None
        if last is not None and last.get("callId") in asked:  # status still shows the question it answered
            raise Refused(
                f"{last.get('callId')} of {where} was already answered by {last.get('repliedBy') or 'unknown'}; a question"
                " takes one reply, so no reply was sent, and a reply is never kept for a question to come: no other"
                " question awaits a reply now"
            )
        told = f" (its last question, {last.get('callId')}, was answered by {last.get('repliedBy') or 'unknown'})" if last else ""
        raise Refused(
            f"{where} asks the user nothing now{told}; no reply was sent, and a reply is never kept for a question to come"
        )

    def _reply(
        self, ns: str, name: str, body: dict[str, Any], listed: dict[str, PendingCall], call_id: str, text: str | None
    ) -> str:
        """Append the person's answer to question ``call_id`` to ``spec.replies``: ``{callId,
        text, repliedBy}``, or ``{callId, end: true, repliedBy}`` (``text`` None: the person ends
        the conversation there). Raises Refused."""
        seen_uid, spec = body["metadata"]["uid"], body.get("spec") or {}
        call = listed.get(call_id)
        if call is None or call.reason != "awaiting_input":
            asked = ", ".join(c for c, p in listed.items() if p.reason == "awaiting_input") or "none"
            raise Refused(
                f"{call_id} of agentrun {ns}/{name} is not a question awaiting a reply; questions awaiting one: {asked}"
            )
        replies = spec.get("replies")
        if any(r.get("callId") == call_id for r in replies or []):
            raise Refused(f"{call_id} of agentrun {ns}/{name} was already answered; a reply is write-once")
        entry: dict[str, Any] = {"callId": call_id, "repliedBy": self.user}
        entry.update({"text": text} if text is not None else {"end": True})
        ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": seen_uid}]
        if replies is not None:
            ops.append({"op": "add", "path": "/spec/replies/-", "value": entry})
        else:
            # The first reply makes the list; "add" on a member that exists replaces it, so another
            # first reply made meanwhile must fail this one (the object's version moved), not vanish.
            ops.append({"op": "test", "path": "/metadata/resourceVersion", "value": body["metadata"]["resourceVersion"]})
            ops.append({"op": "add", "path": "/spec/replies", "value": [entry]})
        self.patch(ns, name, seen_uid, "no reply was sent", ops, json_patch=True)
        if text is None:
            return f"agentrun.agentfast.dev/{name} (uid {seen_uid}) patched: the conversation ended at {call_id} by {entry['repliedBy']}"
        return f"agentrun.agentfast.dev/{name} (uid {seen_uid}) patched: {call_id} answered by {entry['repliedBy']}"

    def patch(
        self, ns: str, name: str, seen_uid: str, nothing_done: str, patch: Any, *, json_patch: bool = False, **kw: Any
    ) -> None:
        """Send ``patch`` (a merge patch, or with ``json_patch`` a JSON patch) to the AgentRun
        ``ns``/``name`` read with uid ``seen_uid``; the patch carries that uid as a precondition.
        ``kw``: patch_namespaced_custom_object's (e.g. field_manager). Raises Refused with the API
        server's word, or saying the AgentRun was re-created (``nothing_done``: what was not done)."""
        failed = _api_failures()

        if json_patch:
            kw["_content_type"] = "application/json-patch+json"
        try:
            self.api.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, patch, **kw)
        except failed as e:
            detail = _api_error(e)
            if "test" in detail and "resourceVersion" in detail:  # a first reply's test (see _reply)
                raise Refused(
                    f"agentrun {ns}/{name} changed since it was read (a reply came first?): read it again; {nothing_done}"
                ) from None
            # A merge patch's metadata.uid precondition, or a JSON patch's failed test of it.
            if "metadata.uid" in detail or ("test" in detail and "uid" in detail):
                raise Refused(
                    f"agentrun {ns}/{name} was re-created since it was read (uid {seen_uid} is gone); {nothing_done}"
                ) from None
            raise Refused(f"the API server refused the patch: {detail}") from None


def token_client(token: str, base: Any) -> Any:
    """A kubernetes ApiClient that authenticates with the bearer ``token`` alone, to the API
    server of ``base`` (a kubernetes Configuration: only its host, CA and TLS verification are
    taken; never its client certificate, token or refresh hook, which would let the API server see
    the inbox's own identity instead of the person's)."""
    import kubernetes

    cfg = kubernetes.client.Configuration()
    cfg.host = base.host
    cfg.ssl_ca_cert = base.ssl_ca_cert
    cfg.verify_ssl = base.verify_ssl
    cfg.api_key = {"BearerToken": token}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    cfg.refresh_api_key_hook = None
    return kubernetes.client.ApiClient(cfg)


#: The API server's CA in a pod: the service account volume's, or the file ``AGENTFAST_KUBE_CA_FILE``
#: names (the chart's inbox mounts the kube-root-ca.crt ConfigMap and has no token of its own).
SERVICE_CA_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


def api_server_configuration() -> Any:
    """The API server's address and CA, and nothing else: in a pod, ``KUBERNETES_SERVICE_HOST``
    and ``KUBERNETES_SERVICE_PORT`` with the CA of ``AGENTFAST_KUBE_CA_FILE`` (default: the
    service account volume's); elsewhere the kubeconfig's current context. No token is read: only
    :func:`token_client` uses it, with the person's. Raises Refused without the kubernetes client."""
    try:
        import kubernetes
    except ImportError:
        raise Refused("the cluster inbox needs the kubernetes client: pip install 'agentfast[operator]'") from None
    cfg = kubernetes.client.Configuration()
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if host:
        cfg.host = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        cfg.ssl_ca_cert = os.environ.get("AGENTFAST_KUBE_CA_FILE", SERVICE_CA_FILE)
    else:
        kubernetes.config.load_kube_config(client_configuration=cfg)
    return cfg
