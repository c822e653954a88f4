"""A human in the conversation on a real cluster (issue 17 item 3, docs/conversation.md).

The recorded support conversation (manifests/examples/support-conversation.yaml): its runner pod
is deleted at every wait (three questions and one approval) and a new one resumes at the exact
step. The user answers through ``kubectl agentfast reply`` (a JSON patch appending to
``spec.replies``) under their own identity (a ServiceAccount token, nothing impersonated), and
the chart's admission policy holds replies to the approval right: an editor cannot reply, nobody
can reply as someone else, to a call that is not a question, or remove a reply.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

from .helpers import Kube
from .test_approval_policy import APPROVER_ROLE, Person, people, refused  # noqa: F401 (people is a fixture)
from .test_operator import events, refund_manifest, release, running_runner, sql, status  # noqa: F401 (release is a fixture)

REPLIES = {"call-1-0": "Sure, it's A-1042.", "call-3-0": "To my card, please.", "call-5-0": "No, that's all, thanks!"}


def wait_for_human(k: Kube, name: str, call_id: str, phase: str) -> dict:
    k.wait_for(
        f"{name} to wait on {call_id}",
        lambda: status(k, name).get("phase") in (phase, "Failed") and status(k, name).get("awaiting") == call_id,
        timeout=180,
    )
    st = status(k, name)
    assert st["phase"] == phase, st
    return st


def plugin(p: Person, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kubectl-agentfast")
    assert exe, "kubectl-agentfast (the agentfast console script) is not on PATH"
    env = {**os.environ, "KUBECONFIG": p.kube.kubeconfig}
    return subprocess.run([exe, *args, "-n", p.kube.namespace], env=env, capture_output=True, text=True, timeout=60)


def delete_runner(k: Kube, name: str) -> None:
    """Kill the run at its wait: delete its runner pod and wait until a new one holds the run."""
    first = k.wait_for("a running runner pod", lambda: running_runner(k, name))
    before = status(k, name).get("restarts", 0)
    k.run("delete", "pod", first, "--wait=false")
    k.wait_for("a replacement runner pod", lambda: running_runner(k, name, not_named=first), timeout=180)
    k.wait_for("the resumed runner", lambda: status(k, name).get("restarts", 0) > before, timeout=120)


def test_a_conversation_in_the_cluster_survives_its_pod_at_every_wait(release: Kube, people) -> None:
    k = release
    editor = people("editor", "edit")
    user = people("customer", APPROVER_ROLE)
    doc = refund_manifest(k, f"chat-{uuid.uuid4().hex[:6]}", example="support-conversation.yaml")
    name = doc["metadata"]["name"]
    refused(
        editor.kube.run(
            "apply",
            "-f",
            "-",
            input=json.dumps(
                {**doc, "spec": {**doc["spec"], "replies": [{"callId": "call-1-0", "text": "x", "repliedBy": editor.user}]}}
            ),
            check=False,
        ),
        "spec.replies cannot be set when an AgentRun is created",
    )
    editor.kube.apply(doc)
    uid = k.get("agentrun", name)["metadata"]["uid"]

    st = wait_for_human(k, name, "call-1-0", "WaitingForInput")
    assert st["pendingApprovals"][0]["tool"] == "ask_user" and st["pendingApprovals"][0]["reason"] == "awaiting_input"
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds["AwaitingInput"] == "True" and conds["AwaitingApproval"] == "False"
    delete_runner(k, name)
    assert status(k, name)["awaiting"] == "call-1-0"  # the same question, at the same step

    def patch_reply(p: Person, call_id: str, replied_by: str) -> subprocess.CompletedProcess[str]:
        body = [{"op": "add", "path": "/spec/replies", "value": [{"callId": call_id, "text": "hi", "repliedBy": replied_by}]}]
        return p.kube.run("patch", "agentrun", name, "--type", "json", "-p", json.dumps(body), check=False)

    refused(patch_reply(editor, "call-1-0", editor.user), f"user {editor.user} may not decide calls of agentrun {name}")
    refused(patch_reply(user, "call-1-0", editor.user), f"repliedBy must be your own user name, {user.user}")
    refused(patch_reply(user, "call-7-0", user.user), "call-7-0 is not a question awaiting a reply now")
    proc = plugin(editor, "reply", name, REPLIES["call-1-0"])
    assert proc.returncode == 2 and "may not decide calls" in proc.stdout + proc.stderr, proc.stdout + proc.stderr

    proc = plugin(user, "reply", name, REPLIES["call-1-0"])
    assert proc.returncode == 0 and f"call-1-0 answered by {user.user}" in proc.stdout, proc.stdout + proc.stderr
    removed = k.run("patch", "agentrun", name, "--type", "json", "-p", '[{"op":"remove","path":"/spec/replies"}]', check=False)
    refused(removed, "spec.replies is append-only")  # even by the cluster admin

    wait_for_human(k, name, "call-3-0", "WaitingForInput")
    delete_runner(k, name)
    proc = plugin(user, "reply", name, REPLIES["call-3-0"])
    assert proc.returncode == 0, proc.stdout + proc.stderr

    st = wait_for_human(k, name, "call-4-0", "WaitingForApproval")
    assert st["pendingApprovals"][0]["tool"] == "issue_refund"
    proc = plugin(user, "reply", name, "yes", "--call", "call-4-0")
    assert proc.returncode == 2 and "not a question awaiting a reply" in proc.stdout + proc.stderr
    delete_runner(k, name)
    proc = plugin(user, "approve", name, "call-4-0")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    wait_for_human(k, name, "call-5-0", "WaitingForInput")
    delete_runner(k, name)
    proc = plugin(user, "reply", name, REPLIES["call-5-0"])
    assert proc.returncode == 0, proc.stdout + proc.stderr

    k.wait_for(f"{name} to end", lambda: status(k, name).get("phase") in ("Succeeded", "Failed"), timeout=180)
    st = status(k, name)
    assert st["phase"] == "Succeeded" and st["result"].startswith("finished after 6 iterations"), st
    assert st["restarts"] >= 4
    assert [(d["callId"], d["decision"]) for d in st["decisions"]] == [
        ("call-1-0", "reply"),
        ("call-3-0", "reply"),
        ("call-4-0", "approve"),
        ("call-5-0", "reply"),
    ]
    assert {d["decidedBy"] for d in st["decisions"]} == {f"kubernetes:{user.user}"}
    spec_replies = k.get("agentrun", name)["spec"]["replies"]
    assert [(r["callId"], r["text"], r["repliedBy"]) for r in spec_replies] == [(c, t, user.user) for c, t in REPLIES.items()]
    run_id = f"{k.namespace}/{name}"
    # The model read each reply once, as the result of its question.
    rows = sql(k, "SELECT message FROM agentfast_messages WHERE run_id = %s ORDER BY seq", run_id)
    said = [r[0]["content"] for r in rows if r[0]["role"] == "tool" and r[0].get("name") == "ask_user"]
    assert said == list(REPLIES.values())
    # The agent's goodbye, then its end_conversation call's result (issue 31 item 1: the call ends the run).
    assert rows[-2][0]["content"] == "You're welcome! Have a great day."
    assert rows[-1][0]["role"] == "tool" and rows[-1][0]["name"] == "end_conversation"
    # Each effect once, across four pod deletions.
    for tool in ("lookup_order", "add_case_note"):
        got = sql(
            k,
            "SELECT count(*) FROM agentfast_examples.demo_tool_invocations WHERE tool = %s AND idempotency_key LIKE %s",
            tool,
            f"{uid}:%",
        )
        assert got == [[1]], tool
    assert sql(k, "SELECT count(*) FROM agentfast_examples.demo_refund_ledger WHERE idempotency_key LIKE %s", f"{uid}:%") == [[1]]
    assert len(events(k, name, "Decided")) == 4


def test_the_person_ends_the_conversation_with_kubectl_agentfast_end(release: Kube, people) -> None:
    """Issue 31 item 1: ``kubectl agentfast end`` appends ``{callId, end: true, repliedBy}`` to
    ``spec.replies`` on the reply's authorization path; the run ends ``Succeeded`` without asking
    the model again (its second turn, which expects the order number, is never requested)."""
    k = release
    editor = people("editor", "edit")
    user = people("customer", APPROVER_ROLE)
    doc = refund_manifest(k, f"chat-{uuid.uuid4().hex[:6]}", example="support-conversation.yaml")
    name = doc["metadata"]["name"]
    editor.kube.apply(doc)
    wait_for_human(k, name, "call-1-0", "WaitingForInput")
    proc = plugin(editor, "end", name)
    assert proc.returncode == 2 and "may not decide calls" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc = plugin(user, "end", name)
    assert proc.returncode == 0 and "the conversation ended at call-1-0" in proc.stdout, proc.stdout + proc.stderr
    k.wait_for(f"{name} to end", lambda: status(k, name).get("phase") in ("Succeeded", "Failed"), timeout=180)
    st = status(k, name)
    assert st["phase"] == "Succeeded" and st["result"].startswith("finished after 1 iterations"), st
    assert [(d["callId"], d["decision"]) for d in st["decisions"]] == [("call-1-0", "end")]
    assert k.get("agentrun", name)["spec"]["replies"] == [{"callId": "call-1-0", "end": True, "repliedBy": user.user}]
    proc = plugin(user, "reply", name, "hello?")
    assert proc.returncode == 2, proc.stdout + proc.stderr
