"""``python -m agentfast.operator KOPF-RUN-ARGS...``: the operator's entry point, as the chart runs it.

With ``AGENTFAST_LEADER_ELECTION`` not ``false`` (the chart sets it with ``operator.replicas`` > 1)
the process first waits to hold the Lease ``AGENTFAST_LEADER_LEASE`` (default
``agentfast-operator``) in its own namespace (``POD_NAMESPACE``), as ``POD_NAME``
(``operator/leader.py``), answering its liveness probe meanwhile; then it runs ``kopf run
KOPF-RUN-ARGS`` (``--standalone``: kopf's own peering is not used) while renewing the Lease. If a
renewal cannot succeed within the renew deadline the process exits at once (status 1), before
anyone else may take the Lease: a leader that lost it must not act another moment. On a graceful
stop (SIGTERM) kopf finishes and the Lease is released, so a standby takes over within a second.
"""

from __future__ import annotations

import http.server
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import kubernetes

from agentfast.runner import logs

from . import metrics
from .leader import LeaderElector

log = logging.getLogger("agentfast.operator")


@contextmanager
def _standby_health(liveness_url: str | None) -> Iterator[None]:
    """Answer the liveness probe's URL with 200 while waiting for the Lease (kopf serves it later)."""
    if not liveness_url:
        yield
        return
    url = urlparse(liveness_url)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(200 if self.path == (url.path or "/") else 404)
            self.end_headers()
            self.wfile.write(b"standby: waiting for the leader lease\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((url.hostname or "0.0.0.0", url.port or 8080), Handler)
    server.allow_reuse_address = True
    thread = threading.Thread(target=server.serve_forever, name="agentfast-standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _liveness_url(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        if a.startswith("--liveness="):
            return a.split("=", 1)[1]
        if a in ("--liveness", "-L") and i + 1 < len(args):
            return args[i + 1]
    return None


def main(args: list[str]) -> int:
    logs.configure(os.environ.get("AGENTFAST_LOG_LEVEL", "INFO"))
    # /metrics from the start, on every replica: a standby answers (agentfast_operator_leader 0)
    # rather than counting as a target down; only the acting one adds the runs' figures.
    metrics.serve()
    import kopf.cli

    elector = None
    stop = threading.Event()
    if os.environ.get("AGENTFAST_LEADER_ELECTION", "false").lower() != "false":
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        elector = LeaderElector(
            kubernetes.client.CoordinationV1Api(),
            os.environ.get("POD_NAMESPACE", "default"),
            os.environ.get("AGENTFAST_LEADER_LEASE", "agentfast-operator"),
            os.environ.get("POD_NAME") or socket.gethostname(),
        )
        log.info("leader election: %s waits for the lease", elector.identity)
        with _standby_health(_liveness_url(args)):
            elector.acquire(stop)
        elector.keep(stop, on_lost=lambda: os._exit(1))
    # kopf run installs its own log handler on the root logger; ours served the wait for the Lease
    # only, and kept would print every line twice.
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    try:
        kopf.cli.main(args=["run", *args], prog_name="kopf", standalone_mode=False)
        return 0
    finally:
        stop.set()
        if elector is not None:
            elector.release()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
