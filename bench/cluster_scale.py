"""Cluster benchmark (issue 6, the cluster parts): resume after a runner pod is deleted, and
the operator under N concurrent AgentRuns, on the real cluster the project's scripts built.

    bash bench/cluster_scale.sh [--runs N] [--resume-reps R] [--skip-resume] [--skip-scale]

Needs the chart installed as release ``agentfast`` in ``agentfast-system`` (operator, bundled
Postgres). Every AgentRun it creates carries the label ``agentfast.dev/bench-session=<id>`` and
is deleted at the end (also on error or Ctrl-C); it waits until their runner pods are gone.

1. **Resume**: apply the refund AgentRun, wait for WaitingForApproval, delete the runner pod,
   and time: the old pod's graceful exit, the operator creating the replacement, the
   replacement reaching Running, and the replacement runner's takeover checkpoint being
   committed (the first ``agentfast_checkpoints`` row with a newer epoch; ``saved_at`` is the
   runner's own clock, the same kernel clock as this host's). Then approve and wait Succeeded.
1b. **Losses** (issue 14 item 1): for each kind of loss (the pod deleted, evicted through the
   Eviction API, its runner process SIGKILLed on the host), one run loses its runner five times
   while it waits; each loss is timed from the loss to the replacement's takeover commit, so the
   fifth loss shows any growing backoff.
2. **Scale**: N AgentRuns at once (capped by the node's free pod slots and free CPU requests:
   a runner requests 50m CPU), wait all WaitingForApproval, approve all, wait all Succeeded.
   Status lag = when a ``list agentruns`` poll (every 0.2 s) first shows Succeeded minus the
   runner's Succeeded checkpoint ``saved_at``. Operator peak RSS is VmHWM of the ``kopf run``
   process (host /proc); runner peak RSS is VmHWM of each ``agentfast resume`` process, sampled
   every second while it lives. API requests come from ``apiserver_request_total`` deltas (all
   clients of the cluster, minus the requests this script made itself).

Stdlib + ``kubernetes`` + ``PyYAML``; nothing else from the repository is imported.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from . import CACHE

REPO = Path(__file__).resolve().parents[1]
NS = os.environ.get("AGENTFAST_NAMESPACE", "agentfast-system")
KUBECONFIG = os.environ.get("KUBECONFIG", str(CACHE / "cluster" / "kubeconfig"))
GROUP, VERSION, PLURAL = "agentfast.dev", "v1alpha1", "agentruns"
SESSION_LABEL = "agentfast.dev/bench-session"
RUNNER_CPU_REQUEST_M = 50  # operator/workload.py RunnerConfig.resources (the chart does not override it)
CALL = "call-2-0"


def _kubectl() -> str:
    if os.environ.get("KUBECTL"):
        return os.environ["KUBECTL"]
    built = sorted(glob.glob(str(CACHE / "k8s-bin" / "*" / "kubectl")))
    return built[-1] if built else "kubectl"


KUBECTL = _kubectl()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- statistics --------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(xs: list[float]) -> dict[str, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {"n": 0, "median": math.nan, "min": math.nan, "max": math.nan}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs), "p95": pct(xs, 95)}


def fmt(s: dict[str, float], unit: str = "s", d: int = 2) -> str:
    if not s["n"]:
        return "n/a"
    return f"{s['median']:.{d}f} {unit} ({s['min']:.{d}f}–{s['max']:.{d}f}, n={s['n']})"


# -- cluster access ----------------------------------------------------------------------------


class Cluster:
    def __init__(self) -> None:
        kubernetes.config.load_kube_config(KUBECONFIG)
        self.custom = kubernetes.client.CustomObjectsApi()
        self.core = kubernetes.client.CoreV1Api()
        self.own_requests = 0  # API requests this script made (subtracted from the apiserver's count)
        self._lock = threading.Lock()

    def _count(self, n: int = 1) -> None:
        with self._lock:
            self.own_requests += n

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        self._count()
        p = subprocess.run([KUBECTL, "--kubeconfig", KUBECONFIG, *args], capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args[:4])}: {p.stderr.strip()}")
        return p.stdout

    def sql(self, query: str, *params: Any) -> list[list[Any]]:
        code = (
            "import json,os,sys,psycopg\n"
            "c=psycopg.connect(host='127.0.0.1',user='postgres',password=os.environ['POSTGRES_PASSWORD'],dbname='postgres')\n"
            "q,p=json.loads(sys.argv[1])\n"
            "print(json.dumps([list(r) for r in c.execute(q,p).fetchall()],default=str))\n"
        )
        # exec is several requests (create + stream); count it as 2
        self._count(1)
        out = self.kubectl(
            "-n", NS, "exec", "deploy/agentfast-postgresql", "--", "python", "-c", code, json.dumps([query, list(params)])
        )
        return json.loads(out)

    def create_run(self, name: str, session: str, suspend_after: int = 0) -> None:
        doc = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())
        doc["metadata"] = {"name": name, "namespace": NS, "labels": {SESSION_LABEL: session}}
        # 0: the runner keeps its pod while it waits (the losses timed); else it releases it after that, s
        doc["spec"]["suspendAfter"] = suspend_after
        self._count()
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, doc)

    def get_run(self, name: str) -> dict[str, Any]:
        self._count()
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)

    def list_runs(self, session: str) -> list[dict[str, Any]]:
        self._count()
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, label_selector=f"{SESSION_LABEL}={session}")[
            "items"
        ]

    def approve(self, name: str) -> None:
        self._count()
        self.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            name,
            {"spec": {"approvals": {CALL: {"decision": "approve", "decidedBy": self.whoami()}}}},
            _content_type="application/merge-patch+json",
        )

    def whoami(self) -> str:
        """The user the API server sees (the approval policy wants decidedBy to be it)."""
        if not hasattr(self, "_user"):
            review = kubernetes.client.AuthenticationV1Api().create_self_subject_review(kubernetes.client.V1SelfSubjectReview())
            self._user = review.status.user_info.username
        return self._user

    def give_example_tools(self) -> None:
        """The Secret agentfast-tools in NS with the example tools' own DSN (docs/tools.md)."""
        dsn = self.kubectl(
            "-n", NS, "exec", "deploy/agentfast-postgresql", "--", "python", "-m", "agentfast.runner.examples"
        ).strip()
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "agentfast-tools", "namespace": NS},
            "stringData": {"EXAMPLE_TOOLS_DSN": dsn},
        }
        self._count()
        p = subprocess.run(
            [KUBECTL, "--kubeconfig", KUBECONFIG, "apply", "-f", "-"], input=json.dumps(secret), capture_output=True, text=True
        )
        if p.returncode != 0:
            raise RuntimeError(f"kubectl apply agentfast-tools: {p.stderr.strip()}")

    def runner_pods(self, selector: str) -> list[Any]:
        self._count()
        return self.core.list_namespaced_pod(NS, label_selector=selector).items

    def request_totals(self) -> dict[str, float]:
        """Sum of apiserver_request_total, overall and per resource."""
        self._count()
        text = self.kubectl("get", "--raw", "/metrics", timeout=60)
        totals: dict[str, float] = {"_all": 0.0}
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels, _, value = line.rpartition(" ")
            v = float(value)
            totals["_all"] += v
            m = re.search(r'resource="([^"]*)"', labels)
            res = m.group(1) if m else ""
            totals[res] = totals.get(res, 0.0) + v
        return totals

    def cleanup(self, session: str, timeout: float = 300) -> None:
        log(f"deleting AgentRuns with {SESSION_LABEL}={session}")
        try:
            self.kubectl("-n", NS, "delete", "agentrun", "-l", f"{SESSION_LABEL}={session}", "--wait=true", timeout=timeout)
        except Exception as err:  # keep going: the pods check below is what matters
            log(f"delete: {err}")
        deadline = time.time() + timeout
        while time.time() < deadline:
            pods = [p for p in self.runner_pods("agentfast.dev/run") if p.metadata.name.startswith(f"agentrun-csb-{session}")]
            if not pods:
                log("all runner pods of this session are gone")
                return
            time.sleep(2)
        log(f"WARNING: {len(pods)} runner pods still present after {timeout}s")


