"""The inbox's parts without a browser (runner/inbox.py, runner/ui.py's Access; docs/ui.md): whose
credentials a cluster request carries, what a request must hold, and the local inbox on a real
store. The browser and the cluster are in tests/test_ui.py and tests/e2e/test_ui.py."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest
from starlette.requests import Request

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


def test_what_a_request_must_hold() -> None:
    shared = Access(shared=object(), secret="s3cret")  # type: ignore[arg-type]
    assert shared.credential(_request()) is None
    assert shared.credential(_request(cookies={shared.cookie: "guess"})) is None
    assert shared.credential(_request(cookies={shared.cookie: "s3cret"})) == "s3cret"
    assert shared.credential(_request(cookies={TOKEN_COOKIE: "s3cret"})) is None  # another inbox's cookie name
    assert shared.cookie != Access(shared=object(), secret="other").cookie  # type: ignore[arg-type]
    per_person = Access(token_inbox=lambda t: None)  # type: ignore[arg-type,return-value]
    assert per_person.credential(_request({"Authorization": "Bearer abc.def-ghi"})) == "abc.def-ghi"
    assert per_person.credential(_request(cookies={TOKEN_COOKIE: "abc"})) == "abc"
    for bad in ("Bearer ", "Basic abc", "Bearer a b"):
        assert per_person.credential(_request({"Authorization": bad})) is None, bad
    # CSRF tokens: bound to the credential, the same on every replica, different per person.
    a, b = (_request({"Authorization": f"Bearer {t}"}) for t in ("alice-token", "bob-token"))
    assert per_person.csrf_token(a) == Access(token_inbox=lambda t: None).csrf_token(a)  # type: ignore[arg-type,return-value]
    assert per_person.csrf_token(a) != per_person.csrf_token(b)


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
