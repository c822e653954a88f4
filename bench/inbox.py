"""What the approvals inbox (``agentfast ui``, runner/ui.py) costs with many runs in the store.

``python -m bench.inbox [--runs 200] [--reps 15]``: starts its own embedded PostgreSQL, makes one
real refund run (bench/metrics_scrape.py's template: the scripted model over real HTTP, an
approval, a takeover), copies its rows to ``--runs`` runs, then times, through the real app
served by uvicorn on 127.0.0.1 (HTTP, the peer check, templates and all):

* ``index``: ``GET /``, the run list a person opens;
* ``run_page``: ``GET /runs/default/<one run>``, with its transcript;
* ``live_check``: what an open page costs each second it stays open (``LocalInbox.version``);
* the baseline, in the same run against the same server: ``Store.list_runs()``, what ``agentfast
  list`` reads to print the same runs.

Prints the medians and the ratios to the baseline as JSON. Not part of ``python -m bench``'s full report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
import uuid
from typing import Any

import httpx
import uvicorn

from agentfast.runner.examples import EXAMPLES_DSN_ENV, provision
from agentfast.runner.inbox import LocalInbox
from agentfast.runner.store import Store
from agentfast.runner.ui import Access, create_app
from bench.metrics_scrape import copy_runs, template_run, timed
from bench.pg import start_server


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dsn", help="an empty database to use instead of a server of its own")
    args = ap.parse_args(argv)
    server = start_server() if args.dsn is None else None
    try:
        dsn = args.dsn or server.create_database("inbox")  # type: ignore[union-attr]
        os.environ.setdefault(EXAMPLES_DSN_ENV, provision(dsn, password=f"bench-{uuid.uuid4().hex}"))
        store = Store(dsn)
        store.migrate()
        template = template_run(store)
        copy_runs(dsn, template, args.runs - 1)
        inbox = LocalInbox(store, "bench")
        secret = uuid.uuid4().hex
        app = create_app(Access(shared=inbox, secret=secret), allowed_hosts=["127.0.0.1"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=web.run, daemon=True).start()
        while not web.started:
            time.sleep(0.05)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", follow_redirects=True)
        client.get(f"/?token={secret}")  # the cookie, as a browser opening the printed address

        def index() -> None:
            got = client.get("/")
            assert got.status_code == 200 and template in got.text

        def run_page() -> None:
            got = client.get(f"/runs/{template}")
            assert got.status_code == 200 and "Transcript" in got.text

        samples: dict[str, list[float]] = {"index": [], "run_page": [], "live_check": [], "baseline": []}
        for _ in range(args.reps):  # interleaved, so a load change on the shared machine hits all alike
            samples["index"] += timed(index, 1)
            samples["run_page"] += timed(run_page, 1)
            samples["live_check"] += timed(inbox.version, 1)
            samples["baseline"] += timed(store.list_runs, 1)
        med = {k: statistics.median(v) for k, v in samples.items()}
        result = {
            "runs": args.runs,
            "reps": args.reps,
            **{f"{k}_ms_median": round(v * 1000, 2) for k, v in med.items()},
            "ratio_index_to_baseline": round(med["index"] / med["baseline"], 2),
            "ratio_run_page_to_baseline": round(med["run_page"] / med["baseline"], 2),
            "ratio_live_check_to_baseline": round(med["live_check"] / med["baseline"], 3),
        }
        client.close()
        web.should_exit = True
        store.close()
        print(json.dumps(result, indent=2))
        return result
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