def wait_for(what: str, pred: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


# -- host /proc --------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def pids_matching(needle: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            pids.append(int(d))
    return pids


def kopf_pid() -> int | None:
    """The acting operator's host pid: of the operator replicas (``python -m agentfast.operator``)
    the one with the largest resident set (the leader runs kopf; a standby only waits)."""
    pids = pids_matching("-m agentfast.operator ")
    return max(pids, key=lambda p: proc_status(p).get("VmRSS", 0)) if pids else None


def machine() -> dict[str, Any]:
    mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(int(mem) / 1024 / 1024, 1),
        "kernel": platform.release(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }


# -- 1. resume after the runner pod is deleted ------------------------------------------------------


class PodWatch(threading.Thread):
    """Poll the run's pods every 50 ms; note when each pod is first seen, Running, and gone/terminal."""

    def __init__(self, k: Cluster, run: str) -> None:
        super().__init__(daemon=True)
        self.k, self.run_name = k, run
        self.seen: dict[str, dict[str, float]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                pods = self.k.runner_pods(f"agentfast.dev/run={self.run_name}")
            except Exception:
                time.sleep(0.1)
                continue
            now = time.time()
            names = set()
            for p in pods:
                n = p.metadata.name
                names.add(n)
                rec = self.seen.setdefault(n, {"first_seen": now})
                cs = (p.status.container_statuses or [None])[0]
                if p.status.phase == "Running" and cs is not None and cs.state.running is not None:
                    rec.setdefault("running", now)
                if p.status.phase in ("Succeeded", "Failed"):
                    rec.setdefault("terminal", now)
            for n, rec in self.seen.items():
                if n not in names:
                    rec.setdefault("gone", now)
            time.sleep(0.05)


def resume_trial(k: Cluster, session: str, i: int) -> dict[str, float]:
    name = f"csb-{session}-r{i}"
    run_id = f"{NS}/{name}"
    t0 = time.time()
    k.create_run(name, session)
    wait_for(
        f"{name} WaitingForApproval", lambda: (k.get_run(name).get("status") or {}).get("phase") == "WaitingForApproval", 240
    )
    t_wfa = time.time()
    [[e0]] = k.sql("SELECT max(epoch) FROM agentfast_checkpoints WHERE run_id = %s", run_id)
    watch = PodWatch(k, name)
    watch.start()
    first = wait_for("a running runner pod", lambda: next((n for n, r in watch.seen.items() if "running" in r), None), 60, 0.05)
    t_del = time.time()
    k.core.delete_namespaced_pod(first, NS)
    k._count()
    new = wait_for(
        "the replacement pod Running",
        lambda: next((n for n, r in watch.seen.items() if n != first and "running" in r), None),
        300,
        0.05,
    )

    def takeover() -> Any:
        rows = k.sql("SELECT min(saved_at), count(*) FROM agentfast_checkpoints WHERE run_id = %s AND epoch > %s", run_id, e0)
        return rows[0] if rows[0][1] else None

    saved_at_ms, _ = wait_for("the takeover checkpoint", takeover, 120, 0.3)
    t_commit = saved_at_ms / 1000
    old, rep = watch.seen[first], watch.seen[new]
    old_exit = min(old.get("terminal", math.inf), old.get("gone", math.inf))
    # the replacement waits for status.restarts and awaiting before it is approved
    wait_for(
        "the resumed runner waiting",
        lambda: (s := k.get_run(name).get("status") or {}).get("restarts", 0) >= 1 and s.get("awaiting") == CALL,
        120,
    )
    t_appr = time.time()
    k.approve(name)
    wait_for(f"{name} Succeeded", lambda: (k.get_run(name).get("status") or {}).get("phase") == "Succeeded", 180, 0.1)
    t_succ = time.time()
    watch.stop.set()
    r = {
        "create_to_waiting_s": t_wfa - t0,
        "delete_to_commit_s": t_commit - t_del,
        "delete_to_running_s": rep["running"] - t_del,
        "running_to_commit_s": t_commit - rep["running"],
        "delete_to_old_exit_s": old_exit - t_del if old_exit != math.inf else math.nan,
        "old_exit_to_new_pod_s": rep["first_seen"] - old_exit if old_exit != math.inf else math.nan,
        "new_pod_to_running_s": rep["running"] - rep["first_seen"],
        "approve_to_succeeded_s": t_succ - t_appr,
    }
    log(f"resume {i}: " + ", ".join(f"{k_}={v:.2f}" for k_, v in r.items()))
    return r


def bench_resume(k: Cluster, session: str, reps: int) -> dict[str, Any]:
    trials = [resume_trial(k, session, i) for i in range(reps)]
    keys = trials[0].keys()
    return {"trials": trials, "summary": {key: spread([t[key] for t in trials]) for key in keys}}


def _lose(k: Cluster, name: str, kind: str) -> float:
    """Lose the run's live runner one way; returns the moment of the loss (time.time())."""
    pod = wait_for(
        "a running runner pod",
        lambda: next(
            (
                p.metadata.name
                for p in k.runner_pods(f"agentfast.dev/run={name}")
                if p.status.phase == "Running" and not p.metadata.deletion_timestamp
            ),
            None,
        ),
        60,
        0.05,
    )
    if kind == "kill":
        pids = wait_for("the runner process on this host", lambda: pids_matching(f"resume {NS}/{name} "), 30, 0.05)
        t = time.time()
        for pid in pids:
            os.kill(pid, 9)
        return t
    t = time.time()
    if kind == "delete":
        k._count()
        k.core.delete_namespaced_pod(pod, NS)
    else:
        k._count()
        k.core.create_namespaced_pod_eviction(
            pod, NS, kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=pod, namespace=NS))
        )
    return t


