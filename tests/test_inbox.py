"""The inbox's parts without a browser (runner/inbox.py, runner/ui.py's Access; docs/ui.md): whose
credentials a cluster request carries, what a request must hold, and the local inbox on a real
store. The browser and the cluster are in tests/test_ui.py and tests/e2e/test_ui.py."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import kubernetes
import pytest
from starlette.requests import Request

from agentfast.runner import ui
from agentfast.runner.inbox import LocalInbox, Refused, api_server_configuration, token_client
from agentfast.runner.store import Store
from agentfast.runner.ui import TOKEN_COOKIE, Access

from .helpers import run_cli


def _request(headers: dict[str, str] | None = None, cookies: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if cookies:
        raw.append((b"cookie", "; ".join(f"{k}={v}" for k, v in cookies.items()).encode()))
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw, "query_string": b""})


def test_a_cluster_request_carries_the_persons_token_and_nothing_of_the_inboxs_own() -> None:
    base = kubernetes.client.Configuration()
    base.host = "https://10.0.0.1:443"
    base.ssl_ca_cert = "/ca.crt"
    base.cert_file, base.key_file = "/admin.crt", "/admin.key"  # a kubeconfig's client certificate
    base.api_key = {"BearerToken": "Bearer the-inboxs-own"}
    base.refresh_api_key_hook = lambda cfg: None
    cfg = token_client("the-persons-token", base).configuration
    assert (cfg.host, cfg.ssl_ca_cert) == ("https://10.0.0.1:443", "/ca.crt")
    assert cfg.cert_file is None and cfg.key_file is None and cfg.refresh_api_key_hook is None
    assert cfg.auth_settings()["BearerToken"]["value"] == "Bearer the-persons-token"


def test_in_a_pod_the_api_server_comes_from_the_environment_and_no_token_is_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv("AGENTFAST_KUBE_CA_FILE", str(tmp_path / "ca.crt"))
    cfg = api_server_configuration()  # no service account token exists here: none is needed
    assert (cfg.host, cfg.ssl_ca_cert) == ("https://[fd00::1]:6443", str(tmp_path / "ca.crt"))
    assert not cfg.api_key


def test_what_a_request_must_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ui, "_same_user", lambda request: True)  # its own test is below
    shared = Access(shared=object(), secret="s3cret-s3cret-s3cret")  # type: ignore[arg-type]
    assert shared.credential(_request()) is None
    assert shared.credential(_request(cookies={shared.cookie: "guess"})) is None
    assert shared.credential(_request(cookies={shared.cookie: "\u00e9t\u00e9"})) is None  # not ASCII: no 500
    assert shared.credential(_request(cookies={shared.cookie: "s3cret-s3cret-s3cret"})) == "s3cret-s3cret-s3cret"
    assert shared.credential(_request(cookies={TOKEN_COOKIE: "s3cret-s3cret-s3cret"})) is None  # another inbox's cookie name
    assert shared.cookie != Access(shared=object(), secret="other").cookie  # type: ignore[arg-type]
    monkeypatch.setattr(ui, "_same_user", lambda request: False)
    assert shared.credential(_request(cookies={shared.cookie: "s3cret-s3cret-s3cret"})) is None  # another account's socket

    per_person = Access(token_inbox=lambda t: None)  # type: ignore[arg-type,return-value]
    assert per_person.credential(_request({"Authorization": "Bearer abc.def-ghi"})) == "abc.def-ghi"
    for bad in ("Bearer ", "Basic abc", "Bearer a b"):
        assert per_person.credential(_request({"Authorization": bad})) is None, bad
    # The login cookie holds the token encrypted: the raw token is no cookie, a leaked cookie is no token.
    cookie = per_person.cookie_value("abc.def-ghi")
    assert "abc.def-ghi" not in cookie
    assert per_person.credential(_request(cookies={TOKEN_COOKIE: cookie})) == "abc.def-ghi"
    assert per_person.credential(_request(cookies={TOKEN_COOKIE: "abc.def-ghi"})) is None
    other_install = Access(token_inbox=lambda t: None)  # type: ignore[arg-type,return-value]
    assert other_install.credential(_request(cookies={TOKEN_COOKIE: cookie})) is None  # another key
    # CSRF tokens: bound to the credential, the same on every replica, different per person.
    a, b = (_request({"Authorization": f"Bearer {t}"}) for t in ("alice-token", "bob-token"))
    assert per_person.csrf_token(a) == other_install.csrf_token(a)
    assert per_person.csrf_token(a) != per_person.csrf_token(b)


def test_a_connection_is_known_as_its_accounts() -> None:
    """The local inbox serves only its own OS user's sockets (/proc/net/tcp's uid column). As root,
    a connection made by the account ``nobody`` is told apart; as another user, the own one only."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(2)
        port = listener.getsockname()[1]

        def scope_of(connect: Callable[[], None]) -> Request:
            connect()
            conn, (host, client_port) = listener.accept()
            try:
                return Request({"type": "http", "headers": [], "client": (host, client_port), "server": ("127.0.0.1", port)})
            finally:
                held.append(conn)

        held: list[socket.socket] = []
        mine = socket.create_connection(("127.0.0.1", port))
        assert ui._same_user(scope_of(lambda: None))
        if os.geteuid() == 0:
            code = f"import socket,time; s=socket.create_connection(('127.0.0.1',{port})); time.sleep(5)"
            theirs = subprocess.Popen(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", code])
            try:
                assert not ui._same_user(scope_of(lambda: None))
            finally:
                theirs.kill()
                theirs.wait()
        mine.close()
        for c in held:
            c.close()


def _scope(client: tuple[str, int], server: tuple[str, int]) -> Request:
    return Request({"type": "http", "headers": [], "client": client, "server": server})


@pytest.mark.skipif(os.geteuid() != 0, reason="binding a socket as another OS user needs root")
@pytest.mark.parametrize("family", ["ipv4", "dual-stack"])
def test_another_accounts_socket_on_127_0_0_2_with_our_port_is_not_ours(family: str) -> None:
    """The attack of issue 30 item 7, on real sockets and the real /proc/net/tcp: our own
    connection 127.0.0.1:P -> inbox, and one of the account ``nobody`` bound to 127.0.0.2:P, the
    same port, to the same inbox. Matching ports alone took the second for ours; the whole
    4-tuple tells them apart. ``dual-stack``: the inbox listens on ``::``, so the scope shows
    both clients as ``::ffff:127.0.0.x`` while their rows are plain IPv4."""
    six = family == "dual-stack"
    listener = socket.socket(socket.AF_INET6 if six else socket.AF_INET)
    held: list[socket.socket] = [listener]
    theirs: subprocess.Popen[bytes] | None = None
    try:
        if six:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind(("::" if six else "127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        server = ("::ffff:127.0.0.1" if six else "127.0.0.1", port)

        mine = socket.create_connection(("127.0.0.1", port))
        held.append(mine)
        conn, ours_seen = listener.accept()
        held.append(conn)
        victim_port = mine.getsockname()[1]
        assert ours_seen[1] == victim_port
        code = (
            "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.2', int(sys.argv[1])));"
            " s.connect(('127.0.0.1', int(sys.argv[2]))); print('connected', flush=True); time.sleep(30)"
        )
        theirs = subprocess.Popen(
            ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", code, str(victim_port), str(port)],
            stdout=subprocess.PIPE,
        )
        assert theirs.stdout is not None and theirs.stdout.readline().strip() == b"connected"
        conn2, theirs_seen = listener.accept()
        held.append(conn2)
        assert theirs_seen[1] == victim_port and theirs_seen[0].endswith("127.0.0.2")  # the port is the victim's

        assert not ui._same_user(_scope(theirs_seen[:2], server))  # refused: only the address differs
        assert ui._same_user(_scope(ours_seen[:2], server))  # (with ports alone, one of the two was wrong)
        # A tuple no socket has is nobody's; a port that is ours on another address is not ours.
        assert not ui._same_user(_scope((ours_seen[0], victim_port ^ 1), server))
        assert not ui._same_user(_scope(("127.0.0.3", victim_port), server))
    finally:
        if theirs is not None:
            theirs.kill()
            theirs.wait()
        for s in held:
            s.close()


def test_proc_net_ends_are_read_as_the_kernel_writes_them() -> None:
    """/proc/net/tcp6 writes an address as four 32-bit words in host order; a v4-mapped one
    compares as its IPv4 address."""
    import ipaddress
    import sys

    if sys.byteorder != "little":
        pytest.skip("the hex below is a little-endian host's")
    assert ui._proc_end("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert ui._proc_end("0200007F:0050") == (ipaddress.ip_address("127.0.0.2"), 80)
    assert ui._proc_end("00000000000000000000000001000000:1F90") == (ipaddress.ip_address("::1"), 8080)
    assert ui._proc_end("0000000000000000FFFF00000100007F:0016") == (ipaddress.ip_address("127.0.0.1"), 22)
    assert ui._end("::ffff:127.0.0.1", 1) == ui._end("127.0.0.1", 1)


@pytest.mark.process
def test_the_local_inbox_lists_decides_and_moves_its_version(tmp_path: Path, dsn: str, store: Store) -> None:
    from .helpers import agentrun_file

    path = agentrun_file(tmp_path)
    run_cli("run", str(path), "--no-wait", dsn=dsn)
    inbox = LocalInbox(store, "cli:tester")
    [row] = inbox.runs()
    assert (row.key, row.phase, [c.call_id for c in row.pending]) == ("default/refund-demo", "WaitingForApproval", ["call-2-0"])
    assert inbox.runs("other") == [] and len(inbox.runs("default")) == 1
    view = inbox.run("default/refund-demo")
    assert view is not None and [s.call_id for s in view.siblings] == ["call-2-1"]
    assert view.messages and view.messages[-1].tool_calls[0].name == "issue_refund"  # the paused turn, shown with its calls
    before, listed = inbox.version("default/refund-demo"), inbox.version()
    with pytest.raises(Refused, match="a denial needs a reason"):
        inbox.decide("default/refund-demo", "call-2-0", "deny", reason="  ")
    with pytest.raises(Refused, match="re-created"):
        inbox.decide("default/refund-demo", "call-2-0", "approve", uid="not-its-uid")
    assert inbox.version("default/refund-demo") == before  # nothing recorded, nothing changed
    said = inbox.decide("default/refund-demo", "call-2-0", "approve", uid=view.uid)
    assert said == "call-2-0: approve recorded for default/refund-demo by cli:tester"
    assert inbox.version("default/refund-demo") != before and inbox.version() != listed
    assert inbox.runs()[0].pending == ()
    assert inbox.run("default/nothing") is None


def test_an_api_server_that_does_not_answer_is_a_refusal_not_a_crash() -> None:
    from agentfast.runner.inbox import KubeInbox

    base = kubernetes.client.Configuration()
    base.host = "https://127.0.0.1:9"  # nothing listens there
    inbox = KubeInbox(token_client("a-token", base), "default")
    with pytest.raises(Refused, match="cannot list agentruns in namespace default"):
        inbox.runs()
    with pytest.raises(Refused, match="cannot learn who you are"):
        inbox.user  # noqa: B018
    with pytest.raises(Refused, match="cannot read agentrun default/x"):
        inbox.decide("default/x", "call-1-0", "approve")


SPEND = "tokens 562 / 8000, cost 0.001658 / 0.01 USD"  # the refund script's first two replies at 2 + 8 per million


@pytest.mark.process
def test_the_prompt_status_and_inbox_show_spend_against_budget(tmp_path: Path, dsn: str, store: Store) -> None:
    """Issue 31 item 3: whoever is asked to approve sees what the run has spent against its
    budget, the same line everywhere (runner/budget.py spend_summary: one cost, one rounding)."""
    from .helpers import agentrun_file

    model = {
        "name": "scripted-refund",
        "script": "refund",
        "prices": {"promptPerMillionTokens": 2, "completionPerMillionTokens": 8},
    }
    budget = {"max_iterations": 10, "max_tokens": 8000, "max_duration_ms": 120000, "max_cost": 0.01}
    path = agentrun_file(tmp_path, model=model, budget=budget)
    done = run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert done.returncode == 0, done.stdout
    assert f"spent so far: {SPEND}" in " ".join(done.stdout.split()), done.stdout
    status = run_cli("status", "refund-demo", dsn=dsn).stdout
    assert SPEND in " ".join(status.split()), status
    import json

    doc = json.loads(run_cli("status", "refund-demo", "-o", "json", dsn=dsn).stdout)
    assert doc["spend"] == {
        "tokens": 562,
        "max_tokens": 8000,
        "cost": pytest.approx(0.001658),
        "max_cost": 0.01,
        "currency": "USD",
        "summary": SPEND,
    }
    [row] = LocalInbox(store, "cli:tester").runs()
    assert row.pending and row.spend == SPEND


def test_a_cluster_inbox_shows_spend_from_the_agentruns_status() -> None:
    from agentfast.runner.inbox import KubeInbox

    body = {
        "metadata": {"namespace": "default", "name": "r"},
        "spec": {"budget": {"max_tokens": 8000}},
        "status": {
            "phase": "WaitingForApproval",
            "usage": {"totalTokens": 562},
            "cost": {"amount": 0.001658, "currency": "USD", "maxCost": 0.01},
        },
    }
    assert KubeInbox._row(body).spend == SPEND
    body["status"]["cost"] = {"amount": 0.5, "currency": "EUR"}
    assert KubeInbox._row(body).spend == "tokens 562 / 8000, cost 0.50 EUR (no max_cost)"
    del body["status"]["cost"]
    assert KubeInbox._row(body).spend == "tokens 562 / 8000, cost not counted (no prices)"
    assert KubeInbox._row({"metadata": body["metadata"], "status": {}}).spend is None
