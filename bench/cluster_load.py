"""Cluster load generator (issue 14 item 5): the operator under N active AgentRuns whose progress
is driven in the store, without runner processes.

    bash bench/cluster_load.sh [--runs 100,300,1000] [--period 10] [--steady 60]

What the operator sees is what it sees of real runs: AgentRuns, their runner pods, and
checkpoints committed to the store with the namespace's runner credential through the runner's
own ``Store`` (the same rows, the same fencing epoch check, the same NOTIFY). Only the runner
processes are missing: every run's ``spec.runner.nodeSelector`` names a node label that no node
has, so each runner pod the operator creates stays Pending (Unschedulable): an API object with no
container and no node resources. The generator takes each run's lease (a runner's takeover),
commits one iteration per run every ``--period`` seconds (the runs' phases spread evenly), then
ends every run ``Succeeded`` (spread over one period). One namespace per N, deleted at the end.

Measured per N:
- **admission**: first create → every AgentRun's status names its runner pod.
- **status lag**: the commit returned (this host's clock) → the AgentRun's status first shows that
  iteration or a later one (resp. ``Succeeded``), as seen by one watch on the namespace's
  AgentRuns; p50/p95/p99/max over every commit of the steady phase.
- **operator**: CPU (utime+stime of the acting replica's process, host /proc) per second of the
  steady phase, VmRSS at its end; the same for kube-apiserver, etcd and Postgres (the limit next).
- **API requests**: ``apiserver_request_total`` deltas over the steady phase by verb and resource
  (all clients; this script makes one watch then), per commit and per run-minute.
- **resync**: the operator's own log line per pass (runs reconciled, seconds taken).
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.rest import ApiException
from psycopg.conninfo import make_conninfo

from agentfast.runner.snapshot import Message, RunContext, RunStatus, Session, StateSnapshot
from agentfast.runner.store import Lease, Store

from . import CACHE
from .cluster_scale import GROUP, KUBECONFIG, KUBECTL, PLURAL, REPO, VERSION, log, machine, pct, pids_matching

SYSTEM_NS = os.environ.get("AGENTFAST_NAMESPACE", "agentfast-system")
#: A node label no node has: the runner pods the operator makes for these runs are never scheduled.
NO_NODE = {"agentfast.dev/load-generator": "no-such-node"}
HOST_PROCS = {
    "kube-apiserver": "kube-apiserver ",
    "etcd": "etcd ",
    "postgres": "postgres",
    "kube-scheduler": "kube-scheduler ",
    "kube-controller-manager": "kube-controller-manager ",
    "kubelet": "kubelet ",
}


# -- host /proc ----------------------------------------------------------------------------------


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pids: list[int]) -> float:
    """utime+stime of ``pids`` (and their reaped children), s."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / CLK_TCK  # utime stime cutime cstime
    return total