def loss_trial(k: Cluster, session: str, kind: str, i: int, losses: int) -> list[float]:
    """One run that loses its runner ``losses`` times (``kind``: delete, evict, kill) while it waits;
    seconds from each loss to the replacement runner's takeover commit."""
    name = f"csb-{session}-{kind[:3]}{i}"
    run_id = f"{NS}/{name}"
    k.create_run(name, session)
    wait_for(
        f"{name} WaitingForApproval", lambda: (k.get_run(name).get("status") or {}).get("phase") == "WaitingForApproval", 240
    )
    took = []
    for n in range(1, losses + 1):
        wait_for("the runner to hold the run", lambda: (k.get_run(name).get("status") or {}).get("restarts", 0) >= n - 1, 60, 0.1)
        [[e0]] = k.sql("SELECT max(epoch) FROM agentfast_checkpoints WHERE run_id = %s", run_id)
        t_loss = _lose(k, name, kind)
        rows = wait_for(
            "the takeover checkpoint",
            lambda: (
                (r := k.sql("SELECT min(saved_at) FROM agentfast_checkpoints WHERE run_id = %s AND epoch > %s", run_id, e0))[0][0]
                and r
            ),
            120,
            0.2,
        )
        took.append(rows[0][0] / 1000 - t_loss)
    log(f"losses {kind} {i}: " + ", ".join(f"{t:.2f}" for t in took))
    k.approve(name)
    wait_for(f"{name} Succeeded", lambda: (k.get_run(name).get("status") or {}).get("phase") == "Succeeded", 180, 0.2)
    return took


