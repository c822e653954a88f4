"""Notifications: a webhook POST for each call that awaits a human (issue 18 item 4).

A run waiting for a refund approval, or for the user's reply, tells the admin's webhook once per
awaited call: which run, which call, why it waits, and the exact command that decides it. The
admin configures it (the chart's ``notifications.webhook``, rendered into the operator's
environment, :meth:`WebhookConfig.from_env`); docs/notifications.md is the user's page. In a
cluster the operator sends (``operator/notify.py`` wires it); a local ``agentfast run``/``resume``
sends too when ``AGENTFAST_NOTIFY_URL`` is set in its environment (:func:`notify_local`).

- **Once per call, across restarts and replicas**: each awaited call gets one row in
  ``agentfast_notifications`` (migration 15), keyed ``(run_id, call_id)`` and made with
  ``INSERT ... ON CONFLICT DO NOTHING``, so re-announcing after a restart adds nothing. A sender
  claims a due row in one statement (``FOR UPDATE SKIP LOCKED``) that moves its
  ``next_attempt_at`` ``lease_s`` ahead, longer than a POST may take, so no other sender (another
  replica, or this one after a restart) picks it up while the POST is in flight. The outcome is
  written only if the row is still the one claimed (same ``attempts``).
- **What a receiver sees**: at least one POST per call, every POST of a call with the same
  ``Idempotency-Key`` header (``<run uid>:<call id>``, also in the body). A call is POSTed again
  only when its previous attempt's outcome was not recorded as success: the receiver failed or
  timed out, or the sender died mid-POST (the next sender retries once the claim's lease has
  run out). A receiver that drops repeated keys therefore acts exactly once.
- **Retries**: exponential backoff from ``backoff_s`` (1 s, 2 s, 4 s ...) capped at
  ``backoff_cap_s`` (5 min), or the receiver's ``Retry-After`` (seconds) if longer, up to the cap; after ``max_attempts`` the row is ``failed`` with its last error and
  a Warning Event ``NotificationFailed`` is posted on the AgentRun. A call decided before its
  notification went out is ``skipped``.
- **Never in a reconcile's way**: :meth:`Notifier.offer` only appends to a queue; one background
  thread with its own Postgres connection writes the rows and POSTs (``timeout_s``, 5 s).
- **Data**: the call's arguments (and a question's text, which is its ``ask_user`` argument) are
  sent only with ``include_arguments``: they may hold personal data. In the Slack format every
  text that came from a model or a tool is escaped for mrkdwn (``&``, ``<``, ``>``) and set in a
  code block, so it cannot make a link or a mention.

No HTTP server lives here; POSTs use the standard library (``urllib``), which costs the operator
no dependency.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb

from agentfast.runner.conversation import question_of
from agentfast.runner.errors import AgentfastError
from agentfast.runner.names import format_run_id, parse_run_id
from agentfast.runner.snapshot import AwaitedCall, PendingToolCall

log = logging.getLogger("agentfast.notify")

EVENT_TYPE = "agentfast.pending_call"
#: The reason of the Warning Event posted on an AgentRun when a notification was given up.
EVENT_REASON_FAILED = "NotificationFailed"
#: Arguments (or a question) longer than this many characters are cut (``argumentsTruncated``).
ARGUMENTS_MAX_CHARS = 4000
#: Slack refuses a section's text over 3000 characters; a code block of ours stays well below.
_SLACK_CODE_CHARS = 2800
#: Characters of a failed answer's body kept in ``last_error`` (and the log).
_ERROR_CHARS = 300
FORMATS = ("generic", "slack")
_KNOWN_MAX = 100_000


class NotificationConfigError(AgentfastError, ValueError):
    """The operator's notification settings (``AGENTFAST_NOTIFY_*``) are malformed."""