def cgroup_cpu_s(pid: int) -> float:
    """CPU of ``pid``'s whole cgroup (a container: all of Postgres's backends, even those that
    came and went), s; cgroup v1 (cpuacct) or v2; 0 when unreadable."""
    try:
        lines = Path("/proc", str(pid), "cgroup").read_text().splitlines()
        v1 = next((ln.split(":", 2)[2] for ln in lines if ":cpuacct" in ln or ",cpuacct" in ln.split(":")[1]), None)
        if v1 is not None:
            return int(Path(f"/sys/fs/cgroup/cpuacct{v1}/cpuacct.usage").read_text()) / 1e9
        v2 = next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::"))
        for line in Path(f"/sys/fs/cgroup{v2}/cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except (OSError, IndexError, ValueError, StopIteration):
        pass
    return 0.0


def idle_s() -> float:
    """The machine's idle CPU time so far (all cores, /proc/stat idle + iowait), s."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / CLK_TCK


def rss(pids: list[int]) -> int:
    """Sum of VmRSS of ``pids``, bytes."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def operator_pids() -> list[int]:
    """The acting operator replica (``python -m agentfast.operator``) with the most CPU so far:
    the leader runs kopf, a standby only waits for the Lease."""
    pids = pids_matching("-m agentfast.operator ")
    return [max(pids, key=lambda p: cpu_s([p]))] if pids else []


def host_pids() -> dict[str, list[int]]:
    found = {"operator": operator_pids()}
    for name, needle in HOST_PROCS.items():
        found[name] = [p for p in pids_matching(needle) if Path(f"/proc/{p}/comm").read_text().strip().startswith(name[:15])]
    found["postgres"] = sorted(found["postgres"])[:1]  # the postmaster; its cgroup holds every backend
    found["this generator"] = [os.getpid()]
    return found


def cpu_of(name: str, pids: list[int]) -> float:
    return cgroup_cpu_s(pids[0]) if name == "postgres" and pids else cpu_s(pids)


# -- the cluster ----------------------------------------------------------------------------------


class Cluster:
    """What the generator needs of the cluster, with the Kubernetes client."""

    def __init__(self) -> None:
        kubernetes.config.load_kube_config(KUBECONFIG)
        self.custom = kubernetes.client.CustomObjectsApi()
        self.core = kubernetes.client.CoreV1Api()

    def request_totals(self) -> dict[str, float]:
        """``apiserver_request_total`` summed per ``VERB resource[/subresource]``."""
        text = subprocess.run(
            [KUBECTL, "--kubeconfig", KUBECONFIG, "get", "--raw", "/metrics"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels, _, value = line.rpartition(" ")
            get = {k: v for k, v in re.findall(r'(\w+)="([^"]*)"', labels)}
            key = f"{get.get('verb', '')} {get.get('resource', '')}" + (
                f"/{get['subresource']}" if get.get("subresource") else ""
            )
            totals[key] = totals.get(key, 0.0) + float(value)
        return totals

    def runner_dsn(self, namespace: str) -> str:
        """The namespace's runner credential (the operator's Secret ``agentfast-runner``), pointed at
        the bundled Postgres pod's IP (this host reaches pod IPs; it cannot resolve Services)."""
        secret = self.core.read_namespaced_secret("agentfast-runner", namespace)
        dsn = base64.b64decode(secret.data["dsn"]).decode()
        pod = self.core.list_namespaced_pod(SYSTEM_NS, label_selector="app.kubernetes.io/component=postgresql").items[0]
        return make_conninfo(dsn, host=pod.status.pod_ip)

    def operator_log(self, since_s: int) -> str:
        p = subprocess.run(
            [
                KUBECTL,
                "--kubeconfig",
                KUBECONFIG,
                "-n",
                SYSTEM_NS,
                "logs",
                "-l",
                "app.kubernetes.io/component=operator",
                f"--since={since_s}s",
                "--tail=-1",
                "--prefix",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return p.stdout


def agentrun(namespace: str, name: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["runner"] = {"nodeSelector": dict(NO_NODE)}
    doc["spec"]["budget"] = {"max_iterations": 10_000, "max_tokens": 10_000_000, "max_duration_ms": 86_400_000}
    return doc


class Watch(threading.Thread):
    """One watch on the namespace's AgentRuns: for each run, the times its status showed each
    iteration first, and when it first showed Succeeded."""

    def __init__(self, k: Cluster, namespace: str) -> None:
        super().__init__(daemon=True)
        self.k, self.namespace = k, namespace
        self.seen: dict[str, list[tuple[float, int]]] = {}
        self.done: dict[str, float] = {}
        self.pod: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        rv = None
        while not self.stop.is_set():
            w = kubernetes.watch.Watch()
            try:
                for ev in w.stream(
                    self.k.custom.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    timeout_seconds=60,
                    **({"resource_version": rv} if rv else {}),
                ):
                    now = time.time()
                    obj = ev["object"]
                    rv = obj["metadata"].get("resourceVersion", rv)
                    name, st = obj["metadata"]["name"], obj.get("status") or {}
                    it = st.get("iteration")
                    seen = self.seen.setdefault(name, [])
                    if isinstance(it, int) and (not seen or it > seen[-1][1]):
                        seen.append((now, it))
                    if st.get("phase") == "Succeeded":
                        self.done.setdefault(name, now)
                    if st.get("runnerPod"):
                        self.pod.setdefault(name, now)
                    if self.stop.is_set():
                        break
            except ApiException as err:
                if err.status == 410:  # expired: re-list from now (a gap only delays what we see)
                    rv = None
                    continue
                raise

    def first_seen(self, name: str, iteration: int) -> float | None:
        return next((t for t, it in self.seen.get(name, []) if it >= iteration), None)


# -- the generator --------------------------------------------------------------------------------


class Runs:
    """N runs' snapshots, leases and commit times, driven through one Store."""

    def __init__(self, store: Store, namespace: str, names: list[str], uids: dict[str, str]) -> None:
        self.store = store
        self.snap: dict[str, StateSnapshot] = {}
        self.lease: dict[str, Lease] = {}
        self.stored: dict[str, int] = {}
        self.commits: list[tuple[str, int, float]] = []  # (name, iteration, committed at)
        self.ends: dict[str, float] = {}
        self.errors: list[str] = []
        self.namespace = namespace
        for n in names:
            ctx = RunContext(session=Session(run_uid=uids[n], model="scripted-refund"), status=RunStatus(phase="Running"))
            self.snap[n] = StateSnapshot(run_id=f"{namespace}/{n}", context=ctx, messages=[], saved_at=0)
            self.stored[n] = 0

    def take(self, name: str) -> None:
        self.lease[name] = self.store.acquire_lease(f"{self.namespace}/{name}")

    def commit(self, name: str, phase: str = "Running") -> None:
        s = self.snap[name]
        c = s.context
        c.counters.iterations += 1
        c.counters.model_calls += 1
        c.usage.prompt_tokens += 900
        c.usage.completion_tokens += 100
        c.usage.total_tokens += 1000
        c.status = RunStatus(
            phase=phase, reason="Completed" if phase == "Succeeded" else "", message="done" if phase == "Succeeded" else ""
        )
        s.messages += [
            Message(role="assistant", content=f"step {c.counters.iterations} " + "x" * 80),
            Message(role="user", content="ok " + "y" * 80),
        ]
        s.saved_at = int(time.time() * 1000)
        try:
            self.store.commit_checkpoint(self.lease[name], s, stored_messages=self.stored[name])
        except Exception as err:  # noqa: BLE001 - counted and reported, the load goes on
            self.errors.append(f"{name}: {err}"[:200])
            return
        self.stored[name] = len(s.messages)
        t = time.time()
        if phase == "Succeeded":
            self.ends[name] = t
        else:
            self.commits.append((name, c.counters.iterations, t))

    def drive(self, names: list[str], period: float, until: float, workers: int = 8) -> None:
        """Commit one iteration per run every ``period`` s (phases spread evenly) until ``until``."""
        start = time.time()
        heap = [(start + period * i / len(names), n) for i, n in enumerate(names)]
        heapq.heapify(heap)
        with ThreadPoolExecutor(workers) as pool:
            while heap:
                due, n = heapq.heappop(heap)
                if due >= until:
                    break
                time.sleep(max(0.0, due - time.time()))
                pool.submit(self.commit, n)
                heapq.heappush(heap, (due + period, n))

    def finish(self, names: list[str], period: float, workers: int = 8) -> None:
        """Commit ``Succeeded`` for every run, spread over one period."""
        start = time.time()
        with ThreadPoolExecutor(workers) as pool:
            for i, n in enumerate(names):
                time.sleep(max(0.0, start + period * i / len(names) - time.time()))
                pool.submit(self.commit, n, "Succeeded")


def spread(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": pct(xs, 50), "p95": pct(xs, 95), "p99": pct(xs, 99), "max": max(xs) if xs else float("nan")}


def resync_passes(text: str) -> list[dict[str, float]]:
    """The operator's ``resync: ...`` log lines (operator/main.py _resync)."""
    out = []
    for m in re.finditer(r"resync: (\d+) AgentRuns, (\d+) reconciled in ([\d.]+) s", text):
        out.append({"runs": int(m.group(1)), "reconciled": int(m.group(2)), "seconds": float(m.group(3))})
    return out


def trial(k: Cluster, n: int, period: float, steady: float) -> dict[str, Any]:
    namespace = f"agentfast-load-{n}-{uuid.uuid4().hex[:6]}"
    names = [f"load-{i:04d}" for i in range(n)]
    log(f"N={n}: namespace {namespace}")
    k.core.create_namespace({"metadata": {"name": namespace, "labels": {"agentfast.dev/bench": "load"}}})
    watch = Watch(k, namespace)
    watch.start()
    store = None
    try:
        t0 = time.time()
        uids: dict[str, str] = {}
        with ThreadPoolExecutor(8) as pool:
            for name, obj in zip(
                names,
                pool.map(
                    lambda nm: k.custom.create_namespaced_custom_object(
                        GROUP, VERSION, namespace, PLURAL, agentrun(namespace, nm)
                    ),
                    names,
                ),
            ):
                uids[name] = obj["metadata"]["uid"]
        created = time.time() - t0
        deadline = time.time() + max(120, n * 0.5)
        while len(watch.pod) < n and time.time() < deadline:
            time.sleep(0.5)
        if len(watch.pod) < n:
            raise TimeoutError(f"only {len(watch.pod)} of {n} runs got a runner pod in {time.time() - t0:.0f} s")
        admitted = max(watch.pod.values()) - t0
        log(f"N={n}: created in {created:.1f} s, every run has its (Pending) runner pod after {admitted:.1f} s")
        for _ in range(120):  # the operator makes it with the namespace's first run
            try:
                dsn = k.runner_dsn(namespace)
                break
            except ApiException as err:
                if err.status != 404:
                    raise
                time.sleep(0.5)
        store = Store(dsn, pool_max=8)
        runs = Runs(store, namespace, names, uids)
        for name in names:
            runs.take(name)
        time.sleep(min(30.0, period))  # let the admission's tail settle before measuring
        pids = host_pids()
        cpu0 = {name: cpu_of(name, p) for name, p in pids.items()}
        idle0 = idle_s()
        req0, s0 = k.request_totals(), time.time()
        runs.drive(names, period, s0 + steady)
        s1 = time.time()
        req1 = k.request_totals()
        cpu1 = {name: cpu_of(name, p) for name, p in pids.items()}
        busy = (os.cpu_count() or 1) - (idle_s() - idle0) / (time.time() - s0)  # cores busy, all processes
        mem = {name: rss(p) for name, p in pids.items()}
        time.sleep(5.0)  # the last commits' status
        lags = [t_seen - t for name, it, t in runs.commits if (t_seen := watch.first_seen(name, it)) is not None]
        unseen = sum(1 for name, it, t in runs.commits if watch.first_seen(name, it) is None)
        log(f"N={n}: steady phase done: {len(runs.commits)} commits, lag p95 {pct(lags, 95):.2f} s; finishing the runs")
        runs.finish(names, period)
        deadline = time.time() + 120
        while len(watch.done) < n and time.time() < deadline:
            time.sleep(0.5)
        end_lags = [watch.done[nm] - t for nm, t in runs.ends.items() if nm in watch.done]
        resyncs = resync_passes(k.operator_log(int(time.time() - t0) + 5))
        secs = s1 - s0
        delta = {key: req1.get(key, 0.0) - req0.get(key, 0.0) for key in req1}
        top = dict(sorted(((k_, v) for k_, v in delta.items() if v >= 1), key=lambda kv: -kv[1])[:12])
        total = sum(delta.values())
        return {
            "n": n,
            "period_s": period,
            "steady_s": round(secs, 1),
            "created_s": round(created, 1),
            "admitted_s": round(admitted, 1),
            "commits": len(runs.commits),
            "commit_errors": len(runs.errors),
            "first_errors": runs.errors[:3],
            "lag_s": spread(lags),
            "unseen": unseen,
            "succeeded_lag_s": spread(end_lags),
            "succeeded_seen": len(watch.done),
            "cpu_cores": {name: round((cpu1[name] - cpu0[name]) / secs, 3) for name in cpu0},
            "rss_mib": {name: round(v / 2**20, 1) for name, v in mem.items()},
            "api_requests": {
                "total_per_s": round(total / secs, 1),
                "per_commit": round(total / max(1, len(runs.commits)), 2),
                "per_run_minute": round(total / n / (secs / 60), 2),
                "top": {k_: round(v) for k_, v in top.items()},
            },
            "resync_passes": resyncs,
            "machine": machine(),
            "machine_cpu_busy": round(busy, 2),
        }
    finally:
        watch.stop.set()
        if store is not None:
            store.close()
        log(f"N={n}: deleting namespace {namespace}")
        try:
            k.core.delete_namespace(namespace)
        except ApiException as err:
            log(f"delete namespace: {err.reason}")
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                k.core.read_namespace(namespace)
            except ApiException as err:
                if err.status == 404:
                    break
            time.sleep(2)


def report(results: list[dict[str, Any]]) -> str:
    rows = [
        "| N | commits/s | status lag p50 / p95 / p99 / max, s | Succeeded lag p95, s | operator CPU, cores | operator RSS, MiB |"
        " apiserver / etcd / postgres / scheduler / this generator CPU, cores | machine busy, cores of 2 | API requests per commit | per run-minute |"
        " last resync pass, s (reconciled/runs); slowest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lag, c, m = r["lag_s"], r["cpu_cores"], r["rss_mib"]
        passes = r["resync_passes"]
        rs = (
            f"{passes[-1]['seconds']:.2f} ({passes[-1]['reconciled']}/{passes[-1]['runs']}); max {max(p['seconds'] for p in passes):.1f}"
            if passes
            else "n/a"
        )
        rows.append(
            f"| {r['n']} | {r['commits'] / r['steady_s']:.1f} | {lag['p50']:.2f} / {lag['p95']:.2f} / {lag['p99']:.2f} / {lag['max']:.2f}"
            f" | {r['succeeded_lag_s']['p95']:.2f} | {c['operator']:.2f} | {m['operator']:.0f}"
            f" | {c['kube-apiserver']:.2f} / {c['etcd']:.2f} / {c['postgres']:.2f} / {c.get('kube-scheduler', 0):.2f} / {c.get('this generator', 0):.2f}"
            f" | {r.get('machine_cpu_busy', float('nan')):.2f}"
            f" | {r['api_requests']['per_commit']:.2f} | {r['api_requests']['per_run_minute']:.1f} | {rs} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="100,300,1000", help="comma-separated N (default: %(default)s)")
    ap.add_argument("--period", type=float, default=10.0, help="seconds between two commits of one run (default: %(default)s)")
    ap.add_argument("--steady", type=float, default=60.0, help="seconds of the measured steady phase (default: %(default)s)")
    ap.add_argument("--out", default=str(CACHE / "bench" / "cluster_load.json"))
    args = ap.parse_args()
    k = Cluster()
    results = []
    for n in (int(x) for x in args.runs.split(",")):
        results.append(trial(k, n, args.period, args.steady))
        print(json.dumps(results[-1], indent=1), file=sys.stderr, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