def decision_trial(k: Cluster, session: str, i: int, suspend: bool) -> float:
    """Approve the refund of a waiting run and time approve -> the refund's tool call started (its
    journal row's ``started_at``), with the runner still there or after it released its pod."""
    name = f"csb-{session}-{'sus' if suspend else 'hot'}{i}"
    run_id = f"{NS}/{name}"
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS, "labels": {SESSION_LABEL: session}}
    doc["spec"]["suspendAfter"] = 2 if suspend else 0
    k._count()
    k.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, doc)

    def ready() -> bool:
        st = k.get_run(name).get("status") or {}
        suspended = any(c.get("type") == "Suspended" and c.get("status") == "True" for c in st.get("conditions") or [])
        return st.get("phase") == "WaitingForApproval" and suspended == suspend

    wait_for(f"{name} waiting{' and suspended' if suspend else ''}", ready, 240, 0.2)
    if not suspend:
        wait_for("the runner to listen", lambda: (k.get_run(name).get("status") or {}).get("awaiting") == CALL, 60, 0.1)
    t = time.time()
    k.approve(name)
    [[started]] = wait_for(
        "the refund call to start",
        lambda: (
            (
                r := k.sql(
                    "SELECT extract(epoch FROM started_at)::float8 FROM agentfast_tool_calls WHERE run_id = %s AND call_id = %s"
                    " AND started_at IS NOT NULL",
                    run_id,
                    CALL,
                )
            )
            and r
        ),
        120,
        0.1,
    )
    wait_for(f"{name} Succeeded", lambda: (k.get_run(name).get("status") or {}).get("phase") == "Succeeded", 180, 0.2)
    log(f"decision {'suspended' if suspend else 'runner present'} {i}: {started - t:.2f} s")
    return started - t


