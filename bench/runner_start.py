"""How long a runner pod's process takes from its start to its takeover commit (issue 14 item 1).

``python -m bench.runner_start [--reps N] [--pythonpath LABEL=DIR] [--no-bytecode]``: starts its own embedded
PostgreSQL server (bench/pg.py), registers the refund example and lets it pause for approval
(``agentfast run --no-wait``), then N times starts ``agentfast resume default/refund-demo`` the way
a runner pod does (operator/workload.py ``build_pod``: the ``agentfast`` console script, the
namespace's runner role as ``AGENTFAST_DSN``, ``AGENTFAST_ALLOWED_MODULES``,
``AGENTFAST_SUSPEND_AFTER_SECONDS=0``), times the process's start to the takeover checkpoint (the
first ``agentfast_checkpoints`` row with a newer epoch, by its ``saved_at``: the runner's clock,
this host's, as the cluster benchmark does), then SIGTERMs it (exit 75) and starts the next. ``--pythonpath`` puts another copy
of the package first (an ``agentfast/`` folder holding ``runner``), to compare two versions on
the same server in alternation. Prints the figures (s) and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import yaml

from agentfast.runner.examples import EXAMPLES_DSN_ENV, provision
from agentfast.runner.store import Store

from .pg import start_server

REPO = Path(__file__).resolve().parent.parent
RUN_ID = "default/refund-demo"


def _env(dsn: str, examples_dsn: str, pythonpath: str | None, server_dir: Path, *, no_bytecode: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTFAST_", "PYTHONPATH", "PYTHONPYCACHEPREFIX"))}
    env.update(
        {
            "AGENTFAST_DSN": dsn,
            EXAMPLES_DSN_ENV: examples_dsn,
            "HOME": tempfile.gettempdir(),
            "AGENTFAST_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            "AGENTFAST_ALLOWED_MODULES": "agentfast.runner.examples",
            "AGENTFAST_SUSPEND_AFTER_SECONDS": "0",
            "AGENTFAST_WAIT_FOR_HOLDER_SECONDS": "35",
        }
    )
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if no_bytecode:  # as in an image without .pyc files and a read-only root: every module compiled at every start
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(server_dir / "no-pyc"))  # empty, never written
    return env


def _agentfast() -> str:
    return str(Path(sys.executable).with_name("agentfast"))


def one_start(admin_dsn: str, env: dict[str, str]) -> float:
    """Start one runner, return process start -> takeover commit (s); SIGTERM it and reap it."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        e0 = conn.execute("SELECT epoch FROM agentfast_runs WHERE run_id = %s", (RUN_ID,)).fetchone()[0]
        t0 = time.time()
        proc = subprocess.Popen(
            [_agentfast(), "resume", RUN_ID],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                row = conn.execute(
                    "SELECT min(saved_at) / 1000.0 FROM agentfast_checkpoints WHERE run_id = %s AND epoch > %s", (RUN_ID, e0)
                ).fetchone()
                if row[0] is not None:
                    took = float(row[0]) - t0
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no takeover (exit {proc.poll()}):\n{proc.communicate()[0]}")
                time.sleep(0.01)
            time.sleep(0.3)  # let it settle into its wait, as a pod would
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
    if proc.returncode != 75:
        raise RuntimeError(f"runner exited {proc.returncode}, not 75:\n{out}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--pythonpath",
        action="append",
        default=[],
        help="LABEL=DIR: also time the package found in DIR, alternating with this one",
    )
    ap.add_argument(
        "--no-bytecode",
        action="store_true",
        help="also time each variant with no .pyc to read or write (an image whose __pycache__ was removed)",
    )
    args = ap.parse_args()
    server = start_server()
    try:
        admin = server.create_database("start")
        store = Store(admin)
        store.migrate()
        store.set_tenant_password("default", "runner-pw")
        role = store.tenant_role("default")
        store.close()
        runner_dsn = psycopg.conninfo.make_conninfo(admin, user=role, password="runner-pw")
        examples = provision(admin, password="examples-pw")
        doc = yaml.safe_load((REPO / "manifests" / "examples" / "refund.yaml").read_text())
        doc["spec"]["suspendAfter"] = 0
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "refund.yaml"
            path.write_text(yaml.safe_dump(doc))
            first = subprocess.run(
                [_agentfast(), "run", str(path), "--no-wait"],
                env=_env(admin, examples, None, server.workdir),
                capture_output=True,
                text=True,
                timeout=120,
            )
        if first.returncode != 0 or "WaitingForApproval" not in first.stdout:
            raise SystemExit(f"the run did not pause:\n{first.stdout}\n{first.stderr}")
        variants = [("this", None)] + [tuple(p.split("=", 1)) for p in args.pythonpath]
        envs = {label: _env(runner_dsn, examples, pp, server.workdir) for label, pp in variants}
        if args.no_bytecode:
            envs.update(
                {f"{label} (no .pyc)": _env(runner_dsn, examples, pp, server.workdir, no_bytecode=True) for label, pp in variants}
            )
            variants += [(f"{label} (no .pyc)", pp) for label, pp in variants]
        one_start(admin, envs["this"])  # warm the page cache and the server
        figures: dict[str, list[float]] = {label: [] for label, _ in variants}
        for _ in range(args.reps):
            for label, _ in variants:
                figures[label].append(one_start(admin, envs[label]))
        print(
            json.dumps(
                {
                    label: {"median_s": round(statistics.median(v), 3), "runs_s": [round(x, 3) for x in v]}
                    for label, v in figures.items()
                },
                indent=1,
            )
        )
    finally:
        server.close()


if __name__ == "__main__":
    main()
