"""Parts 3 and 4: real runner processes (``python -m agentfast.runner``) against the bench server.

Resume latency: a scripted run is started; at a random point of an iteration the process gets
SIGKILL; a fresh ``agentfast resume`` process is started at once; the latency is from the kill to
the commit of the next iteration by the new process (read from Postgres, polled every 2 ms),
split at the moment the new process takes the lease (its epoch bump). Process start-up is
measured on its own: the interpreter, the CLI's imports, ``--help``.

Peak RSS: the kernel's high-water mark of each runner process's resident set (VmHWM), for
the refund demo (run until the approval pause, approve, resume), its LangGraph twin, and a
1,000-iteration scripted run.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml

from agentfast.runner.examples import EXAMPLES_DSN_ENV, provision
from agentfast.runner.store import Store

from .stats import Spread

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "manifests" / "examples"
#: Where the runner processes keep their bytecode (PYTHONPYCACHEPREFIX): outside the checkout,
#: kept between runs (a changed source is compiled again, by its mtime).
PYCACHE = Path(tempfile.gettempdir()) / "agentfast-bench-pycache"


def write_script(path: Path, iterations: int) -> Path:
    """A scripted model: ``iterations`` turns of two tool calls each, then a final answer."""
    turns = []
    for i in range(1, iterations + 1):
        turns.append(
            {
                "content": "Checking the order and its charges.",
                "tool_calls": [
                    {"id": "call_a", "name": "lookup", "arguments": {"order_id": f"A-{1000 + i}"}},
                    {"id": "call_b", "name": "lookup", "arguments": {"order_id": f"B-{1000 + i}"}},
                ],
                "usage": {"prompt_tokens": 900, "completion_tokens": 100},
            }
        )
    turns.append({"content": "All orders checked.", "usage": {"prompt_tokens": 900, "completion_tokens": 20}})
    path.write_text(yaml.safe_dump({"model": "scripted-bench", "turns": turns}, sort_keys=False))
    return path


def write_agentrun(
    path: Path, name: str, script: Path, iterations: int, adapter: str = "vanilla", base_url: str | None = None
) -> Path:
    """An AgentRun file on the script (the runner serves it itself) or, with ``base_url``, on a
    scripted server already running there, through a ModelConfig document beside the AgentRun
    (the local single-file form; the endpoint needs no key)."""
    model = {"name": "scripted-bench", "config": "bench"} if base_url else {"name": "scripted-bench", "script": str(script)}
    spec: dict = {
        "adapter": adapter,
        "model": model,
        "systemPrompt": "You are a support agent. Look every order up.",
        "input": "Please check all my recent orders for duplicate charges.",
        "tools": [{"name": "lookup", "ref": "bench.tools:lookup"}],
        "budget": {
            "max_iterations": iterations + 10,
            "max_tokens": 100_000_000,
            "max_duration_ms": 3_600_000,
            "classifier": "none",
        },
    }
    if adapter == "langgraph":
        spec["graph"] = {"ref": "agentfast.runner.examples.refund_graph:build"}
    doc = {"apiVersion": "agentfast.dev/v1alpha1", "kind": "AgentRun", "metadata": {"name": name}, "spec": spec}
    docs = [doc]
    if base_url:
        docs.append(
            {
                "apiVersion": "agentfast.dev/v1alpha1",
                "kind": "ModelConfig",
                "metadata": {"name": "bench"},
                "spec": {"baseURL": base_url, "models": ["scripted-bench"]},
            }
        )
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def example_copy(workdir: Path, example: str, name: str) -> Path:
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["metadata"]["name"] = name
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@functools.cache
def _examples_dsn(dsn: str) -> str:
    """The example tools' own DSN in ``dsn``'s database (their role made there once): the refund
    example's tools keep their ledger there, as users' tools would, never with the runner's DSN."""
    return provision(dsn)