def bench_decisions(k: Cluster, session: str, reps: int) -> dict[str, Any]:
    return {
        key: spread([decision_trial(k, session, i, key == "suspended") for i in range(reps)])
        for key in ("runner_present", "suspended")
    }


def bench_losses(k: Cluster, session: str, reps: int, losses: int = 5) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("delete", "evict", "kill"):
        trials = [loss_trial(k, session, kind, i, losses) for i in range(reps)]
        every = [t for tr in trials for t in tr]
        out[kind] = {
            "trials": trials,
            "first": spread([tr[0] for tr in trials]),
            "fifth": spread([tr[-1] for tr in trials]),
            "all": spread(every),
            "p50": pct(every, 50),
            "p99": pct(every, 99),
        }
    return out


# -- 2. N concurrent AgentRuns --------------------------------------------------------------------


def capacity(k: Cluster) -> dict[str, int]:
    node = k.core.list_node().items[0]
    k._count()
    alloc_pods = int(node.status.allocatable["pods"])
    cpu = node.status.allocatable["cpu"]
    alloc_cpu_m = int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)
    pods = [p for p in k.core.list_pod_for_all_namespaces().items if p.status.phase not in ("Succeeded", "Failed")]
    k._count()
    used_m = 0
    for p in pods:
        for c in p.spec.containers:
            req = ((c.resources and c.resources.requests) or {}).get("cpu")
            if req:
                used_m += int(req[:-1]) if req.endswith("m") else int(float(req) * 1000)
    free_pods = alloc_pods - len(pods) - 2  # headroom: an operator/postgres restart must still fit
    free_cpu_runs = (alloc_cpu_m - used_m) // RUNNER_CPU_REQUEST_M
    return {
        "alloc_pods": alloc_pods,
        "running_pods": len(pods),
        "alloc_cpu_m": alloc_cpu_m,
        "requested_cpu_m": used_m,
        "max_by_pods": free_pods,
        "max_by_cpu": free_cpu_runs,
        "max": min(free_pods, free_cpu_runs),
    }


def waiting_cost(k: Cluster, session: str) -> dict[str, int]:
    """What the session's waiting runs hold now: runner pods not ended (Pending or Running), the
    CPU they request (m), and the runners' Postgres sessions (runner roles, ``agentfast_r_*``)."""
    pods = [p for p in k.runner_pods(f"{SESSION_LABEL}={session}") if p.status.phase not in ("Succeeded", "Failed")]
    cpu_m = sum(
        int(str(((c.resources and c.resources.requests) or {}).get("cpu", "0m")).rstrip("m") or 0)
        for p in pods
        for c in p.spec.containers
    )
    [[conns]] = k.sql("SELECT count(*) FROM pg_stat_activity WHERE usename LIKE 'agentfast_r_%%'")
    return {"live_runner_pods": len(pods), "requested_cpu_m": cpu_m, "runner_pg_sessions": int(conns)}


