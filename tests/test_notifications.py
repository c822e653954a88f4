"""Notifications (issue 18 item 4, runner/notify.py, operator/notify.py): a webhook POST per awaited call.

Against a real Postgres and a real HTTP receiver on localhost (``http.server`` in a thread: test
code only). What is defended: one POST per call with the right headers and body (generic and
Slack); nothing repeated on a republish or a restart; a receiver that is down, then answers 500,
then 200 gets the call once it is up, every attempt under the same idempotency key, and offering
never waits for it; two senders with their own connections plus a restart deliver each of 30
calls exactly once; a sender SIGKILLed mid-POST is retried once its claim's lease ran out, with
the same key (the at-least-once case the guarantee names); giving up is recorded and warned once;
a call decided first is never sent; hostile model text cannot form a Slack link or mention; a
real refund run's pending call is announced with a command that decides it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from agentfast.runner.notify import (
    ARGUMENTS_MAX_CHARS,
    NotificationConfigError,
    Notifier,
    WebhookConfig,
    pending_call_event,
    render,
    slack_escape,
    slack_payload,
)
from agentfast.runner.snapshot import AwaitedCall, PendingToolCall, ToolCall
from agentfast.runner.store import Store

from .helpers import agentrun_file, phase_of, run_cli, spawn_cli, wait_until
from .test_store import new_run, pause, planned

# -- a receiver ------------------------------------------------------------------------------------


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1: records every POST (headers, parsed body, time) and answers
    with ``statuses`` in turn (then 200); ``hold_s`` delays the answer to the first POST of each
    key listed in ``hold_keys`` (a lost answer, as the sender sees it)."""

    port: int
    statuses: list[int] = field(default_factory=list)
    hold_s: float = 0.0
    hold_keys: set[str] = field(default_factory=set)
    delay_s: float = 0.0
    retry_after: str = ""
    posts: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                key = self.headers.get("Idempotency-Key", "")
                with receiver.lock:
                    receiver.posts.append(
                        {
                            "headers": dict(self.headers.items()),
                            "body": json.loads(raw),
                            "at": time.monotonic(),
                            "path": self.path,
                        }
                    )
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                    hold = key in receiver.hold_keys
                    receiver.hold_keys.discard(key)
                if hold:
                    time.sleep(receiver.hold_s)
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                if status >= 300 and receiver.retry_after:
                    self.send_header("Retry-After", receiver.retry_after)
                self.end_headers()
                self.wfile.write(b"ok" if status < 300 else b"receiver says no")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def keys(self) -> list[str]:
        with self.lock:
            return [p["headers"].get("Idempotency-Key", "") for p in self.posts]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(free_port()).start()
    yield r
    r.stop()


def config(url: str, **kw: Any) -> WebhookConfig:
    base: dict[str, Any] = {"timeout_s": 2.0, "backoff_s": 0.05, "backoff_cap_s": 0.2, "lease_s": 5.0}
    return WebhookConfig(url=url, **{**base, **kw})


def awaited(
    call_id: str,
    tool: str = "issue_refund",
    arguments: str = '{"order_id": "A-1042", "amount": 42.5}',
    reason: str = "requires_approval",
) -> AwaitedCall:
    return AwaitedCall(
        call_id=call_id,
        iteration=1,
        position=0,
        tool_call=ToolCall(id="call_1", name=tool, arguments=arguments),
        idempotency_key=f"k-{call_id}",
        reason=reason,  # type: ignore[arg-type]
    )


def waiting_run(store: Store, name: str, calls: int = 1) -> tuple[dict[str, Any], PendingToolCall]:
    """A registered run whose batch awaits ``calls`` gated calls: (its AgentRun body, the pending)."""
    uid = str(uuid.uuid4())
    store.create_run(f"team-a/{name}", uid, {"spec": {"input": name}})
    pending = PendingToolCall.of([awaited(f"call-1-{i}") for i in range(calls)], [])
    return {"metadata": {"namespace": "team-a", "name": name, "uid": uid}}, pending


