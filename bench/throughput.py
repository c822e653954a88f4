"""Part 2: checkpoints per second with 1, 8 and 64 concurrent runs on one server.

Each concurrent run is its own OS process (a runner is one process per pod), with its own
``Store``, run and lease, committing one-iteration checkpoints (three new messages) as fast as it
can for the measured window. Baselines on the same server, in the same repetition:

- ``pgbench``: a custom script doing one INSERT per transaction, ``-c N -j min(N,2) -T secs``.
- ``py_floor``: N Python processes doing the floor's bare INSERT + COMMIT through psycopg: what
  Python and psycopg alone cost at this concurrency on this machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg

from agentfast.runner.store import Store

from .checkpoint import FLOOR_PAYLOAD
from .pg import BenchServer, pgbench_tps
from .stats import Spread
from .workload import Prefiller, advance

PREFILL = 100  # transcript length the runs start at (the cost does not depend on it: part 1)


@dataclass
class ThroughputConfig:
    clients: list[int]
    seconds: float
    reps: int


@dataclass
class ThroughputResult:
    config: ThroughputConfig
    # tps[subject][clients] = one value per repetition
    tps: dict[str, dict[int, list[float]]]
    # cpu[subject][clients] = (client CPU s/op, server CPU s/op) per repetition
    cpu: dict[str, dict[int, list[tuple[float, float]]]]
    # waits[subject] = {wait event: share of active-backend samples} at the highest concurrency
    waits: dict[str, dict[str, float]]

    def cpu_us(self, subject: str, n: int) -> tuple[float, float]:
        xs = self.cpu[subject][n]
        if not xs:
            return float("nan"), float("nan")
        return (sorted(c for c, _ in xs)[len(xs) // 2] * 1e6, sorted(b for _, b in xs)[len(xs) // 2] * 1e6)

    def spread(self, subject: str, n: int) -> Spread:
        return Spread.of(self.tps[subject][n])

    def ratio(self, subject: str, base: str, n: int) -> Spread:
        return Spread.of(a / b for a, b in zip(self.tps[subject][n], self.tps[base][n]) if b)


def _store_worker(dsn: str, lease, snap, start_at: float, seconds: float, out: mp.Queue) -> None:  # noqa: ANN001
    store = Store(dsn, pool_max=1)
    try:
        # warm: prepared statements
        for _ in range(2):
            store.commit_checkpoint(lease, snap, stored_messages=advance(snap))
        time.sleep(max(0.0, start_at - time.monotonic()))
        end = start_at + seconds
        done = 0
        while True:
            stored = advance(snap)
            store.commit_checkpoint(lease, snap, stored_messages=stored)
            if time.monotonic() > end:
                break
            done += 1
        out.put(done)
    except BaseException as err:  # report, never hang the parent
        out.put(f"error: {err!r}")
    finally:
        store.close()


def _floor_worker(dsn: str, start_at: float, seconds: float, out: mp.Queue) -> None:
    try:
        with psycopg.connect(dsn) as conn:
            for _ in range(2):
                conn.execute("INSERT INTO bench_floor (run_id, payload) VALUES (%s, %s)", ("py_floor", FLOOR_PAYLOAD))
                conn.commit()
            time.sleep(max(0.0, start_at - time.monotonic()))
            end = start_at + seconds
            done = 0
            while True:
                conn.execute("INSERT INTO bench_floor (run_id, payload) VALUES (%s, %s)", ("py_floor", FLOOR_PAYLOAD))
                conn.commit()
                if time.monotonic() > end:
                    break
                done += 1
        out.put(done)
    except BaseException as err:
        out.put(f"error: {err!r}")


class CpuMeter:
    """CPU used by this process's reaped children (the clients) and by the server's backends
    (reaped by the postmaster when their client disconnects: its cutime/cstime)."""

    def __init__(self, postmaster_pid: int):
        self.pm = postmaster_pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def _server(self) -> float:
        with open(f"/proc/{self.pm}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) / self.tick  # cutime, cstime (fields 16, 17)

    def _client(self) -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    def start(self) -> None:
        self.c0, self.s0 = self._client(), self._server()

    def stop(self, ops: float) -> tuple[float, float]:
        time.sleep(0.3)  # let the postmaster reap the phase's backends
        return (self._client() - self.c0) / ops, (self._server() - self.s0) / ops


class WaitSampler:
    """Samples pg_stat_activity every 10 ms: which wait event each active backend is in."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.counts: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT application_name, coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity "
                    "WHERE backend_type = 'client backend' AND state <> 'idle' AND pid <> pg_backend_pid()"
                ).fetchall()
                for app, ev in rows:
                    d = self.counts.setdefault(app or "?", {})
                    d[ev] = d.get(ev, 0) + 1
                time.sleep(0.01)

    def __enter__(self) -> WaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def shares(self) -> dict[str, dict[str, float]]:
        out = {}
        for app, d in self.counts.items():
            total = sum(d.values())
            out[app] = {k: v / total for k, v in sorted(d.items(), key=lambda kv: -kv[1])}
        return out