def bench_scale(k: Cluster, session: str, n_req: int, suspend_after: int = 0) -> dict[str, Any]:
    """N concurrent runs to WaitingForApproval, approve all, wait all Succeeded. With
    ``suspend_after`` (s) the runs release their pods while they wait: before approving, wait
    until every run says Suspended and count what they still hold (:func:`waiting_cost`)."""
    cap = capacity(k)
    n = min(n_req, cap["max"])
    if n < n_req:
        log(f"capping N={n_req} to {n}: {cap}")
    pid = kopf_pid()
    op_before = proc_status(pid) if pid else {}
    others = [
        r
        for r in k.custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]
        if (r.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        and SESSION_LABEL not in (r["metadata"].get("labels") or {})
    ]
    k._count()
    own0 = k.own_requests
    req0 = k.request_totals()
    names = [f"csb-{session}-s{i}" for i in range(n)]
    seen: dict[str, dict[str, float]] = {nm: {} for nm in names}
    runner_hwm: dict[int, int] = {}
    op_rss_peak = 0
    needle = f"resume {NS}/csb-{session}-s"
    last_sample = 0.0

    def poll_once() -> None:
        nonlocal op_rss_peak, last_sample
        items = k.list_runs(session)
        now = time.time()
        for it in items:
            ph = (it.get("status") or {}).get("phase")
            if it["metadata"]["name"] in seen and ph:
                seen[it["metadata"]["name"]].setdefault(ph, now)
        if now - last_sample >= 1.0:
            last_sample = now
            for p in pids_matching(needle):
                h = proc_status(p).get("VmHWM", 0)
                runner_hwm[p] = max(runner_hwm.get(p, 0), h)
            if pid:
                op_rss_peak = max(op_rss_peak, proc_status(pid).get("VmRSS", 0))

    def poll_until(pred: Callable[[], bool], timeout: float) -> float:
        deadline = time.time() + timeout
        while time.time() < deadline:
            t = time.time()
            poll_once()
            if pred():
                return time.time()
            time.sleep(max(0.0, 0.2 - (time.time() - t)))
        raise TimeoutError("scale: timed out")

    t0 = time.time()
    for nm in names:
        k.create_run(nm, session, suspend_after)
    t_created = time.time()
    log(f"created {n} AgentRuns in {t_created - t0:.1f}s")
    t_all_wfa = poll_until(
        lambda: all("WaitingForApproval" in s or "Succeeded" in s or "Failed" in s for s in seen.values()), 900
    )
    log(f"all waiting for approval after {t_all_wfa - t0:.1f}s")
    suspended: dict[str, Any] = {}
    if suspend_after:

        def all_suspended() -> bool:
            items = k.list_runs(session)
            return (
                sum(
                    any(
                        c.get("type") == "Suspended" and c.get("status") == "True"
                        for c in (r.get("status") or {}).get("conditions") or []
                    )
                    for r in items
                )
                >= n
            )

        suspended["all_suspended_s"] = wait_for("every run Suspended", all_suspended, 600, 1.0) and time.time() - t0
        time.sleep(3.0)  # the last runners' exits reach the kubelet and Postgres
        suspended["held_while_waiting"] = waiting_cost(k, session)
        log(f"all suspended after {suspended['all_suspended_s']:.1f}s: {suspended['held_while_waiting']}")
    t_appr = time.time()
    for nm in names:
        k.approve(nm)
    t_appr_done = time.time()
    t_all_done = poll_until(lambda: all("Succeeded" in s or "Failed" in s for s in seen.values()), 900)
    log(f"all finished after {t_all_done - t0:.1f}s")
    for _ in range(5):  # a last look at the runner processes that may still be exiting
        for p in pids_matching(needle):
            runner_hwm[p] = max(runner_hwm.get(p, 0), proc_status(p).get("VmHWM", 0))
    own = k.own_requests - own0
    req1 = k.request_totals()
    op_after = proc_status(pid) if pid else {}
    pid_after = kopf_pid()
    rows = k.sql(
        "SELECT run_id, max(saved_at) FROM agentfast_checkpoints WHERE run_id LIKE %s AND phase = 'Succeeded' GROUP BY run_id",
        f"{NS}/csb-{session}-s%",
    )
    saved = {r[0].split("/", 1)[1]: r[1] / 1000 for r in rows}
    lags = [seen[nm]["Succeeded"] - saved[nm] for nm in names if "Succeeded" in seen[nm] and nm in saved]
    # the same lag for the first WaitingForApproval checkpoint (the runner's commit vs the status)
    rows = k.sql(
        "SELECT run_id, min(saved_at) FROM agentfast_checkpoints WHERE run_id LIKE %s AND phase = 'WaitingForApproval' GROUP BY run_id",
        f"{NS}/csb-{session}-s%",
    )
    saved_wfa = {r[0].split("/", 1)[1]: r[1] / 1000 for r in rows}
    wfa_lags = [
        seen[nm]["WaitingForApproval"] - saved_wfa[nm] for nm in names if "WaitingForApproval" in seen[nm] and nm in saved_wfa
    ]
    wfa_commit = [saved_wfa[nm] - t0 for nm in names if nm in saved_wfa]
    succeeded = sum("Succeeded" in s for s in seen.values())
    wfa = [s["WaitingForApproval"] - t0 for s in seen.values() if "WaitingForApproval" in s]
    delta = {res: req1.get(res, 0) - req0.get(res, 0) for res in req1}
    top = sorted(((r, v) for r, v in delta.items() if r != "_all" and v > 0), key=lambda x: -x[1])[:8]
    hwms = [h for h in runner_hwm.values() if h]
    return {
        "n_requested": n_req,
        "n": n,
        "capacity": cap,
        "succeeded": succeeded,
        "other_active_agentruns": len(others),
        "suspend_after_s": suspend_after,
        **suspended,
        "create_s": t_created - t0,
        "create_to_waiting_s": spread(wfa),
        "all_waiting_s": t_all_wfa - t0,
        "approve_patches_s": t_appr_done - t_appr,
        "approve_to_all_done_s": t_all_done - t_appr,
        "total_s": t_all_done - t0,
        "create_to_waiting_commit_s": spread(wfa_commit),
        "waiting_status_lag_s": spread(wfa_lags),
        "per_run": {
            nm: {
                "seen": {ph: t - t0 for ph, t in seen[nm].items()},
                "waiting_commit": saved_wfa.get(nm, math.nan) - t0,
                "succeeded_commit": saved.get(nm, math.nan) - t0,
            }
            for nm in names
        },
        "status_lag_s": {
            "n": len(lags),
            "p50": pct(lags, 50),
            "p95": pct(lags, 95),
            "max": max(lags) if lags else math.nan,
            "min": min(lags) if lags else math.nan,
        },
        "operator": {
            "pid": pid,
            "pid_after": pid_after,
            "vmhwm_before": op_before.get("VmHWM"),
            "vmhwm_after": op_after.get("VmHWM"),
            "vmrss_before": op_before.get("VmRSS"),
            "vmrss_peak_sampled": op_rss_peak,
        },
        "runner_vmhwm": {
            "processes": len(hwms),
            "median": statistics.median(hwms) if hwms else None,
            "max": max(hwms) if hwms else None,
        },
        "api_requests": {
            "total_delta": delta.get("_all", 0),
            "own": own,
            "per_run_excl_own": (delta.get("_all", 0) - own) / n,
            "top_resources": top,
        },
    }