def listed(pending: PendingToolCall) -> list[dict[str, Any]]:
    return [{"callId": a.call_id} for a in pending.awaiting]


def rows(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute("SELECT * FROM agentfast_notifications ORDER BY run_id, call_id").fetchall()


def step(notifier: Notifier, dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return notifier.step(conn)


# -- the payloads (unit) ---------------------------------------------------------------------------


def test_generic_event_names_run_call_and_commands_and_leaves_arguments_out_by_default() -> None:
    event = pending_call_event(
        "shop", "refund-demo", "u-1", awaited("call-2-0"), ["call-2-0", "call-2-1"], include_arguments=False
    )
    assert event["type"] == "agentfast.pending_call" and event["idempotencyKey"] == "u-1:call-2-0"
    assert event["run"] == {"namespace": "shop", "name": "refund-demo", "uid": "u-1"}
    assert event["call"]["id"] == "call-2-0" and event["call"]["tool"] == "issue_refund"
    assert event["call"]["reason"] == "requires_approval"
    assert event["commands"] == {
        "approve": "kubectl agentfast approve refund-demo call-2-0 -n shop --uid u-1",
        "deny": "kubectl agentfast deny refund-demo call-2-0 --reason '...' -n shop --uid u-1",
    }
    assert event["siblings"] == ["call-2-1"]
    assert "arguments" not in event and "A-1042" not in json.dumps(event)
    rerun = pending_call_event(
        "shop", "r", "u", awaited("call-1-0-rerun1", reason="in_flight_not_idempotent"), [], include_arguments=False
    )
    assert rerun["commands"]["complete"] == "kubectl agentfast complete r call-1-0-rerun1 --result 'TEXT' -n shop --uid u"


def test_arguments_and_a_question_travel_only_when_opted_in() -> None:
    question = awaited(
        "ask-3", tool="ask_user", arguments=json.dumps({"question": "Card or store credit?"}), reason="awaiting_input"
    )
    off = pending_call_event("shop", "chat", "u", question, [], include_arguments=False)
    assert off["commands"] == {
        "reply": "kubectl agentfast reply chat '...' --call ask-3 -n shop --uid u",
        "end": "kubectl agentfast end chat --call ask-3 -n shop --uid u",  # issue 31 item 1: the person ends it
    }
    assert "question" not in off["call"] and "Card" not in json.dumps(off)
    on = pending_call_event("shop", "chat", "u", question, [], include_arguments=True)
    assert on["call"]["question"] == "Card or store credit?"
    big = pending_call_event(
        "shop", "r", "u", awaited("c", arguments="x" * (ARGUMENTS_MAX_CHARS + 10)), [], include_arguments=True
    )
    assert len(big["arguments"]) == ARGUMENTS_MAX_CHARS and big["argumentsTruncated"] is True


def test_slack_payload_escapes_hostile_model_text() -> None:
    hostile = json.dumps({"note": "<!channel> see <https://evil.example/x|your invoice> & ``` *now* `"})
    event = pending_call_event(
        "shop", "refund-demo", "u-1", awaited("call-2-0", tool="<@U123>refund", arguments=hostile), [], include_arguments=True
    )
    payload = slack_payload(event)
    texts = [payload["text"]]
    for block in payload["blocks"]:
        texts += [block["text"]["text"]] if "text" in block else [e["text"] for e in block["elements"]]
    assert len(texts) == 1 + len(payload["blocks"])
    whole = "\n".join(texts)
    for forbidden in ("<!channel>", "<https://", "<@U123>", "|your invoice>"):
        assert forbidden not in whole
    assert "&lt;!channel&gt;" in whole and "&lt;@U123&gt;" in whole and "&amp;" in whole
    # the only angle brackets, backtick fences and ampersands are our own escapes and code blocks
    assert "<" not in whole and ">" not in whole
    arguments_block = next(t for t in texts if t.startswith("*Arguments*"))
    assert arguments_block.count("```") == 2  # the model's ``` could not close our block
    assert payload["unfurl_links"] is False and "link_names" not in payload
    assert slack_escape("a&b<c>") == "a&amp;b&lt;c&gt;"
    # escaping grows the text (& is 5 characters to Slack): every section stays under Slack's 3000
    flood = slack_payload(pending_call_event("s", "r", "u", awaited("c", arguments="&" * 5000), [], include_arguments=True))
    sections = [b["text"]["text"] for b in flood["blocks"] if b["type"] == "section"]
    assert max(len(t) for t in sections) <= 3000
    flooded = next(t for t in sections if t.startswith("*Arguments*"))
    assert flooded.endswith("&amp;\u2026```") and "&amp&" not in flooded  # cut between entities, never inside one
    assert "kubectl agentfast approve refund-demo call-2-0 -n shop --uid u-1" in whole


def test_config_from_env() -> None:
    assert WebhookConfig.from_env({}) is None
    c = WebhookConfig.from_env(
        {
            "AGENTFAST_NOTIFY_URL": "https://hooks.slack.example/T/B/secret",
            "AGENTFAST_NOTIFY_FORMAT": "slack",
            "AGENTFAST_NOTIFY_INCLUDE_ARGUMENTS": "true",
            "AGENTFAST_NOTIFY_TOKEN": "tok",
            "AGENTFAST_NOTIFY_MAX_ATTEMPTS": "3",
        }
    )
    assert c is not None and c.format == "slack" and c.include_arguments and c.max_attempts == 3 and c.token == "tok"
    assert "secret" not in repr(c) and "tok" not in repr(c)
    assert [c.backoff(n) for n in (1, 2, 3, 9, 10, 40)] == [1, 2, 4, 256, 300, 300]
    for bad in ({"AGENTFAST_NOTIFY_FORMAT": "teams"}, {"AGENTFAST_NOTIFY_MAX_ATTEMPTS": "x"}):
        with pytest.raises(NotificationConfigError) as err:
            WebhookConfig.from_env({"AGENTFAST_NOTIFY_URL": "https://h.example/secret", **bad})
        assert "secret" not in str(err.value)
    with pytest.raises(NotificationConfigError):
        WebhookConfig.from_env({"AGENTFAST_NOTIFY_URL": "file:///etc/passwd"})


# -- delivery against Postgres and a receiver ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["generic", "slack"])
def test_each_call_is_posted_once_with_its_key_even_when_offered_again_and_after_a_restart(
    store: Store, dsn: str, receiver: Receiver, fmt: str
) -> None:
    body, pending = waiting_run(store, "refund-demo", calls=2)
    notifier = Notifier(dsn, config(receiver.url, format=fmt, token="s3cret"))
    assert notifier.offer(body, pending, listed(pending)) == 2
    assert notifier.offer(body, pending, listed(pending)) == 0  # a republished status
    assert step(notifier, dsn) == 2
    uid = body["metadata"]["uid"]
    assert sorted(receiver.keys()) == [f"{uid}:call-1-0", f"{uid}:call-1-1"]
    for post in receiver.posts:
        h = post["headers"]
        assert h["Content-Type"] == "application/json" and h["Authorization"] == "Bearer s3cret" and post["path"] == "/hook"
        if fmt == "generic":
            assert post["body"]["idempotencyKey"] == h["Idempotency-Key"] and post["body"]["run"]["uid"] == uid
            assert post["body"]["commands"]["approve"].startswith("kubectl agentfast approve refund-demo call-1-")
        else:
            assert set(post["body"]) >= {"text", "blocks"} and "refund-demo" in post["body"]["text"]
            assert h["Idempotency-Key"] in json.dumps(post["body"]["blocks"])
    assert [(r["state"], r["attempts"]) for r in rows(dsn)] == [("delivered", 1), ("delivered", 1)]
    # only a restart's re-offer: the table, not the process, remembers
    restarted = Notifier(dsn, config(receiver.url, format=fmt))
    assert restarted.offer(body, pending, listed(pending)) == 2
    assert step(restarted, dsn) == 0 and step(notifier, dsn) == 0
    assert len(receiver.posts) == 2
    # only the calls status lists (a decided one is no longer listed)
    other, p2 = waiting_run(store, "other", calls=2)
    assert restarted.offer(other, p2, [{"callId": "call-1-1"}]) == 1


def test_a_receiver_down_then_failing_then_up_gets_the_call_once_and_offering_never_waits(store: Store, dsn: str) -> None:
    port = free_port()  # nothing listens: connection refused
    body, pending = waiting_run(store, "refund-demo")
    notifier = Notifier(dsn, config(f"http://127.0.0.1:{port}/hook", max_attempts=100), poll_s=0.05)
    stop = threading.Event()
    thread = notifier.start(stop)
    receiver = Receiver(port, statuses=[500, 500])
    try:
        started = time.perf_counter()
        notifier.offer(body, pending, listed(pending))
        assert time.perf_counter() - started < 0.05  # a reconcile's publish only queues
        refused = wait_until(lambda: [r for r in rows(dsn) if r["attempts"] >= 2], what="two refused attempts")
        assert "Connection" in refused[0]["last_error"] and refused[0]["state"] == "pending"  # type: ignore[index]
        receiver.start()
        wait_until(lambda: rows(dsn)[0]["state"] == "delivered", what="the delivery", timeout=20)
        row = rows(dsn)[0]
        key = f"{body['metadata']['uid']}:call-1-0"
        assert receiver.keys() == [key, key, key]  # 500, 500, 200: the same key every time
        assert row["attempts"] >= 5 and row["delivered_at"] is not None and row["last_error"] is None
        time.sleep(0.3)
        assert len(receiver.posts) == 3  # nothing after the success
    finally:
        stop.set()
        thread.join(5)
        receiver.stop()


def test_giving_up_is_recorded_and_warned_once(store: Store, dsn: str, receiver: Receiver) -> None:
    receiver.statuses = [503] * 10
    body, pending = waiting_run(store, "refund-demo")
    warned: list[tuple[dict[str, str], str]] = []
    notifier = Notifier(dsn, config(receiver.url, max_attempts=3), warn=lambda run, msg: warned.append((run, msg)))
    notifier.offer(body, pending, listed(pending))
    assert step(notifier, dsn) == 1
    deadline = time.monotonic() + 10
    while rows(dsn)[0]["state"] == "pending" and time.monotonic() < deadline:
        step(notifier, dsn)
        time.sleep(0.05)
    row = rows(dsn)[0]
    assert (row["state"], row["attempts"]) == ("failed", 3) and "HTTP 503" in row["last_error"]
    assert len(receiver.posts) == 3
    assert len(warned) == 1 and warned[0][0]["name"] == "refund-demo" and "after 3 attempts" in warned[0][1]
    step(notifier, dsn)
    assert len(receiver.posts) == 3 and len(warned) == 1


def test_a_redirect_is_a_failed_attempt_not_a_delivery(store: Store, dsn: str, receiver: Receiver) -> None:
    receiver.statuses = [302]  # urllib would follow it with a GET, dropping the body
    body, pending = waiting_run(store, "refund-demo")
    notifier = Notifier(dsn, config(receiver.url))
    notifier.offer(body, pending, listed(pending))
    assert step(notifier, dsn) == 1
    row = rows(dsn)[0]
    assert (row["state"], row["attempts"]) == ("pending", 1) and row["last_error"].startswith("HTTP 302")
    wait_until(lambda: step(notifier, dsn), what="the retry")
    assert rows(dsn)[0]["state"] == "delivered" and len(receiver.posts) == 2


def test_a_rate_limited_receivers_retry_after_is_honoured(store: Store, dsn: str, receiver: Receiver) -> None:
    receiver.statuses, receiver.retry_after = [429], "2"  # Slack's answer when rate-limited
    body, pending = waiting_run(store, "refund-demo")
    notifier = Notifier(dsn, config(receiver.url, backoff_cap_s=5.0))  # its own backoff would be 0.05 s
    notifier.offer(body, pending, listed(pending))
    assert step(notifier, dsn) == 1
    with psycopg.connect(dsn) as conn:
        wait_s = conn.execute(
            "SELECT extract(epoch FROM next_attempt_at - now())::float8 FROM agentfast_notifications"
        ).fetchone()[0]  # type: ignore[index]
    assert 1.5 < wait_s <= 2.0 and rows(dsn)[0]["last_error"].startswith("HTTP 429")
    assert step(notifier, dsn) == 0  # not before the receiver said
    wait_until(lambda: step(notifier, dsn), what="the retry after Retry-After", timeout=10, interval=0.1)
    assert rows(dsn)[0]["state"] == "delivered" and receiver.posts[1]["at"] - receiver.posts[0]["at"] >= 1.8


def test_a_runner_role_has_no_right_on_the_notifications(store: Store, dsn: str, receiver: Receiver) -> None:
    body, pending = waiting_run(store, "refund-demo")  # in team-a, the role's own namespace
    notifier = Notifier(dsn, config(receiver.url))
    notifier.offer(body, pending, listed(pending))
    assert step(notifier, dsn) == 1
    role, _ = store.set_tenant_password("team-a", "pw-a")
    with psycopg.connect(psycopg.conninfo.make_conninfo(dsn, user=role, password="pw-a"), autocommit=True) as conn:
        for query in (
            "SELECT count(*) FROM agentfast_notifications",
            "UPDATE agentfast_notifications SET state = 'pending'",
            "INSERT INTO agentfast_notifications (run_id, call_id, idempotency_key, event) VALUES ('team-a/x', 'c', 'k', '{}')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(query)
    assert [(r["state"], r["attempts"]) for r in rows(dsn)] == [("delivered", 1)]


def test_a_call_decided_before_delivery_is_not_sent(store: Store, dsn: str, receiver: Receiver) -> None:
    run_id, uid, lease = new_run(store, "refund-demo")
    _, entries = planned(uid, 1, [("issue_refund", True, True), ("issue_refund", True, True)])
    store.save_turn(lease, *planned(uid, 1, [("issue_refund", True, True), ("issue_refund", True, True)]))
    pending = pause(store, lease, uid, entries, [e.call_id for e in entries])
    store.decide(run_id, entries[0].call_id, "approve", decided_by="test")
    notifier = Notifier(dsn, config(receiver.url))
    body = {"metadata": {"namespace": "default", "name": "refund-demo", "uid": uid}}
    notifier.offer(body, pending, listed(pending))
    assert step(notifier, dsn) == 1
    assert receiver.keys() == [f"{uid}:{entries[1].call_id}"]
    assert {r["call_id"]: r["state"] for r in rows(dsn)} == {entries[0].call_id: "skipped", entries[1].call_id: "delivered"}


def test_two_senders_and_a_restart_deliver_each_call_exactly_once(store: Store, dsn: str, receiver: Receiver) -> None:
    receiver.delay_s = 0.02  # POSTs overlap: both senders are busy at once
    runs = [waiting_run(store, f"run-{i}", calls=10) for i in range(3)]
    stops = [threading.Event() for _ in range(3)]
    senders = [Notifier(dsn, config(receiver.url), poll_s=0.05) for _ in range(3)]  # each its own connection
    threads = [senders[0].start(stops[0]), senders[1].start(stops[1])]
    for body, pending in runs:  # both operators see every status
        senders[0].offer(body, pending, listed(pending))
        senders[1].offer(body, pending, listed(pending))
    wait_until(lambda: len(receiver.posts) >= 5, what="the first deliveries")
    stops[0].set()  # operator A restarts ...
    threads[0].join(5)
    threads.append(senders[2].start(stops[2]))  # ... as A'
    for body, pending in runs:
        senders[2].offer(body, pending, listed(pending))
    try:
        wait_until(lambda: all(r["state"] == "delivered" for r in rows(dsn)) and len(rows(dsn)) == 30, what="30 deliveries")
        time.sleep(0.3)
        keys = receiver.keys()
        assert len(set(keys)) == 30 and len(keys) == 30  # no call twice, none missing
        assert {r["attempts"] for r in rows(dsn)} == {1}
        assert senders[0].posted > 0 and senders[1].posted > 0  # both worked the same rows
        assert sum(s.posted for s in senders) == 30
    finally:
        for s in stops:
            s.set()
        for t in threads:
            t.join(5)


_SENDER = """
import sys, threading
from agentfast.runner.notify import Notifier, WebhookConfig
config = WebhookConfig(url=sys.argv[2], timeout_s=3.0, lease_s=4.0, backoff_s=0.05, backoff_cap_s=0.2)
print("ready", flush=True)
Notifier(sys.argv[1], config, poll_s=0.05).run(threading.Event())
"""


@pytest.mark.process
def test_a_sender_killed_mid_post_is_retried_after_its_lease_with_the_same_key(
    store: Store, dsn: str, receiver: Receiver
) -> None:
    body, pending = waiting_run(store, "refund-demo")
    key = f"{body['metadata']['uid']}:call-1-0"
    # Written by an operator that then died before POSTing; the sender process finds it due.
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        writer = Notifier(dsn, config(receiver.url))
        writer.offer(body, pending, listed(pending))
        assert writer.flush(conn) == 1
    receiver.hold_keys, receiver.hold_s = {key}, 8.0  # the first answer never arrives in time
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER, dsn, receiver.url], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        wait_until(lambda: receiver.posts, what="the first POST")
        os.kill(proc.pid, signal.SIGKILL)  # mid-POST: no outcome recorded
        proc.wait(5)
        claimed = rows(dsn)[0]
        assert (claimed["state"], claimed["attempts"]) == ("pending", 1)
        after = Notifier(dsn, config(receiver.url))
        assert step(after, dsn) == 0  # the claim's lease still runs: nobody else POSTs meanwhile
        wait_until(lambda: step(after, dsn), what="the retry after the lease", timeout=10, interval=0.1)
        row = rows(dsn)[0]
        assert (row["state"], row["attempts"]) == ("delivered", 2)
        assert receiver.keys() == [key, key]  # at least once, always under one key
        assert receiver.posts[1]["at"] - receiver.posts[0]["at"] >= 3.0  # not before the lease ran out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.process
def test_a_real_refund_runs_pending_call_is_announced_with_a_command_that_decides_it(
    store: Store, dsn: str, receiver: Receiver, tmp_path: Any
) -> None:
    proc = spawn_cli("run", str(agentrun_file(tmp_path)), dsn=dsn)
    try:
        wait_until(lambda: phase_of(store, "default/refund-demo") == "WaitingForApproval", what="the run to wait for approval")
        loaded = store.load_context("default/refund-demo")
        assert loaded is not None and loaded[1] is not None
        pending = loaded[1]
        body = {"metadata": {"namespace": "default", "name": "refund-demo", "uid": store.get_run("default/refund-demo").run_uid}}  # type: ignore[union-attr]
        notifier = Notifier(dsn, config(receiver.url, include_arguments=True))
        notifier.offer(body, pending, listed(pending))
        assert step(notifier, dsn) == len(pending.awaiting) == 1
        event = receiver.posts[0]["body"]
        assert event["call"]["tool"] == "issue_refund" and "A-1042" in event["arguments"]
        approve = event["commands"]["approve"].split()
        assert approve[:5] == ["kubectl", "agentfast", "approve", "refund-demo", pending.awaiting[0].call_id]
        decided = run_cli("approve", "refund-demo", approve[4], dsn=dsn)  # the local CLI, same RUN and CALL
        assert decided.returncode == 0, decided.stdout
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and phase_of(store, "default/refund-demo") == "Succeeded", out
        assert len(receiver.posts) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.process
def test_a_local_run_notifies_once_with_local_commands_even_when_killed_and_resumed(
    store: Store, dsn: str, receiver: Receiver, tmp_path: Any
) -> None:
    env = {"AGENTFAST_NOTIFY_URL": receiver.url}
    proc = spawn_cli("run", str(agentrun_file(tmp_path)), dsn=dsn, env=env)
    try:
        wait_until(lambda: receiver.posts, what="the notification of the local run")
        event = receiver.posts[0]["body"]
        call = event["call"]["id"]
        assert event["commands"] == {
            "approve": f"agentfast approve refund-demo {call}",
            "deny": f"agentfast deny refund-demo {call} --reason '...'",
        }
        assert phase_of(store, "default/refund-demo") == "WaitingForApproval" and "arguments" not in event
        proc.kill()  # SIGKILL while it waits
        proc.communicate()
        proc = spawn_cli("resume", "refund-demo", dsn=dsn, env=env)  # it waits at the same call again
        wait_until(lambda: [r for r in rows(dsn) if r["state"] == "delivered"], what="the row")
        time.sleep(1.5)  # the resumed runner announced the call again: nothing new went out
        assert len(receiver.posts) == 1
        approve = run_cli(*event["commands"]["approve"].split()[1:], dsn=dsn)
        assert approve.returncode == 0, approve.stdout
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and phase_of(store, "default/refund-demo") == "Succeeded", out
        assert "waiting for approval" in out  # the resumed run did reach the wait, and announced it
        assert len(receiver.posts) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_render_is_utf8_json() -> None:
    event = pending_call_event("shop", "r", "u", awaited("c", arguments='{"name": "Zoë"}'), [], include_arguments=True)
    assert json.loads(render(event, "generic").decode()) == event
    assert json.loads(render(event, "slack").decode())["blocks"]


def test_the_operator_offers_every_listed_call_at_each_publish_even_without_a_status_change(monkeypatch: Any) -> None:
    """operator/main.py's wiring: publish_status queues the calls status lists, and does so before
    its no-change return (a restarted operator publishes an unchanged status and must re-offer)."""
    from agentfast.operator import main, notify
    from agentfast.runner.snapshot import RunContext, RunStatus, Session

    patches: list[dict[str, Any]] = []

    class _Custom:  # the API server's answer to a status patch; the only stand-in here
        def patch_namespaced_custom_object_status(
            self, group: str, version: str, ns: str, plural: str, name: str, body: dict, **_: Any
        ) -> None:
            patches.append(body["status"])

    monkeypatch.setattr(main.STATE, "custom", _Custom(), raising=False)
    monkeypatch.setattr(main, "_event", lambda *a, **kw: None)
    before = Notifier("dbname=unused", config("http://127.0.0.1:9/hook"))
    monkeypatch.setattr(notify, "_ACTIVE", [before])
    waiting = RunContext(session=Session(run_uid="u"), status=RunStatus(phase="WaitingForApproval", reason="AwaitingApproval"))
    pending = PendingToolCall.of([awaited("call-2-0"), awaited("call-2-1")], [])
    body = {"metadata": {"namespace": "shop", "name": "refund-demo", "uid": "u-1", "generation": 1}}
    main.publish_status(body, waiting, pending, decided={"call-2-1": "approve"})
    assert [o.call_id for o in before._queue] == ["call-2-0"]  # the decided one is not listed
    assert before._queue[0].event["commands"]["approve"] == "kubectl agentfast approve refund-demo call-2-0 -n shop --uid u-1"
    after = Notifier("dbname=unused", config("http://127.0.0.1:9/hook"))  # a restarted operator
    monkeypatch.setattr(notify, "_ACTIVE", [after])
    main.publish_status({**body, "status": patches[-1]}, waiting, pending, decided={"call-2-1": "approve"})
    assert len(patches) == 1 and [o.call_id for o in after._queue] == ["call-2-0"]
    done = RunContext(session=Session(run_uid="u"), status=RunStatus(phase="Succeeded"))
    fresh = Notifier("dbname=unused", config("http://127.0.0.1:9/hook"))
    monkeypatch.setattr(notify, "_ACTIVE", [fresh])
    main.publish_status(body, done, None)
    assert fresh._queue == []