@dataclass(frozen=True)
class WebhookConfig:
    """Where and how to notify (durations in seconds).

    ``url``: http(s) URL the POSTs go to; ``format``: ``generic`` (our JSON) or ``slack`` (an
    incoming webhook's ``text`` + ``blocks``); ``include_arguments``: send the call's arguments
    and a question's text; ``token``: sent as ``Authorization: Bearer <token>`` when set (never in
    a repr); ``timeout_s``: per POST; retries back off from ``backoff_s`` doubling up to
    ``backoff_cap_s``, ``max_attempts`` in all; ``lease_s``: how long a claimed row is left to
    its sender before another may retry it (must exceed ``timeout_s``).
    """

    url: str = field(repr=False)  # a Slack webhook URL is itself a secret
    format: Literal["generic", "slack"] = "generic"
    include_arguments: bool = False
    token: str = field(default="", repr=False)
    timeout_s: float = 5.0
    max_attempts: int = 20
    backoff_s: float = 1.0
    backoff_cap_s: float = 300.0
    lease_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise NotificationConfigError("the notification webhook URL must start with http:// or https://")
        if self.format not in FORMATS:
            raise NotificationConfigError(f"notification format {self.format!r}: one of {', '.join(FORMATS)}")
        if self.max_attempts < 1 or self.timeout_s <= 0 or self.backoff_s <= 0 or self.backoff_cap_s < self.backoff_s:
            raise NotificationConfigError("notification retries: max_attempts >= 1, timeout > 0, 0 < backoff <= cap")
        if self.lease_s <= self.timeout_s:
            raise NotificationConfigError("notification lease must be longer than the POST timeout")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WebhookConfig | None:
        """The settings from ``env`` (default ``os.environ``); None when ``AGENTFAST_NOTIFY_URL``
        is empty (notifications off). Variables: ``AGENTFAST_NOTIFY_URL``, ``_FORMAT``
        (generic|slack), ``_INCLUDE_ARGUMENTS`` (true|false), ``_TOKEN``, ``_TIMEOUT_SECONDS``,
        ``_MAX_ATTEMPTS``, ``_BACKOFF_SECONDS``, ``_BACKOFF_CAP_SECONDS``. Raises
        NotificationConfigError for a malformed value (never quoting the URL or token)."""
        env = os.environ if env is None else env
        url = env.get("AGENTFAST_NOTIFY_URL", "").strip()
        if not url:
            return None
        try:
            timeout_s = float(env.get("AGENTFAST_NOTIFY_TIMEOUT_SECONDS", "5"))
            return cls(
                url=url,
                format=env.get("AGENTFAST_NOTIFY_FORMAT", "generic"),  # type: ignore[arg-type]  # checked in __post_init__
                include_arguments=env.get("AGENTFAST_NOTIFY_INCLUDE_ARGUMENTS", "false").lower() == "true",
                token=env.get("AGENTFAST_NOTIFY_TOKEN", "").strip(),
                timeout_s=timeout_s,
                max_attempts=int(env.get("AGENTFAST_NOTIFY_MAX_ATTEMPTS", "20")),
                backoff_s=float(env.get("AGENTFAST_NOTIFY_BACKOFF_SECONDS", "1")),
                backoff_cap_s=float(env.get("AGENTFAST_NOTIFY_BACKOFF_CAP_SECONDS", "300")),
                lease_s=max(60.0, timeout_s * 4),
            )
        except ValueError as err:
            if isinstance(err, NotificationConfigError):
                raise
            raise NotificationConfigError(f"AGENTFAST_NOTIFY_*: {err}") from None

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt (1-based): ``backoff_s`` doubled
        per attempt, at most ``backoff_cap_s``."""
        return float(min(self.backoff_cap_s, self.backoff_s * 2 ** min(attempts - 1, 60)))


# -- the payloads ------------------------------------------------------------------------------


def idempotency_key(run_uid: str, call_id: str) -> str:
    """``<run uid>:<call id>``: the same for every POST about one awaited call, and never the same
    for two calls (a run's uid is unique, a call id unique within its run)."""
    return f"{run_uid}:{call_id}"


def commands(namespace: str, name: str, uid: str, call_id: str, reason: str, *, local: bool = False) -> dict[str, str]:
    """The commands that decide the call, as a human pastes them (``kubectl agentfast``, the
    plugin the CLI installs as): ``approve``/``deny`` for a gated call (and ``complete`` for a
    non-idempotent call that was in flight), ``reply`` for a question. ``--uid`` makes each one
    refuse to act on another AgentRun that took the name since. '...' is for the human to fill.
    ``local``: the local CLI's commands instead (``agentfast approve RUN CALL``, the store of
    ``AGENTFAST_DSN``; RUN is NAME in namespace ``default``, else NS/NAME)."""
    if local:
        prefix = "agentfast"
        run = shlex.quote(name if namespace == "default" else f"{namespace}/{name}")
        tail = ""
    else:
        prefix = "kubectl agentfast"
        run = shlex.quote(name)
        tail = f" -n {shlex.quote(namespace)} --uid {shlex.quote(uid)}"
    call = shlex.quote(call_id)
    if reason == "awaiting_input":
        return {"reply": f"{prefix} reply {run} '...' --call {call}{tail}", "end": f"{prefix} end {run} --call {call}{tail}"}
    out = {
        "approve": f"{prefix} approve {run} {call}{tail}",
        "deny": f"{prefix} deny {run} {call} --reason '...'{tail}",
    }
    if reason == "in_flight_not_idempotent":
        out["complete"] = f"{prefix} complete {run} {call} --result 'TEXT'{tail}"
    return out


def pending_call_event(
    namespace: str,
    name: str,
    uid: str,
    call: AwaitedCall,
    siblings: Sequence[str],
    *,
    include_arguments: bool,
    local: bool = False,
) -> dict[str, Any]:
    """The generic JSON body announcing ``call`` of run ``namespace/name`` (uid ``uid``):

    ``{"type": "agentfast.pending_call", "idempotencyKey", "run": {namespace, name, uid},
    "call": {id, tool, reason, iteration, requestedAtMs, "question"?}, "arguments"?,
    "argumentsTruncated"?, "commands": {...}, "siblings": [other awaited call ids]}``.
    ``arguments`` (the raw JSON text the model wrote) and ``call.question`` only with
    ``include_arguments``; each cut to :data:`ARGUMENTS_MAX_CHARS` characters. ``local``: the
    local CLI's commands (:func:`commands`)."""
    key = idempotency_key(uid, call.call_id)
    body: dict[str, Any] = {
        "type": EVENT_TYPE,
        "idempotencyKey": key,
        "run": {"namespace": namespace, "name": name, "uid": uid},
        "call": {
            "id": call.call_id,
            "tool": call.tool_call.name,
            "reason": call.reason,
            "iteration": call.iteration,
            "requestedAtMs": call.requested_at,
        },
        "commands": commands(namespace, name, uid, call.call_id, call.reason, local=local),
        "siblings": [s for s in siblings if s != call.call_id],
    }
    if include_arguments:
        args = call.tool_call.arguments
        body["arguments"] = args[:ARGUMENTS_MAX_CHARS]
        if len(args) > ARGUMENTS_MAX_CHARS:
            body["argumentsTruncated"] = True
        if call.reason == "awaiting_input":
            body["call"]["question"] = question_of(args)[:ARGUMENTS_MAX_CHARS]
    return body


def slack_escape(text: str) -> str:
    """``text`` made inert for Slack mrkdwn: ``&``, ``<``, ``>`` as Slack documents
    (``&amp;``, ``&lt;``, ``&gt;``), so no ``<!channel>``, ``<@U123>`` or ``<url|label>`` can form."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    # A code block shows the text as it is (no bold, no auto-linked URLs); a backtick inside could
    # close it early, so it becomes a look-alike (U+02CB) that cannot. Cut after escaping (an
    # escape is up to 5 characters: Slack counts those), never inside an entity.
    body = slack_escape(text).replace("`", "\u02cb")
    if len(body) > _SLACK_CODE_CHARS:
        body = body[:_SLACK_CODE_CHARS]
        amp = body.rfind("&", len(body) - 4)
        if amp != -1 and ";" not in body[amp:]:
            body = body[:amp]
        body += "\u2026"
    return "```" + body + "```"


def _inline(text: str) -> str:
    return "`" + slack_escape(text).replace("`", "\u02cb") + "`"


_WHAT = {
    "requires_approval": "a decision on a gated call",
    "in_flight_not_idempotent": "a decision on a call that was in flight when its runner died (not idempotent)",
    "awaiting_input": "a reply to its question",
}


def slack_payload(event: Mapping[str, Any]) -> dict[str, Any]:
    """The Slack incoming-webhook body (``text`` + ``blocks``, mrkdwn) for a generic ``event``
    (:func:`pending_call_event`): the same content. Every foreign text is escaped
    (:func:`slack_escape`); tool names, arguments and questions are in code spans or blocks;
    ``unfurl_*`` off, no ``link_names``."""
    run, call = event["run"], event["call"]
    where = f"{run['namespace']}/{run['name']}"
    what = _WHAT.get(call["reason"], "a decision")
    text = f"agentfast: run {_inline(where)} waits for {what}: call {_inline(call['id'])} ({_inline(call['tool'])})"
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]
    if "question" in call:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "*Question*\n" + _code(call["question"])}})
    if "arguments" in event:
        cut = " (truncated)" if event.get("argumentsTruncated") else ""
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"*Arguments*{cut}\n" + _code(event["arguments"])}})
    for verb, command in event["commands"].items():
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"*{verb.capitalize()}*\n" + _code(command)}})
    if event.get("siblings"):
        others = ", ".join(_inline(s) for s in event["siblings"])
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"also awaiting in this batch: {others}"}]})
    key = _inline(event["idempotencyKey"])
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"idempotency key {key}"}]})
    return {"text": text, "blocks": blocks, "unfurl_links": False, "unfurl_media": False}


def render(event: Mapping[str, Any], fmt: str) -> bytes:
    """The POST body (UTF-8 JSON) of ``event`` in format ``fmt`` (``generic`` or ``slack``).
    The idempotency key is in both (Slack's in a context block)."""
    data = slack_payload(event) if fmt == "slack" else event
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


# -- the sender --------------------------------------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib would follow a 302 with a GET that drops the body: a redirect counts as a failure.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def post(config: WebhookConfig, body: bytes, key: str) -> tuple[bool, str, float | None]:
    """POST ``body`` to the webhook with headers ``Content-Type: application/json``,
    ``Idempotency-Key: key`` (and ``Authorization`` when a token is set), waiting at most
    ``timeout_s``. Returns (True, "HTTP <code>", None) for a 2xx answer, else (False, why,
    retry_after_s): why is a non-2xx status with the start of its body, a refused connection, a
    timeout; retry_after_s the answer's ``Retry-After`` in seconds (429 and 503 from Slack and
    others; an HTTP date is ignored), else None. Never raises for a network failure."""
    headers = {"Content-Type": "application/json", "Idempotency-Key": key, "User-Agent": "agentfast-notify"}
    if config.token:
        headers["Authorization"] = f"Bearer {config.token}"
    request = urllib.request.Request(config.url, data=body, headers=headers, method="POST")
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=config.timeout_s) as answer:
            answer.read(65536)
            return True, f"HTTP {answer.status}", None
    except urllib.error.HTTPError as err:
        said = err.read(_ERROR_CHARS).decode("utf-8", "replace") if err.fp else ""
        after = (err.headers.get("Retry-After") or "").strip() if err.headers else ""
        return False, f"HTTP {err.code}: {said}".strip()[:_ERROR_CHARS], float(after) if after.isdigit() else None
    except (urllib.error.URLError, OSError, ValueError) as err:  # refused, DNS, TLS, timeout
        why = err.reason if isinstance(err, urllib.error.URLError) else err
        return False, f"{type(why).__name__}: {why}"[:_ERROR_CHARS], None


_ENQUEUE = """
INSERT INTO agentfast_notifications (run_id, call_id, idempotency_key, event)
SELECT %(run_id)s, %(call_id)s, %(key)s, %(event)s
WHERE EXISTS (SELECT 1 FROM agentfast_runs WHERE run_id = %(run_id)s AND run_uid = %(uid)s)
ON CONFLICT (run_id, call_id) DO NOTHING
"""
# A call decided before its notification went out needs none.
_SKIP_DECIDED = """
UPDATE agentfast_notifications n SET state = 'skipped', last_error = 'decided before it was delivered'
WHERE n.state = 'pending' AND EXISTS (SELECT 1 FROM agentfast_approvals a WHERE a.run_id = n.run_id AND a.call_id = n.call_id)
"""
# One statement, its own transaction: the claim is committed before the POST starts.
_CLAIM = """
UPDATE agentfast_notifications SET attempts = attempts + 1, next_attempt_at = now() + make_interval(secs => %(lease)s)
WHERE (run_id, call_id) = (
    SELECT run_id, call_id FROM agentfast_notifications
    WHERE state = 'pending' AND next_attempt_at <= now()
    ORDER BY next_attempt_at LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING run_id, call_id, idempotency_key, event, attempts
"""
_DELIVERED = """
UPDATE agentfast_notifications SET state = 'delivered', delivered_at = now(), last_error = NULL
WHERE run_id = %(run_id)s AND call_id = %(call_id)s AND attempts = %(attempts)s AND state = 'pending'
"""
_FAILED = """
UPDATE agentfast_notifications
SET last_error = %(error)s, next_attempt_at = now() + make_interval(secs => %(delay)s),
    state = CASE WHEN attempts >= %(max)s THEN 'failed' ELSE 'pending' END
WHERE run_id = %(run_id)s AND call_id = %(call_id)s AND attempts = %(attempts)s AND state = 'pending'
RETURNING state
"""


@dataclass
class _Offer:
    run_id: str
    call_id: str
    key: str
    uid: str
    event: dict[str, Any]


class Notifier:
    """Announces awaited calls to one webhook: :meth:`offer` (from any thread, never blocks on the
    network or Postgres) and a sender loop (:meth:`run`, or :meth:`start` for a daemon thread)
    with its own Postgres connection to ``dsn`` (the store's). ``warn(run, message)`` is called
    once when a notification is given up (``run``: the event's ``{namespace, name, uid}``); the
    operator posts a Warning Event with it. ``poll_s``: how often an idle sender looks for due
    retries (s). ``local``: events name the local CLI's commands instead of ``kubectl agentfast``."""

    def __init__(
        self,
        dsn: str,
        config: WebhookConfig,
        *,
        warn: Callable[[dict[str, str], str], None] | None = None,
        poll_s: float = 1.0,
        local: bool = False,
    ) -> None:
        self.local = local  # the events carry the local CLI's commands (:func:`commands`)
        self.dsn = dsn
        self.config = config
        self.warn = warn
        self.poll_s = poll_s
        self._queue: list[_Offer] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # Keys this process has written (or found) a row for: a republished status costs nothing.
        self._known: set[str] = set()
        #: POSTs this notifier made (any outcome), for logs and tests.
        self.posted = 0

    def offer(self, body: Mapping[str, Any], pending: PendingToolCall | None, listed: Sequence[Mapping[str, Any]]) -> int:
        """Queue a notification for each call of ``pending`` that ``listed`` (the new
        ``status.pendingApprovals``: ``{"callId", ...}``) shows as awaiting; ``body``: the
        AgentRun (its ``metadata`` namespace, name, uid). Returns how many were queued (0 for calls
        already known to this process). The row is written by the sender thread."""
        if pending is None or not listed:
            return 0
        meta = body["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        if not uid:
            return 0
        wanted = {p["callId"] for p in listed}
        siblings = [a.call_id for a in pending.awaiting]
        queued = 0
        with self._lock:
            for call in pending.awaiting:
                key = idempotency_key(uid, call.call_id)
                if call.call_id not in wanted or key in self._known:
                    continue
                if len(self._known) >= _KNOWN_MAX:  # only a shortcut: the table's key is what dedups
                    self._known.clear()
                self._known.add(key)
                event = pending_call_event(
                    namespace, name, uid, call, siblings, include_arguments=self.config.include_arguments, local=self.local
                )
                self._queue.append(_Offer(format_run_id(namespace, name), call.call_id, key, uid, event))
                queued += 1
        if queued:
            self._wake.set()
        return queued

    def start(self, stop: threading.Event) -> threading.Thread:
        """Run :meth:`run` in a daemon thread named ``agentfast-notify``; returns it."""
        thread = threading.Thread(target=self.run, args=(stop,), name="agentfast-notify", daemon=True)
        thread.start()
        return thread

    def run(self, stop: threading.Event) -> None:
        """The sender loop, until ``stop`` is set: write queued rows, skip decided calls, POST every
        due row. A lost Postgres connection is opened again after 2 s; nothing is lost meanwhile
        (queued offers stay queued, claimed rows come due again after their lease)."""
        while not stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5, row_factory=dict_row) as conn:
                    while not stop.is_set():
                        if not self.step(conn, stop):
                            self._wake.wait(self.poll_s)
                            self._wake.clear()
            except Exception:
                log.exception("notification sender failed; starting again")
                stop.wait(2.0)

    def step(self, conn: psycopg.Connection[DictRow], stop: threading.Event | None = None) -> int:
        """One pass on ``conn`` (autocommit): write the queued rows, mark decided calls skipped,
        then claim and POST due rows one at a time until none is due (or ``stop``). Returns the
        number of POSTs made. Raises psycopg errors (the queue is kept for the next pass)."""
        self.flush(conn)
        conn.execute(_SKIP_DECIDED)
        posted = 0
        while stop is None or not stop.is_set():
            row = conn.execute(_CLAIM, {"lease": self.config.lease_s}).fetchone()
            if row is None:
                break
            posted += 1
            self.posted += 1
            self._deliver(conn, row)
        return posted

    def flush(self, conn: psycopg.Connection[DictRow]) -> int:
        """Write the queued offers' rows on ``conn`` (autocommit; ``ON CONFLICT DO NOTHING``: a
        call already known to the table keeps its row and state). Returns how many offers were
        written or found. Raises psycopg errors, keeping the queue."""
        with self._lock:
            batch, self._queue = self._queue, []
        try:
            for o in batch:
                conn.execute(
                    _ENQUEUE, {"run_id": o.run_id, "call_id": o.call_id, "key": o.key, "uid": o.uid, "event": Jsonb(o.event)}
                )
        except BaseException:
            with self._lock:  # written again next time: ON CONFLICT makes that harmless
                self._queue[:0] = batch
            raise
        return len(batch)

    def _deliver(self, conn: psycopg.Connection[DictRow], row: DictRow) -> None:
        try:
            ok, said, after = post(self.config, render(row["event"], self.config.format), row["idempotency_key"])
        except Exception as err:  # a bug of ours must count as an attempt, or the row would retry for ever
            ok, said, after = False, f"{type(err).__name__}: {err}"[:_ERROR_CHARS], None
        where = {"run_id": row["run_id"], "call_id": row["call_id"], "attempts": row["attempts"]}
        if ok:
            conn.execute(_DELIVERED, where)
            log.info("notified %s call %s (attempt %d, %s)", row["run_id"], row["call_id"], row["attempts"], said)
            return
        # A receiver's Retry-After is honoured up to the backoff cap (a rate-limited Slack says how long).
        delay = max(self.config.backoff(row["attempts"]), min(after or 0.0, self.config.backoff_cap_s))
        done = conn.execute(_FAILED, {**where, "error": said, "delay": delay, "max": self.config.max_attempts}).fetchone()
        if done is not None and done["state"] == "failed":
            message = (f"gave up notifying the webhook of call {row['call_id']} after {row['attempts']} attempts: {said}")[:1024]
            log.warning("%s: %s", row["run_id"], message)
            if self.warn is not None:
                try:
                    self.warn(dict(row["event"]["run"]), message)
                except Exception:  # a Warning Event is a courtesy; the row says it all
                    log.exception("could not post the NotificationFailed event")
        else:
            log.info(
                "notifying %s call %s failed (attempt %d: %s); again in %.0f s",
                row["run_id"],
                row["call_id"],
                row["attempts"],
                said,
                delay,
            )


# -- a local run (runner/cli.py) ----------------------------------------------------------------

_LOCAL: dict[str, Notifier] = {}


def notify_local(dsn: str, run_id: str, run_uid: str, pending: PendingToolCall) -> bool:
    """For ``agentfast run``/``resume`` on this machine: announce every awaited call of ``pending``
    (run ``run_id`` = NS/NAME, uid ``run_uid``) when ``AGENTFAST_NOTIFY_URL`` is set, with the
    local CLI's commands; the rows live in the store of ``dsn`` as the operator's do, so a call is
    announced once whoever runs it. The sender is a daemon thread of this process: a call not
    delivered before the process ends goes out with the next sender (a later run or resume, or an
    operator on the same store). Returns whether notifications are on. Raises
    NotificationConfigError for malformed settings."""
    config = WebhookConfig.from_env()
    if config is None:
        return False
    notifier = _LOCAL.get(dsn)
    if notifier is None:
        notifier = _LOCAL[dsn] = Notifier(dsn, config, local=True)
        notifier.start(threading.Event())
    namespace, name = parse_run_id(run_id)
    body = {"metadata": {"namespace": namespace, "name": name, "uid": run_uid}}
    notifier.offer(body, pending, [{"callId": a.call_id} for a in pending.awaiting])
    return True
