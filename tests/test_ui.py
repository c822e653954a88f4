"""The approvals inbox (``agentfast ui``, runner/ui.py, docs/ui.md) on real parts: a real Postgres,
a real runner process waiting for a decision, the inbox served by uvicorn in its own process, and a
real headless Chromium (Debian's chromium and chromium-driver, driven by selenium; hack/lib.sh
``ensure_chromium`` installs them).

The person's story: open the inbox, see the pending refund with its arguments and the sibling that
already ran, deny it with a reason, and watch the run finish on the same page (live updates, no
reload). Screenshots go to ``$AGENTFAST_ARTIFACTS/ui`` (default ``test-artifacts/ui`` in the
checkout). Also: text from models and tools is shown as text (HTML in it neither renders nor runs),
a forged or cross-site post decides nothing, and the inbox that decides as you listens only on
loopback. The cluster inbox (each person's own token) is tested on the cluster tier
(tests/e2e/test_ui.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from agentfast.runner.store import Store

from .browser import after_click, chromium, free_port, shot
from .conformance import invocations, refunds
from .helpers import agentrun_file, phase_of, run_cli, spawn_cli, wait_until

pytestmark = pytest.mark.process

REASON = "customer withdrew the request by phone"


@dataclass
class Inbox:
    """An ``agentfast ui`` process: ``base`` URL and the ``token`` its printed address carries."""

    base: str
    token: str
    printed: str  # the line it printed on start

    @property
    def entry(self) -> str:
        return f"{self.base}/?token={self.token}"

    @contextmanager
    def client(self) -> Iterator[httpx.Client]:
        """An HTTP client that entered with the token (it holds the inbox's cookie)."""
        with httpx.Client(base_url=self.base, follow_redirects=True) as client:
            entered = client.get(f"/?token={self.token}")
            assert entered.status_code == 200 and client.cookies, entered.text[:300]
            yield client


@contextmanager
def inbox_server(dsn: str) -> Iterator[Inbox]:
    """``agentfast ui --dsn DSN`` in its own process; yields it once it answers."""
    port, token = free_port(), uuid.uuid4().hex
    proc = spawn_cli("ui", "--port", str(port), dsn=dsn, env={"AGENTFAST_UI_TOKEN": token})
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"agentfast ui exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30, what="agentfast ui to answer", interval=0.2)
    assert proc.stdout is not None
    printed = proc.stdout.readline()
    try:
        yield Inbox(base, token, printed)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def refund_run(tmp_path: Path, name: str, **spec: object) -> tuple[Path, str]:
    path = agentrun_file(tmp_path, uid=str(uuid.uuid4()), **spec)
    path.write_text(path.read_text().replace("name: refund-demo", f"name: {name}"))
    return path, f"default/{name}"


def test_a_person_denies_the_pending_refund_in_a_browser_and_watches_the_run_finish(
    tmp_path: Path, dsn: str, store: Store
) -> None:
    path, run_id = refund_run(tmp_path, "inbox-refund")
    runner = spawn_cli("run", str(path), "--wait", dsn=dsn)  # waits for the decision in its own process
    try:
        wait_until(lambda: phase_of(store, run_id) == "WaitingForApproval", timeout=60, what="the refund to await approval")
        with inbox_server(dsn) as inbox, chromium() as browser:
            browser.get(inbox.entry)
            waiting = browser.find_element(By.ID, "waiting")
            assert "issue_refund" in waiting.text and run_id in waiting.text and "call-2-0" in waiting.text, waiting.text
            assert "A-1042" in waiting.text and "4999" in waiting.text, waiting.text
            shot(browser, "01-inbox")

            browser.find_element(By.CSS_SELECTOR, f"#waiting a[href='/runs/{run_id}']").click()
            after_click(browser, "call-call-2-0")
            call = browser.find_element(By.ID, "call-call-2-0")
            assert '"amount_cents": 4999' in call.find_element(By.CSS_SELECTOR, "pre.arguments").text
            siblings = browser.find_element(By.CSS_SELECTOR, "ul.siblings").text
            assert "call-2-1" in siblings and "add_case_note" in siblings, siblings  # G5: already ran, shown beside it
            assert "I was charged twice" in browser.find_element(By.ID, "transcript").text
            shot(browser, "02-pending-refund")

            browser.find_element(By.ID, "deny-call-2-0").send_keys(REASON)
            browser.find_element(By.CSS_SELECTOR, "#call-call-2-0 button.deny").click()
            outcome = after_click(browser, "outcome")
            assert "call-2-0: deny" in outcome and REASON in outcome, outcome
            shot(browser, "03-denied")

            # Live: the page learns the run's end from the server's events, without a reload.
            browser.execute_script("window.agentfastSamePage = true;")
            try:
                WebDriverWait(browser, 60, poll_frequency=0.3).until(lambda b: b.find_element(By.ID, "phase").text == "Succeeded")
            except TimeoutException:
                pytest.fail(
                    f"the page did not show Succeeded (the store says {phase_of(store, run_id)}); its console:"
                    f" {browser.get_log('browser')}"
                )
            assert browser.execute_script("return window.agentfastSamePage === true;"), "the page was reloaded"
            assert browser.current_url.endswith(f"/runs/{run_id}"), browser.current_url  # a reload posts nothing again
            transcript = browser.find_element(By.ID, "transcript").text
            assert REASON in transcript, transcript  # the model read the reason as the call's result
            decisions = browser.find_element(By.ID, "decisions").text
            assert "call-2-0 deny" in decisions and "cli:" in decisions, decisions
            shot(browser, "04-finished")
        out, _ = runner.communicate(timeout=60)
        assert runner.returncode == 0, out
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert refunds(dsn) == 0 and invocations(dsn, "issue_refund") == 0  # denied: the refund never ran
    [d] = store.decision_log(run_id)
    assert (d["call_id"], d["decision"], d["reason"]) == ("call-2-0", "deny", REASON)
    assert d["decided_by"].startswith("cli:"), d


#: Text that is markup in HTML (and in a template, and in the console), in every place a model,
#: a tool or a user puts text. None of it may render or run.
HOSTILE = {
    "input": "Refund <script>window.agentfastPwned = 'input'</script> order A-1042 {{ 7*7 }} [bold]now[/bold]",
    "content": "Checking <img src=x onerror=\"window.agentfastPwned='content'\"> & </pre></div><b>bold</b> {% raw %}",
    "reason": '<iframe src="javascript:window.agentfastPwned=\'reason\'"></iframe>" onmouseover="x',
    "final": "Done </li></ol><script>window.agentfastPwned='final'</script> ref [provide code] {{ config }}",
}


def hostile_run(tmp_path: Path) -> tuple[Path, str]:
    script = {
        "model": "scripted-hostile",
        "turns": [
            {
                "content": HOSTILE["content"],
                "tool_calls": [
                    {
                        "id": "c1",
                        "name": "issue_refund",
                        "arguments": {"order_id": "A-1042", "amount_cents": 100, "reason": HOSTILE["reason"]},
                    }
                ],
            },
            {"content": HOSTILE["final"]},
        ],
    }
    script_path = tmp_path / "hostile.yaml"
    script_path.write_text(yaml.safe_dump(script))
    model = {"name": "scripted-hostile", "script": str(script_path)}
    return refund_run(tmp_path, "inbox-hostile", model=model, input=HOSTILE["input"])


def test_text_from_models_and_tools_is_shown_as_text_not_markup(tmp_path: Path, dsn: str, store: Store) -> None:
    path, run_id = hostile_run(tmp_path)
    got = run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert phase_of(store, run_id) == "WaitingForApproval", got.stdout
    with inbox_server(dsn) as inbox, inbox.client() as http:
        html = http.get(f"/runs/{run_id}").text
        assert "<script>window" not in html and "<img src=x" not in html and "<iframe" not in html
        assert "&lt;script&gt;window.agentfastPwned" in html
        csp = http.get("/").headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
        with chromium() as browser:
            browser.get(inbox.entry)
            for page in ("/", f"/runs/{run_id}"):
                browser.get(inbox.base + page)
                assert browser.execute_script("return window.agentfastPwned === undefined;"), page
                for tag in ("img", "iframe", "b"):
                    assert not browser.find_elements(By.CSS_SELECTOR, f"main {tag}"), (page, tag)
                assert not browser.find_elements(By.CSS_SELECTOR, "main script"), page
            text = browser.find_element(By.ID, "transcript").text
            for key in ("input", "content"):
                assert HOSTILE[key] in text, (key, text)  # byte for byte, as the model and the user wrote it
            arguments = browser.find_element(By.CSS_SELECTOR, "#pending pre.arguments").text
            assert json.dumps(HOSTILE["reason"]) in arguments, arguments  # the tool's arguments, as JSON text
            shot(browser, "05-hostile-text")
            browser.find_element(By.CSS_SELECTOR, "#pending button.approve").click()
            assert "call-1-0: approve" in after_click(browser, "outcome")
    resumed = run_cli("resume", run_id.removeprefix("default/"), dsn=dsn)
    assert resumed.returncode == 0, resumed.stdout
    with inbox_server(dsn) as inbox, chromium() as browser:
        browser.get(inbox.entry)
        browser.get(f"{inbox.base}/runs/{run_id}")
        assert browser.find_element(By.ID, "phase").text == "Succeeded"
        assert browser.execute_script("return window.agentfastPwned === undefined;")
        assert HOSTILE["final"] in browser.find_element(By.ID, "transcript").text


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', html)
    assert found, html[:500]
    return found.group(1)


def test_a_forged_or_cross_site_post_decides_nothing_and_a_refusal_says_why(tmp_path: Path, dsn: str, store: Store) -> None:
    path, run_id = refund_run(tmp_path, "inbox-forgery")
    run_cli("run", str(path), "--no-wait", dsn=dsn)
    assert phase_of(store, run_id) == "WaitingForApproval"
    with inbox_server(dsn) as inbox, inbox.client() as http:
        base = inbox.base
        assert f"{base}/?token={inbox.token}" in inbox.printed, inbox.printed
        # Another account of this machine reaches loopback too: without the address's token, nothing.
        for stranger in (httpx.get(f"{base}/runs/{run_id}"), httpx.get(f"{base}/?token=guess")):
            assert stranger.status_code == 401 and "call-2-0" not in stranger.text, stranger.text
        stranger_post = httpx.post(f"{base}/runs/{run_id}/decide", data={"call_id": "call-2-0", "decision": "approve"})
        assert stranger_post.status_code == 401
        url = f"/runs/{run_id}/decide"
        page = http.get(f"/runs/{run_id}")
        token = _csrf(page.text)
        form = {"call_id": "call-2-0", "decision": "approve"}

        no_token = http.post(url, data=form)
        assert no_token.status_code == 403 and "CSRF" in no_token.text
        wrong_token = http.post(url, data={**form, "csrf": "0" * 64})
        assert wrong_token.status_code == 403
        cross_site = http.post(url, data={**form, "csrf": token}, headers={"Origin": "https://evil.example"})
        assert cross_site.status_code == 403 and "evil.example" in cross_site.text
        huge = http.post(url, content=b"text=" + b"x" * 70_000, headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert huge.status_code == 413  # refused before it is read: forms here are a few fields
        assert http.get("/runs/Not_A_Namespace/x").status_code == 404  # only Kubernetes names reach a store or an API path
        rebound = http.get("/", headers={"Host": "evil.example"})
        assert rebound.status_code == 400  # DNS rebinding onto the loopback inbox
        assert store.decision_log(run_id) == [] and [a.call_id for a in store.awaiting(run_id)] == ["call-2-0"]

        no_reason = http.post(url, data={"call_id": "call-2-0", "decision": "deny", "text": " ", "csrf": token})
        assert no_reason.status_code == 409 and "a denial needs a reason" in no_reason.text
        not_awaited = http.post(url, data={"call_id": "call-2-1", "decision": "approve", "csrf": token})
        assert not_awaited.status_code == 409 and "call-2-1" in not_awaited.text
        stale = http.post(url, data={**form, "csrf": token, "uid": str(uuid.uuid4())})
        assert stale.status_code == 409 and "re-created" in stale.text
        assert store.decision_log(run_id) == []

        approved = http.post(url, data={**form, "csrf": token, "uid": store.get_run(run_id).run_uid})
        assert approved.status_code == 200 and "call-2-0: approve recorded" in approved.text, approved.text
        assert "agentfast resume inbox-forgery" in approved.text  # no runner holds it: say how it goes on
        again = http.post(url, data={"call_id": "call-2-0", "decision": "deny", "text": "no", "csrf": token})
        assert again.status_code == 409 and "already decided" in again.text  # write-once
    assert [(d["call_id"], d["decision"]) for d in store.decision_log(run_id)] == [("call-2-0", "approve")]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--host", "0.0.0.0"], "listens only on a loopback address"),
        (["--auth", "token"], "--auth token is for the cluster"),
    ],
)
def test_the_inbox_that_decides_as_you_listens_only_on_loopback(args: list[str], said: str) -> None:
    from agentfast.runner.cli import app

    got = CliRunner().invoke(app, ["ui", *args])
    assert got.exit_code == 2 and said in got.output, got.output
