"""The approvals inbox the chart deploys (``ui.enabled``; docs/ui.md), on a real cluster.

It has no Kubernetes identity of its own: each person logs in with their own token (a
ServiceAccount token here, nothing impersonated) and every read and decision goes to the API
server as them. So a person without a token is sent to the login page, a token the API server
does not accept logs no one in, an editor (who may patch AgentRuns but lacks the approval right)
is refused by the chart's admission policy with its message, and the approver's denial, made in
a real Chromium through ``kubectl port-forward``, is recorded with the approver as decidedBy. The
run then finishes on the page without a reload, and the refund never ran.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from ..browser import after_click, chromium, free_port, shot
from .helpers import Kube
from .test_approval_policy import APPROVER_ROLE, Person, people  # noqa: F401 (people is a fixture)
from .test_operator import refund_manifest, release, sql, status  # noqa: F401 (release is a fixture)

REASON = "the customer was refunded by phone already"


def token_of(p: Person) -> str:
    return str(yaml.safe_load(Path(p.kube.kubeconfig).read_text())["users"][0]["user"]["token"])


@contextmanager
def port_forward(k: Kube, target: str, port: int) -> Iterator[str]:
    """``kubectl port-forward TARGET LOCAL:PORT``; yields the local base URL once it answers."""
    local = free_port()
    cmd = [k.kubectl, "--kubeconfig", k.kubeconfig, "-n", k.namespace, "port-forward", target, f"{local}:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{local}"

    def up() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        k.wait_for(f"port-forward to {target}", up, timeout=60, interval=0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', html)
    assert found, html[:500]
    return found.group(1)


def test_the_deployed_inbox_acts_as_each_person_and_the_policy_holds(release: Kube, people) -> None:
    k = release
    approver = people("inbox-approver", APPROVER_ROLE)
    editor = people("inbox-editor", "edit")
    doc = refund_manifest(k, f"inbox-{uuid.uuid4().hex[:6]}")
    name = doc["metadata"]["name"]
    k.apply(doc)
    k.wait_for(f"{name} to await call-2-0", lambda: status(k, name).get("awaiting") == "call-2-0", timeout=180)
    k.run("rollout", "status", "deploy/agentfast-ui", "--timeout=180s")
    with port_forward(k, "svc/agentfast-ui", 80) as base:
        assert httpx.get(f"{base}/", follow_redirects=False).headers.get("location") == "/login"
        bad = httpx.post(f"{base}/login", data={"token": "not-a-token"})
        assert bad.status_code == 401 and "cannot learn who you are" in bad.text, bad.text

        # An editor may read the run and patch AgentRuns, but not decide: the admission policy says no.
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token_of(editor)}"}) as as_editor:
            page = as_editor.get(f"/runs/{k.namespace}/{name}")
            assert page.status_code == 200 and editor.user in page.text and "call-2-0" in page.text
            refused = as_editor.post(
                f"/runs/{k.namespace}/{name}/decide",
                data={"call_id": "call-2-0", "decision": "approve", "csrf": _csrf(page.text)},
            )
            assert refused.status_code == 409 and "the API server refused the patch" in refused.text, refused.text
        assert not (k.get("agentrun", name) or {}).get("spec", {}).get("approvals")

        with chromium() as browser:
            browser.get(f"{base}/")
            browser.find_element(By.ID, "token").send_keys(token_of(approver))
            browser.find_element(By.ID, "login").click()
            waiting = after_click(browser, "waiting")
            assert f"{k.namespace}/{name}" in waiting and "issue_refund" in waiting, waiting
            assert browser.find_element(By.ID, "user").text == approver.user
            shot(browser, "e2e-01-inbox-as-approver")
            browser.get(f"{base}/runs/{k.namespace}/{name}")
            # The transcript and the sibling's result come from Postgres, for a run this person may read.
            assert "charged twice" in browser.find_element(By.ID, "transcript").text
            assert "add_case_note" in browser.find_element(By.CSS_SELECTOR, "ul.siblings").text
            browser.find_element(By.ID, "deny-call-2-0").send_keys(REASON)
            browser.find_element(By.CSS_SELECTOR, "#call-call-2-0 button.deny").click()
            outcome = after_click(browser, "outcome")
            assert f"call-2-0 deny ({REASON}) by {approver.user}" in outcome, outcome
            shot(browser, "e2e-02-denied")
            browser.execute_script("window.agentfastSamePage = true;")
            WebDriverWait(browser, 180, poll_frequency=0.5).until(lambda b: b.find_element(By.ID, "phase").text == "Succeeded")
            assert browser.execute_script("return window.agentfastSamePage === true;")
            # Recorded by the operator as a decision made through Kubernetes, by this person.
            assert f"call-2-0 deny by kubernetes:{approver.user}" in browser.find_element(By.ID, "decisions").text
            shot(browser, "e2e-03-finished")
    st = status(k, name)
    assert st["phase"] == "Succeeded", st
    assert [(d["callId"], d["decision"], d["decidedBy"]) for d in st["decisions"]] == [
        ("call-2-0", "deny", f"kubernetes:{approver.user}")
    ]
    uid = k.get("agentrun", name)["metadata"]["uid"]
    # Denied: the refund never ran.
    assert sql(k, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key LIKE %s", f"{uid}:%") == [[0]]