def _run_procs(target: Callable, args_for: Callable[[int], tuple], n: int, seconds: float) -> float:
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    start_at = time.monotonic() + 1.0 + 0.03 * n  # every process is connected and warm before the window opens
    procs = [ctx.Process(target=target, args=(*args_for(i), start_at, seconds, q), daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"{len(errors)} worker(s) failed: {errors[0]}")
    return sum(results) / seconds


def run(server: BenchServer, dsn: str, cfg: ThroughputConfig, log: Callable[[str], None]) -> ThroughputResult:
    store = Store(dsn, pool_max=2)
    store.migrate()
    pf = Prefiller(store, dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "run_id text NOT NULL, payload jsonb NOT NULL)"
        )
    script = server.workdir / "pgbench-insert.sql"
    script.write_text(f"INSERT INTO bench_floor (run_id, payload) VALUES ('pgbench', '{FLOOR_PAYLOAD}');\n")
    subjects = ("store", "pgbench", "py_floor")
    tps: dict[str, dict[int, list[float]]] = {s: {n: [] for n in cfg.clients} for s in subjects}
    cpu: dict[str, dict[int, list[tuple[float, float]]]] = {s: {n: [] for n in cfg.clients} for s in subjects}
    meter = CpuMeter(server.postmaster_pid())
    store_dsn = psycopg.conninfo.make_conninfo(dsn, application_name="store")
    floor_dsn = psycopg.conninfo.make_conninfo(dsn, application_name="py_floor")
    top = max(cfg.clients)
    sampler = WaitSampler(dsn)
    try:
        for rep in range(cfg.reps):
            for n in cfg.clients:
                runs = [pf.make_run(PREFILL) for _ in range(n)]
                order = ["pgbench", "store", "py_floor"] if rep % 2 == 0 else ["py_floor", "store", "pgbench"]
                if rep == 0 and n == top:
                    sampler.__enter__()
                for s in order:
                    meter.start()
                    if s == "pgbench":
                        rate = pgbench_tps(dsn, script, n, cfg.seconds)[0]
                    elif s == "store":
                        rate = _run_procs(_store_worker, lambda i: (store_dsn, runs[i][0], runs[i][1]), n, cfg.seconds)
                    else:
                        rate = _run_procs(_floor_worker, lambda i: (floor_dsn,), n, cfg.seconds)
                    tps[s][n].append(rate)
                    # Whole-phase CPU (connect, warm-up included) over the ops of the window: a slight overestimate.
                    cpu[s][n].append(meter.stop(rate * cfg.seconds))
                if rep == 0 and n == top:
                    sampler.__exit__()
                log(f"  throughput rep {rep + 1}/{cfg.reps} c={n}: " + ", ".join(f"{s} {tps[s][n][-1]:.0f}/s" for s in order))
    finally:
        store.close()
    waits = sampler.shares()
    return ThroughputResult(
        cfg,
        tps,
        cpu,
        {"store": waits.get("store", {}), "pgbench": waits.get("pgbench", {}), "py_floor": waits.get("py_floor", {})},
    )


def profile_worker(dsn: str, seconds: float, out_path: Path) -> None:
    """cProfile one store worker (in this process) for ``seconds``; writes pstats text."""
    import cProfile
    import io
    import pstats

    store = Store(dsn, pool_max=1)
    store.migrate()
    lease, snap = Prefiller(store, dsn).make_run(PREFILL)
    for _ in range(5):
        store.commit_checkpoint(lease, snap, stored_messages=advance(snap))
    pr = cProfile.Profile()
    end = time.monotonic() + seconds
    n = 0
    pr.enable()
    while time.monotonic() < end:
        store.commit_checkpoint(lease, snap, stored_messages=advance(snap))
        n += 1
    pr.disable()
    store.close()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
    out_path.write_text(f"{n} commits in {seconds}s (pid {os.getpid()})\n" + s.getvalue())
