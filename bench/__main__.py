"""``python -m bench`` (or ``bash bench/run.sh``): the agentfast benchmark, one command.

Starts its own embedded PostgreSQL server in a temporary directory under /tmp, runs the parts,
stops and deletes the server, and writes the generated block of docs/benchmarks.md (full mode)
plus the raw results as JSON. ``--quick`` runs the parts behind the Targets table (issue 15's
items 1-6: QUICK_PARTS) at a small size, in under two minutes on a 2-core machine, and writes to a
temporary file unless ``--out`` is given; ``--quick --only rss,profile`` runs the others small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PARTS = ["checkpoint", "throughput", "resume", "rss", "profile", "model", "payloads", "langgraph"]
# What --quick runs by default: every part with a row in the Targets table (issue 15 items 1-6:
# resume, checkpoint/iteration, langgraph, model, throughput, payloads). rss and profile only
# describe; they stay in the full run.
QUICK_PARTS = ["checkpoint", "throughput", "resume", "model", "payloads", "langgraph"]


@dataclasses.dataclass
class Plan:
    lengths: list[int]
    reps: int
    samples: int
    heavy_samples: int
    bytes_samples: int
    clients: list[int]
    seconds: float
    tp_reps: int
    kills: int
    startup_reps: int
    load_reps: int
    long_iterations: int
    lg_iterations: int
    langgraph_refund: bool
    server_profile: bool
    lg_lengths: list[int]
    lg_reps: int
    lg_samples: int
    big_outputs: int  # part langgraph: tool outputs of 2 MB per run (the scripted server takes requests up to 32 MiB)
    model_rounds: int = 7
    model_calls: int = 7
    payload_iterations: int = 3
    payload_reps: int = 2
    checkpoint_subjects: tuple[str, ...] | None = None  # part 1's subjects (None: all of bench/checkpoint.py's)


FULL = Plan(
    lengths=[10, 100, 1000, 10000],
    reps=5,
    samples=40,
    heavy_samples=8,
    bytes_samples=8,
    clients=[1, 8, 64],
    seconds=10,
    tp_reps=2,
    kills=7,
    startup_reps=5,
    load_reps=30,
    long_iterations=1000,
    lg_iterations=100,
    langgraph_refund=True,
    server_profile=True,
    lg_lengths=[10, 100, 1000, 10000],
    lg_reps=3,
    lg_samples=20,
    big_outputs=14,
    payload_iterations=8,
    payload_reps=3,
)
QUICK = Plan(
    lengths=[10, 1000],
    reps=2,
    samples=10,
    heavy_samples=3,
    bytes_samples=3,
    clients=[1, 8],
    seconds=1,
    tp_reps=1,
    kills=2,
    startup_reps=1,
    load_reps=10,
    long_iterations=30,
    lg_iterations=0,
    langgraph_refund=False,
    server_profile=False,
    lg_lengths=[10, 10000],
    lg_reps=1,
    lg_samples=6,
    big_outputs=3,
    model_rounds=3,
    model_calls=5,
    # The LangGraph subjects are part langgraph's to judge; the pipelining what-if is history.
    checkpoint_subjects=("floor", "store", "iteration"),
)


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="the Targets table's parts at a small size, < 2 minutes; does not touch docs/"
    )
    ap.add_argument(
        "--only",
        default=None,
        help=f"comma-separated parts to run (default: all; with --quick: {','.join(QUICK_PARTS)}): {','.join(PARTS)}",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Markdown file whose generated block is replaced (default: docs/benchmarks.md in full mode, "
        "a temporary file with --quick or --only)",
    )
    ap.add_argument("--long-iterations", type=int, default=None, help="iterations of the long scripted run (full: 1000)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    os.environ.pop("AGENTFAST_FAULT", None)

    plan = QUICK if args.quick else FULL
    if args.long_iterations is not None:
        plan = dataclasses.replace(plan, long_iterations=args.long_iterations)
    only = args.only if args.only is not None else ",".join(QUICK_PARTS if args.quick else PARTS)
    parts = [p.strip() for p in only.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    partial = args.quick or set(parts) != set(PARTS)
    out = args.out or (Path(tempfile.gettempdir()) / "agentfast-bench-quick.md" if partial else REPO / "docs" / "benchmarks.md")

    from . import CACHE, checkpoint, model, payloads, procs, profile, throughput
    from .pg import start_server
    from .report import machine, render, write_doc

    t_start = time.monotonic()
    load0 = os.getloadavg()[0]
    _log(f"mode {'quick' if args.quick else 'full'}; parts {', '.join(parts)}; starting PostgreSQL")
    server = start_server()
    res: dict[str, Any] = {"mode": "quick" if args.quick else ("full" if not partial else f"partial ({', '.join(parts)})")}
    try:
        res["machine"] = machine(server.settings())
        _log(f"server up: {res['machine']['PostgreSQL']}")
        work = server.workdir / "work"
        work.mkdir()
        if "checkpoint" in parts:
            _log("part 1: checkpoint cost")
            dsn = server.create_database("ckpt")
            res["checkpoint"] = checkpoint.run(
                dsn,
                checkpoint.CheckpointConfig(
                    lengths=plan.lengths,
                    reps=plan.reps,
                    samples=plan.samples,
                    heavy_samples=plan.heavy_samples,
                    bytes_samples=plan.bytes_samples,
                    subjects=list(plan.checkpoint_subjects or checkpoint.SUBJECTS),
                ),
                _log,
            )
            res["load_snapshot"] = checkpoint.measure_load(dsn, 1000, plan.load_reps)
        if "throughput" in parts:
            _log("part 2: throughput")
            dsn = server.create_database("tput")
            res["throughput"] = throughput.run(
                server, dsn, throughput.ThroughputConfig(plan.clients, plan.seconds, plan.tp_reps), _log
            )
        if "resume" in parts:
            _log("part 3: resume latency and start-up")
            dsn = server.create_database("resume")
            from agentfast.runner.store import Store

            with Store(dsn) as s:
                s.migrate()
            res["startup"] = procs.measure_startup(dsn, work, plan.startup_reps)
            res["resume"] = procs.measure_resume(dsn, work, plan.kills, _log)
        if "rss" in parts:
            _log("part 4: peak RSS")
            dsn = server.create_database("rss")
            from agentfast.runner.store import Store

            with Store(dsn) as s:
                s.migrate()
            res["rss"] = procs.measure_rss(
                dsn, work, plan.long_iterations, plan.lg_iterations, _log, langgraph_refund=plan.langgraph_refund
            )
        if "profile" in parts:
            _log("part 5: profiles")
            dsn = server.create_database("prof")
            prof: dict[str, Any] = {"commit": profile.profile_commit(dsn, 1000, 300 if not args.quick else 60)}
            prof["adapter"] = profile.profile_adapter(dsn, 1000, 10 if not args.quick else 3)
            prof["imports"] = profile.import_times()
            prof["openai"] = profile.openai_transform([100, 1000, 3000] if not args.quick else [100, 1000])
            prof["json"] = profile.json_encode_cost([100, 1000, 3000] if not args.quick else [100, 1000])
            if plan.server_profile:
                prof["server"] = profile.server_statements(server, 1000, 300)
            res["profile"] = prof
        if "model" in parts:
            _log("part 6: model call client cost")
            (work / "model").mkdir()
            res["model"] = model.run(
                work / "model", model.ModelCallConfig([30, 300, 3000], plan.model_rounds, plan.model_calls), _log
            )
        if "payloads" in parts:
            _log("part 7: large payloads")
            res["payloads"] = payloads.run(
                server.create_database, payloads.PayloadsConfig(iterations=plan.payload_iterations, reps=plan.payload_reps), _log
            )
        if "langgraph" in parts:
            from . import lg

            _log("part 8: the LangGraph adapter against LangGraph itself")
            dsn = server.create_database("lg")
            res["langgraph"] = lg.run(
                dsn,
                work,
                lg.LgConfig(
                    lengths=plan.lg_lengths,
                    reps=plan.lg_reps,
                    samples=plan.lg_samples,
                    bytes_samples=3,
                    big_outputs=plan.big_outputs,
                    big_bytes=2_000_000,
                ),
                _log,
            )
    finally:
        server.close()
    res["duration_s"] = time.monotonic() - t_start
    res["load"] = (load0, os.getloadavg()[0])
    text = render(res)
    write_doc(out, text)
    raw = CACHE / "bench"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{'quick' if args.quick else 'full'}-latest.json").write_text(json.dumps(_jsonable(res), indent=1, default=str))
    _log(f"done in {res['duration_s']:.0f}s; wrote {out} and {raw}/")
    if partial:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