class Proc:
    """A runner process whose output goes to a file and whose rusage is collected by wait4."""

    def __init__(self, args: list[str], dsn: str, workdir: Path, tag: str):
        env = {
            **os.environ,
            "AGENTFAST_DSN": dsn,
            "PYTHONPATH": str(REPO),
            EXAMPLES_DSN_ENV: _examples_dsn(dsn),
            "PYTHONPYCACHEPREFIX": str(PYCACHE),
        }
        env.pop("AGENTFAST_FAULT", None)
        # Byte-compiled once, as an installed package is: with PYTHONDONTWRITEBYTECODE (set on the
        # project's machines) every start would compile agentfast's own sources again (~40 ms).
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.log_path = workdir / f"{tag}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=str(workdir),
        )
        self.maxrss_kib = 0
        self.returncode: int | None = None
        self.ended: float | None = None
        self.cpu_s: float | None = None  # user + system CPU seconds of the process, from wait4

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _hwm(self) -> None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.maxrss_kib = max(self.maxrss_kib, int(line.split()[1]))
                        return
        except OSError:
            pass

    def wait(self, timeout: float = 600) -> int:
        """Wait for the exit, polling the peak RSS (VmHWM) every 5 ms until then.

        Not wait4's ru_maxrss: Linux folds the forking parent's RSS (this benchmark, with
        LangGraph loaded) into the child's maxrss at exec, so it would report the parent's size.
        VmHWM belongs to the exec'ed image's own address space.
        """
        deadline = time.monotonic() + timeout
        while True:
            self._hwm()
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self.ended = time.monotonic()
                self.cpu_s = usage.ru_utime + usage.ru_stime
                self.returncode = os.waitstatus_to_exitcode(status)
                self.popen.returncode = self.returncode
                self._log.close()
                return self.returncode
            if time.monotonic() > deadline:
                self.popen.kill()
                raise TimeoutError(f"{self.popen.args} did not finish in {timeout}s; log: {self.log_path}")
            # VmHWM is a high-water mark, so polling only has to be fast near the exit; short
            # processes are polled every 5 ms, long ones every 50 ms (the bench stays out of the way).
            time.sleep(0.005 if time.monotonic() - self.started < 5 else 0.05)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.wait(30)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def cli(*args: str) -> list[str]:
    return ["-m", "agentfast.runner", *args]


# -- start-up ---------------------------------------------------------------------------------


#: The commands people and scripts run at a terminal (issue 15 item 1: each <= 0.3 s wall).
READ_COMMANDS = ("status", "history", "approve")