# -- report ------------------------------------------------------------------------------------


def mib(b: Any) -> str:
    return f"{b / 2**20:.0f} MiB" if b else "n/a"


def report(res: dict[str, Any]) -> str:
    out = [f"machine: {res['machine']}", ""]
    if "resume" in res:
        s = res["resume"]["summary"]
        out += ["| resume after the runner pod is deleted (median (min–max, n)) | value |", "|---|---|"]
        labels = {
            "delete_to_commit_s": "pod delete → replacement runner's takeover checkpoint committed",
            "delete_to_running_s": "  pod delete → replacement pod Running (graceful exit + operator + scheduling + container start)",
            "running_to_commit_s": "  replacement Running → takeover commit (Python start, lease, checkpoint)",
            "delete_to_old_exit_s": "    of which: pod delete → old pod gone/terminal (SIGTERM, exit 75)",
            "old_exit_to_new_pod_s": "    of which: old pod gone → replacement pod created (operator)",
            "new_pod_to_running_s": "    of which: replacement created → Running (scheduling, sandbox, container start)",
            "create_to_waiting_s": "apply → WaitingForApproval (first runner)",
            "approve_to_succeeded_s": "approve (kubectl patch) → status Succeeded",
        }
        for key, label in labels.items():
            out.append(f"| {label} | {fmt(s[key])} |")
        out.append("")
    if "losses" in res:
        out += [
            "| loss → replacement runner's takeover commit, s | p50 | p99 | first loss (median) | fifth loss (median) | n |",
            "|---|---|---|---|---|---|",
        ]
        for kind, r in res["losses"].items():
            out.append(
                f"| {kind} | {r['p50']:.2f} | {r['p99']:.2f} | {r['first']['median']:.2f} | {r['fifth']['median']:.2f} | {r['all']['n']} |"
            )
        out.append("")
    if "decisions" in res:
        d = res["decisions"]
        out += [
            "| approve (kubectl patch) → the approved tool call started (median (min–max, n)) | value |",
            "|---|---|",
            f"| the runner still waiting in its pod | {fmt(d['runner_present'])} |",
            f"| the run suspended (its pod released) | {fmt(d['suspended'])} |",
            "",
        ]
    if "scale" in res:
        c = res["scale"]
        lag = c["status_lag_s"]
        api = c["api_requests"]
        out += [
            "| N concurrent AgentRuns | value |",
            "|---|---|",
            f"| N (requested → run; capacity) | {c['n_requested']} → {c['n']}; {c['capacity']} |",
            f"| succeeded | {c['succeeded']}/{c['n']} (other active AgentRuns in the namespace: {c['other_active_agentruns']}) |",
            f"| create all (API) | {c['create_s']:.1f} s |",
            f"| create → WaitingForApproval per run | {fmt(c['create_to_waiting_s'])}, p95 {c['create_to_waiting_s'].get('p95', math.nan):.1f} s |",
            f"| create → runner's WaitingForApproval commit per run | {fmt(c['create_to_waiting_commit_s'])} |",
            f"| WaitingForApproval status lag (status seen − runner commit) | {fmt(c['waiting_status_lag_s'])}, p95 {c['waiting_status_lag_s'].get('p95', math.nan):.2f} s |",
            f"| create → all WaitingForApproval | {c['all_waiting_s']:.1f} s |",
            *(
                [
                    f"| suspendAfter {c['suspend_after_s']} s: create → all Suspended | {c['all_suspended_s']:.1f} s |",
                    f"| held by the N suspended runs: live runner pods / requested CPU / runner Postgres sessions |"
                    f" {c['held_while_waiting']['live_runner_pods']} / {c['held_while_waiting']['requested_cpu_m']}m /"
                    f" {c['held_while_waiting']['runner_pg_sessions']} |",
                ]
                if c.get("suspend_after_s")
                else []
            ),
            f"| approve all (N patches) | {c['approve_patches_s']:.1f} s |",
            f"| approve → all Succeeded | {c['approve_to_all_done_s']:.1f} s |",
            f"| total, create → all Succeeded | {c['total_s']:.1f} s |",
            f"| status lag p50 / p95 / max (n={lag['n']}) | {lag['p50']:.2f} / {lag['p95']:.2f} / {lag['max']:.2f} s (min {lag['min']:.2f}) |",
            f"| operator VmHWM before → after | {mib(c['operator']['vmhwm_before'])} → {mib(c['operator']['vmhwm_after'])} (pid {c['operator']['pid']}→{c['operator']['pid_after']}) |",
            f"| runner VmHWM median / max ({c['runner_vmhwm']['processes']} processes) | {mib(c['runner_vmhwm']['median'])} / {mib(c['runner_vmhwm']['max'])} |",
            f"| apiserver requests: all clients / this script / per run excl. script | {api['total_delta']:.0f} / {api['own']} / {api['per_run_excl_own']:.1f} |",
            f"| top resources by requests | {', '.join('%s=%.0f' % (r or '(none)', v) for r, v in api['top_resources'])} |",
            "",
        ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=40, help="concurrent AgentRuns (capped by free pod slots and CPU requests)")
    ap.add_argument("--resume-reps", type=int, default=5)
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument(
        "--suspend-after",
        type=int,
        default=0,
        help="scale: the runs release their pods after waiting this long, s, and what they hold is counted (0: they keep them)",
    )
    ap.add_argument("--loss-reps", type=int, default=2, help="runs per kind of loss (each loses its runner 5 times)")
    ap.add_argument("--skip-losses", action="store_true")
    ap.add_argument("--decision-reps", type=int, default=3, help="approvals timed with the runner present, and as many suspended")
    ap.add_argument("--json", type=Path, default=CACHE / "bench" / "cluster_scale.json")
    a = ap.parse_args()
    k = Cluster()
    session = uuid.uuid4().hex[:6]
    log(f"session {session}; AgentRuns are labelled {SESSION_LABEL}={session}")
    res: dict[str, Any] = {
        "machine": machine(),
        "session": session,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        k.give_example_tools()
        if not a.skip_losses:
            res["losses"] = bench_losses(k, session, a.loss_reps)
        if a.decision_reps:
            res["decisions"] = bench_decisions(k, session, a.decision_reps)
        if not a.skip_resume:
            res["resume"] = bench_resume(k, session, a.resume_reps)
        if not a.skip_scale:
            res["scale"] = bench_scale(k, session, a.runs, a.suspend_after)
    finally:
        res["machine_after"] = machine()
        k.cleanup(session)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(res, indent=1, default=str))
    print(report(res))
    log(f"raw results: {a.json}")


if __name__ == "__main__":
    main()
