"""Part 5: profiles that say what bounds each figure (run last; they change server settings).

- Client: cProfile of ``Store.commit_checkpoint`` (where the Python time goes, how many
  client/server round trips a commit makes) and of one LangGraph-adapter superstep.
- Server: ``pg_stat_statements`` (track = all, so the fencing trigger's own query is listed) and
  ``pg_stat_user_functions`` over a burst of commits; EXPLAIN (ANALYZE, BUFFERS) of the
  retention DELETE and of the transcript read of ``load_snapshot``.
- Start-up: ``python -X importtime`` of the CLI, the slowest imports.
- The model call: the openai client's request transformation (``maybe_transform``) per message.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from agentfast.runner.store import Store

from .pg import BenchServer
from .workload import Prefiller, advance, transcript

REPO = Path(__file__).resolve().parent.parent


def _short(path: str) -> str:
    path = re.sub(r".*/site-packages/", "", path)
    path = re.sub(r".*/lib/python3\.\d+/", "", path)
    return path.replace(str(REPO) + "/", "")


def top_functions(pr: cProfile.Profile, n: int = 12, key: str = "tottime") -> list[tuple[str, int, float, float]]:
    """(function, calls, tottime s, cumtime s), the top ``n`` by ``key``."""
    st = pstats.Stats(pr)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{_short(file)}:{line}({fn})", nc, tt, ct))
    idx = 2 if key == "tottime" else 3
    rows.sort(key=lambda r: -r[idx])
    return rows[:n]


def profile_commit(dsn: str, n: int, commits: int) -> dict[str, Any]:
    store = Store(dsn, pool_max=1)
    store.migrate()
    pf = Prefiller(store, dsn)
    lease, snap = pf.make_run(n)
    for _ in range(20):
        store.commit_checkpoint(lease, snap, stored_messages=advance(snap))
    pr = cProfile.Profile()
    wall = 0.0
    for _ in range(commits):
        stored = advance(snap)  # the workload's own work stays out of the profile
        t = time.perf_counter()
        pr.enable()
        store.commit_checkpoint(lease, snap, stored_messages=stored)
        pr.disable()
        wall += time.perf_counter() - t
    store.close()
    st = pstats.Stats(pr)
    waits = sum(v[1] for k, v in st.stats.items() if k[0].endswith("psycopg/connection.py") and k[2] == "wait")  # type: ignore[attr-defined]
    wait_time = sum(v[3] for k, v in st.stats.items() if k[0].endswith("psycopg/connection.py") and k[2] == "wait")  # type: ignore[attr-defined]
    total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
    return {
        "commits": commits,
        "wall_ms_per_commit": wall / commits * 1000,
        "waits_per_commit": waits / commits,
        "wait_share": wait_time / total if total else float("nan"),
        "top": top_functions(pr, 12),
    }


def profile_adapter(dsn: str, n: int, steps: int) -> dict[str, Any]:
    from .lg import AdapterRun

    store = Store(dsn, pool_max=1)
    store.migrate()
    pf = Prefiller(store, dsn)
    run = AdapterRun(store, pf, n, steps + 2)
    it = run.supersteps()
    next(it)
    next(it)
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    k = 0
    for _ in it:
        k += 1
    pr.disable()
    wall = time.perf_counter() - t
    store.close()
    # What the saver keeps: the latest checkpoint per namespace and its values (the messages as
    # one list of live objects), and what it commits per superstep: a small sdk_state.
    saver = run.runner.saver
    kept = len(saver._latest)
    state_bytes = len(json.dumps(run.runner.snap.sdk_state))
    return {
        "steps": k,
        "wall_ms_per_step": wall / max(k, 1) * 1000,
        "top": top_functions(pr, 14, "cumtime"),
        "saver_checkpoints": kept,
        "sdk_state_bytes": state_bytes,
        "messages": n,
    }


def server_statements(server: BenchServer, n: int, commits: int) -> dict[str, Any]:
    """Restart with pg_stat_statements preloaded, run ``commits`` commits, read the stats."""
    server.restart(
        shared_preload_libraries="pg_stat_statements",
        **{"pg_stat_statements.track": "all", "pg_stat_statements.track_planning": "on", "track_functions": "pl"},
    )
    dsn = server.create_database("prof")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_stat_statements")
    warm = Store(dsn, pool_max=1)
    warm.migrate()
    lease, snap = Prefiller(warm, dsn).make_run(n)
    for _ in range(20):
        warm.commit_checkpoint(lease, snap, stored_messages=advance(snap))
    warm.close()  # its statistics are flushed when its backend exits, before the reset
    time.sleep(0.5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_reset()")
    store = Store(dsn, pool_max=1)
    for _ in range(5):  # prepared statements are made on the 5th execution: not counted as steady state
        store.commit_checkpoint(lease, snap, stored_messages=advance(snap))
    store.close()
    time.sleep(0.5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_reset()")
    store = Store(dsn, pool_max=1)
    for _ in range(commits):
        store.commit_checkpoint(lease, snap, stored_messages=advance(snap))
    store.close()  # a backend flushes its function statistics when it exits
    time.sleep(0.5)
    out: dict[str, Any] = {"commits": commits}
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            """SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, total_exec_time, total_plan_time, toplevel
               FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND query NOT LIKE '%%pg_stat%%' AND calls > 0
               ORDER BY total_exec_time DESC LIMIT 15"""
        ).fetchall()
        out["statements"] = [(q[:110], c, te / commits * 1000, tp / commits * 1000, top) for q, c, te, tp, top in rows]
        f = conn.execute("SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions").fetchall()
        out["functions"] = [(name, calls, tt / commits * 1000, st / commits * 1000) for name, calls, tt, st in f]
        out["queries"] = "WHERE dbid = the benchmark's database; the rows of pg_stat_statements' own queries are left out"
        out["explain_delete"] = _explain(
            conn,
            lease.run_id,
            """EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
            DELETE FROM agentfast_checkpoints WHERE run_id = %(r)s AND checkpoint_id <
              (SELECT checkpoint_id FROM agentfast_checkpoints WHERE run_id = %(r)s ORDER BY checkpoint_id DESC OFFSET 19 LIMIT 1)""",
        )
        with Store(dsn, pool_max=1) as store2:
            lease2, _ = Prefiller(store2, dsn).make_run(1000)
        out["explain_load"] = _explain(
            conn,
            lease2.run_id,
            """EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
            SELECT message FROM agentfast_messages WHERE run_id = %(r)s AND seq < 1000 ORDER BY seq""",
        )
    server.restart(
        reset=("shared_preload_libraries", "pg_stat_statements.track", "pg_stat_statements.track_planning", "track_functions")
    )
    return out


def _explain(conn: psycopg.Connection, run_id: str, sql: str) -> list[str]:
    """EXPLAIN ANALYZE inside a transaction that is rolled back (the DELETE really runs)."""
    lines: list[str] = []
    with conn.transaction():
        lines = [r[0] for r in conn.execute(sql, {"r": run_id}).fetchall()]
        raise psycopg.Rollback()
    return lines


def import_times(top: int = 8) -> dict[str, Any]:
    """``python -X importtime -c 'import agentfast.runner.cli'``: total and the slowest packages."""
    env = {**os.environ}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import agentfast.runner.cli"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    rows = []
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(2)), len(m.group(3)), m.group(4)))
    total = next((c for c, d, name in rows if name == "agentfast.runner.cli"), 0)
    # top-level packages (depth 1 = imported directly by the cli) and big third-party ones
    shallow = sorted(((c, name) for c, d, name in rows if d <= 3), reverse=True)[:top]
    third = {}
    for c, _depth, name in rows:
        root = name.split(".")[0]
        if root in ("openai", "aiohttp", "pydantic", "psycopg", "typer", "rich", "yaml", "httpx", "click"):
            third[root] = max(third.get(root, 0), c) if "." not in name else third.get(root, 0)
    return {
        "total_ms": total / 1000,
        "top": [(name, c / 1000) for c, name in shallow],
        "packages": sorted(((k, v / 1000) for k, v in third.items() if v), key=lambda kv: -kv[1]),
    }


def openai_transform(lengths: list[int]) -> list[tuple[int, float, float]]:
    """(messages, ms per request, µs per message) of the openai client's ``maybe_transform`` of a
    Chat Completions request body, which ``chat.completions.create`` runs on every call."""
    from openai._utils import maybe_transform
    from openai.types.chat import completion_create_params

    out = []
    for n in lengths:
        body = {"model": "bench", "messages": [m.to_openai() for m in transcript(n)]}
        reps = 3
        t = time.perf_counter()
        for _ in range(reps):
            maybe_transform(body, completion_create_params.CompletionCreateParamsNonStreaming)
        dt = (time.perf_counter() - t) / reps
        out.append((n, dt * 1000, dt / n * 1e6))
    return out


def json_encode_cost(lengths: list[int]) -> list[tuple[int, float]]:
    """(messages, ms) of just json.dumps of the same body: what sending the transcript must cost."""
    import json

    out = []
    for n in lengths:
        body = {"model": "bench", "messages": [m.to_openai() for m in transcript(n)]}
        t = time.perf_counter()
        for _ in range(3):
            json.dumps(body)
        out.append((n, (time.perf_counter() - t) / 3 * 1000))
    return out