def measure_startup(dsn: str, workdir: Path, reps: int) -> dict[str, Any]:
    """Wall time to exit (ms), CPU (ms, user + system, from wait4) and peak RSS (MiB) of short processes.

    Per repetition: the interpreter alone, the floor of a command that reads Postgres through the
    store (``import pydantic, psycopg``), importing the CLI, ``--help``, ``list``, and ``status``,
    ``history`` and ``approve`` on a refund run paused for approval (made before, not timed;
    approve decides its gated call for real). Keys: the case's label, ``cpu:LABEL``, ``rss:LABEL``
    (Spreads), and ``imports:agentfast status``: one more ``status`` under ``-X importtime``, its
    import time by package (:func:`import_self_ms`).
    Raises RuntimeError when a command exits non-zero.
    """
    out: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    rss: dict[str, list[float]] = {}
    for rep in range(reps):
        name = f"startup-{rep}-{uuid.uuid4().hex[:6]}"
        paused = Proc(
            cli("run", str(example_copy(workdir, "refund.yaml", name)), "--dsn", dsn, "--no-wait"), dsn, workdir, "startup-run"
        )
        if paused.wait(120) != 0 or "call-2-0" not in paused.output():
            raise RuntimeError(f"the refund run did not pause for approval: {paused.output()[-2000:]}")
        cases = {
            "python -c pass": ["-c", "pass"],
            "floor: python -c 'import pydantic, psycopg'": ["-c", "import pydantic, psycopg"],
            "import agentfast.runner.cli": ["-c", "import agentfast.runner.cli"],
            "agentfast --help": cli("--help"),
            "agentfast list (connect + migrate)": cli("list", "--dsn", dsn),
        }
        for cmd in READ_COMMANDS:
            extra = ("call-2-0",) if cmd == "approve" else ()
            cases[f"agentfast {cmd}"] = cli(cmd, name, *extra, "--dsn", dsn)
        if rep == 0:  # unmeasured: fills the bytecode cache (PYCACHE); approve a call that does not exist (refused)
            for args in cases.values():
                Proc([a if a != "call-2-0" else "call-9-9" for a in args], dsn, workdir, "startup-warm").wait(60)
        for k, args in cases.items():
            p = Proc(args, dsn, workdir, "startup")
            rc = p.wait(60)
            if rc != 0:
                raise RuntimeError(f"{k} exited {rc}: {p.output()[-2000:]}")
            out.setdefault(k, []).append((p.ended - p.started) * 1000)  # type: ignore[operator]
            cpu.setdefault(k, []).append((p.cpu_s or 0.0) * 1000)
            rss.setdefault(k, []).append(p.maxrss_kib / 1024)
    res: dict[str, Any] = {k: Spread.of(v) for k, v in out.items()}
    res.update({f"cpu:{k}": Spread.of(v) for k, v in cpu.items()})
    res.update({f"rss:{k}": Spread.of(v) for k, v in rss.items()})
    traced = Proc(["-X", "importtime", *cli("status", name, "--dsn", dsn)], dsn, workdir, "startup-importtime")
    if traced.wait(60) != 0:
        raise RuntimeError(f"status under -X importtime failed: {traced.output()[-2000:]}")
    res["imports:agentfast status"] = import_self_ms(traced.output())
    return res


def import_self_ms(importtime: str) -> dict[str, float]:
    """``python -X importtime`` output -> import time (ms, each module's own, so no double
    counting) summed by top-level package, largest first."""
    by: dict[str, float] = {}
    for line in importtime.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            self_us, _, name = line[len("import time:") :].split("|")
            if self_us.strip().isdigit():
                root = name.strip().split(".")[0]
                by[root] = by.get(root, 0.0) + int(self_us) / 1000
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))


# -- resume latency ---------------------------------------------------------------------------


@dataclass
class ResumeResult:
    total_ms: list[float] = field(default_factory=list)  # kill -> next iteration committed by the new process
    to_lease_ms: list[float] = field(default_factory=list)  # kill -> the new process holds the lease
    lease_to_commit_ms: list[float] = field(default_factory=list)  # lease -> next iteration committed
    steady_iteration_ms: float = float("nan")  # median iteration time of the undisturbed run


def _state(conn: psycopg.Connection, run_id: str) -> tuple[int, int]:
    row = conn.execute(
        "SELECT r.epoch, coalesce((SELECT max(iteration) FROM agentfast_checkpoints c WHERE c.run_id = r.run_id), -1) "
        "FROM agentfast_runs r WHERE r.run_id = %s",
        (run_id,),
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (-1, -1)


def _wait_for(
    conn: psycopg.Connection, run_id: str, pred: Callable[[int, int], bool], timeout: float, proc: Proc
) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _state(conn, run_id)
        if pred(*st):
            return st
        if proc.popen.poll() is not None:
            raise RuntimeError(f"runner exited {proc.popen.returncode} early:\n{proc.output()[-3000:]}")
        time.sleep(0.002)
    raise TimeoutError(f"run {run_id}: condition not met in {timeout}s (state {_state(conn, run_id)}); log {proc.log_path}")


def measure_resume(dsn: str, workdir: Path, reps: int, log: Callable[[str], None]) -> ResumeResult:
    name = f"bench-resume-{uuid.uuid4().hex[:8]}"
    run_id = f"default/{name}"
    per_rep = 4  # iterations the new process runs before the next kill
    iterations = 10 + reps * (per_rep + 2) + 20
    script = write_script(workdir / f"{name}-script.yaml", iterations)
    manifest = write_agentrun(workdir / f"{name}.yaml", name, script, iterations)
    res = ResumeResult()
    rng = random.Random(7)
    with psycopg.connect(dsn, autocommit=True) as conn:
        p = Proc(cli("run", str(manifest), "--dsn", dsn, "--no-wait"), dsn, workdir, "resume-run")
        _wait_for(conn, run_id, lambda e, it: it >= 6, 120, p)
        # The undisturbed iteration time, from the turns' timestamps (one turn per iteration).
        rows = conn.execute(
            "SELECT extract(epoch FROM created_at) FROM agentfast_turns WHERE run_id = %s ORDER BY iteration", (run_id,)
        ).fetchall()
        gaps = [float(b[0] - a[0]) * 1000 for a, b in zip(rows[1:], rows[2:])]
        res.steady_iteration_ms = sorted(gaps)[len(gaps) // 2] if gaps else float("nan")
        for _rep in range(reps):
            _, it_now = _state(conn, run_id)
            _wait_for(conn, run_id, lambda e, it: it >= it_now + 1, 60, p)
            time.sleep(rng.uniform(0, max(0.001, res.steady_iteration_ms / 1000)))  # a random point inside an iteration
            t_kill = time.monotonic()
            os.kill(p.pid, signal.SIGKILL)
            p.wait(30)
            epoch0, last = _state(conn, run_id)
            p = Proc(cli("resume", name, "--dsn", dsn, "--no-wait"), dsn, workdir, "resume")
            e1, _ = _wait_for(conn, run_id, lambda e, it: e > epoch0, 60, p)
            t_lease = time.monotonic()
            _wait_for(conn, run_id, lambda e, it: it > last, 60, p)
            t_next = time.monotonic()
            res.total_ms.append((t_next - t_kill) * 1000)
            res.to_lease_ms.append((t_lease - t_kill) * 1000)
            res.lease_to_commit_ms.append((t_next - t_lease) * 1000)
            for _ in range(per_rep - 1):  # let the new process settle into its loop before the next kill
                _, it_now = _state(conn, run_id)
                _wait_for(conn, run_id, lambda e, it: it > it_now, 60, p)
        p.kill()
    log(f"  resume: {reps} kills, median {sorted(res.total_ms)[len(res.total_ms) // 2]:.0f} ms")
    return res


# -- peak RSS ---------------------------------------------------------------------------------


class ModelServer:
    """``python -m agentfast.testing.scripted`` in its own process, on a free local port."""

    def __init__(self, script: Path, dsn: str, workdir: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.proc = Proc(
            ["-m", "agentfast.testing.scripted", "--script", str(script), "--port", str(port)], dsn, workdir, "model"
        )
        deadline = time.monotonic() + 60
        while "serving at" not in self.proc.output():
            if self.proc.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"scripted model server did not start:\n{self.proc.output()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> float:
        """Stop it; returns its peak RSS in MiB."""
        self.proc._hwm()
        os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.wait(30)
        return self.proc.maxrss_kib / 1024


@dataclass
class RssResult:
    label: str
    peak_mib: float
    wall_s: float
    processes: int
    detail: str = ""


def _approve_and_resume(dsn: str, workdir: Path, manifest: Path, name: str, tag: str) -> RssResult:
    run_id = f"default/{name}"
    t0 = time.monotonic()
    first = Proc(cli("run", str(manifest), "--dsn", dsn, "--no-wait"), dsn, workdir, tag)
    rc = first.wait(120)
    if rc != 0:
        raise RuntimeError(f"{tag}: run exited {rc}:\n{first.output()[-3000:]}")
    with Store(dsn, pool_max=1) as store:
        loaded = store.load_context(run_id)
        assert loaded is not None and loaded[1] is not None, f"{tag}: the run did not pause for approval"
        store.decide(run_id, loaded[1].call_id, "approve", decided_by="bench")
    second = Proc(cli("resume", name, "--dsn", dsn, "--no-wait"), dsn, workdir, tag)
    rc = second.wait(120)
    if rc != 0:
        raise RuntimeError(f"{tag}: resume exited {rc}:\n{second.output()[-3000:]}")
    wall = time.monotonic() - t0
    return RssResult(
        tag,
        max(first.maxrss_kib, second.maxrss_kib) / 1024,
        wall,
        2,
        f"run until the approval pause: {first.maxrss_kib / 1024:.0f} MiB; resume to the end: {second.maxrss_kib / 1024:.0f} MiB",
    )


def measure_rss(
    dsn: str, workdir: Path, iterations: int, lg_iterations: int, log: Callable[[str], None], *, langgraph_refund: bool = True
) -> list[RssResult]:
    out = []
    base = Proc(["-c", "import agentfast.runner.cli, agentfast.runner.loop, agentfast.runner.model"], dsn, workdir, "rss-base")
    base.wait(60)
    out.append(RssResult("baseline: interpreter + the runner's imports", base.maxrss_kib / 1024, base.ended - base.started, 1))  # type: ignore[operator]
    tag = uuid.uuid4().hex[:6]
    out.append(
        _approve_and_resume(
            dsn, workdir, example_copy(workdir, "refund.yaml", f"refund-{tag}"), f"refund-{tag}", "refund demo (vanilla)"
        )
    )
    if langgraph_refund:
        out.append(
            _approve_and_resume(
                dsn,
                workdir,
                example_copy(workdir, "refund-langgraph.yaml", f"refund-lg-{tag}"),
                f"refund-lg-{tag}",
                "refund demo (LangGraph adapter)",
            )
        )
    log("  rss: refund runs done")
    for adapter, its in (("vanilla", iterations), ("langgraph", lg_iterations)):
        if its <= 0:
            continue
        name = f"bench-long-{adapter[:2]}-{tag}"
        script = write_script(workdir / f"{name}-script.yaml", its)
        # The model server runs in its own process, as a remote model would: the in-process scripted
        # server keeps every request body it received (ScriptedModelServer.requests, for tests), which
        # over a long run is the whole transcript once per iteration and would swamp the runner's own RSS.
        server = ModelServer(script, dsn, workdir)
        manifest = write_agentrun(workdir / f"{name}.yaml", name, script, its, adapter, base_url=server.base_url)
        p = Proc(cli("run", str(manifest), "--dsn", dsn, "--no-wait"), dsn, workdir, name)
        try:
            rc = p.wait(3600)
        finally:
            server_mib = server.stop()
        if rc != 0:
            raise RuntimeError(f"{name} exited {rc}:\n{p.output()[-3000:]}")
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT extract(epoch FROM created_at) FROM agentfast_turns WHERE run_id = %s ORDER BY iteration",
                (f"default/{name}",),
            ).fetchall()
            msgs = conn.execute("SELECT count(*) FROM agentfast_messages WHERE run_id = %s", (f"default/{name}",)).fetchone()[0]
        t = [float(r[0]) for r in rows]
        w = max(1, min(100, len(t) // 5))
        early = (t[w] - t[0]) / w * 1000 if len(t) > w else float("nan")
        late = (t[-1] - t[-1 - w]) / w * 1000 if len(t) > w else float("nan")
        out.append(
            RssResult(
                f"scripted run, {its:,} iterations ({adapter})",
                p.maxrss_kib / 1024,
                p.ended - p.started,
                1,  # type: ignore[operator]
                f"{len(t)} turns, {msgs:,} messages; mean iteration {early:.0f} ms over the first {w}, {late:.0f} ms over the last {w}; "
                f"model server in its own process (its peak RSS: {server_mib:.0f} MiB)",
            )
        )
        log(f"  rss: {its}-iteration {adapter} run done in {p.ended - p.started:.1f}s")  # type: ignore[operator]
    return out
