"""Leader election on a Kubernetes Lease (``coordination.k8s.io/v1``), so the operator can run as
several replicas with exactly one acting (issue 14 item 4).

The algorithm is client-go's ``leaderelection`` (the one controller-runtime and kube-controller-
manager use), reduced to what one Python process needs:

- A candidate reads the Lease. It takes it (an update carrying the ``resourceVersion`` it read, so
  two candidates cannot both win) when nobody holds it, when it is released (empty
  ``holderIdentity``), or when the record has not changed for ``lease_s`` as measured on the
  candidate's own clock (never by comparing another node's ``renewTime`` with ours: clocks drift).
- The leader renews every ``retry_s``. If no renewal succeeds for ``renew_deadline_s`` (shorter than
  ``lease_s``, so it stops before anyone else may start) it has lost the lease: the caller must stop
  acting at once (the operator exits; its pod restarts as a candidate).
- On a graceful stop the leader releases the Lease (empty holder, 1 s duration), so a standby takes
  over within about ``retry_s`` instead of ``lease_s``.

Defaults: lease 10 s, renew deadline 7 s, retry 1 s: a leader killed without warning is replaced
within about 11 s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("agentfast.leader")


class LeaderElector:
    """One candidate for the Lease ``namespace``/``name`` as ``identity`` (its pod name).

    ``api`` is a ``kubernetes.client.CoordinationV1Api``. Durations in seconds. Every API call has a
    timeout of ``retry_s`` or more, so a hung call cannot outlive the renew deadline unnoticed.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_s: float = 10.0,
        renew_deadline_s: float = 7.0,
        retry_s: float = 1.0,
    ):
        if not retry_s < renew_deadline_s < lease_s:
            raise ValueError("leader election needs retry < renew deadline < lease duration")
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_s, self.renew_deadline_s, self.retry_s = lease_s, renew_deadline_s, retry_s
        self._seen: tuple[str, float] | None = None  # (resourceVersion, monotonic time first seen)

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this candidate holds the Lease (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            if self.try_acquire_or_renew():
                log.info("leader election: %s holds %s/%s", self.identity, self.namespace, self.name)
                return True
            stop.wait(self.retry_s)
        return False

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew in a daemon thread until ``stop``; call ``on_lost`` once if the renew deadline passes."""

        def loop() -> None:
            last_ok = time.monotonic()
            while not stop.wait(self.retry_s):
                try:
                    ok = self.try_acquire_or_renew()
                except Exception:  # an API error is a failed renewal, not a crash
                    log.exception("leader election: renewing the lease failed")
                    ok = False
                if ok:
                    last_ok = time.monotonic()
                elif time.monotonic() - last_ok > self.renew_deadline_s:
                    log.error("leader election: no renewal for %.0f s; the lease is lost", self.renew_deadline_s)
                    on_lost()
                    return

        thread = threading.Thread(target=loop, name="agentfast-leader", daemon=True)
        thread.start()
        return thread

    def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this candidate holds the Lease afterwards. Raises ApiException
        for API errors other than a conflict (409: someone else wrote first) or a missing Lease."""
        now = datetime.now(UTC)
        timeout = max(self.retry_s, 2.0)
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as err:
            if err.status != 404:
                raise
            body = kubernetes.client.V1Lease(
                metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(now, acquired=now, transitions=0),
            )
            try:
                self.api.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
                return True
            except ApiException as err2:
                if err2.status == 409:
                    return False
                raise
        spec = lease.spec or kubernetes.client.V1LeaseSpec()
        holder = spec.holder_identity or ""
        version = lease.metadata.resource_version
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, time.monotonic())
        expired = time.monotonic() - self._seen[1] > (spec.lease_duration_seconds or self.lease_s)
        if holder and holder != self.identity and not expired:
            return False
        ours = holder == self.identity
        lease.spec = self._spec(
            now, acquired=spec.acquire_time if ours else now, transitions=(spec.lease_transitions or 0) + (0 if ours else 1)
        )
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=timeout)
            return True
        except ApiException as err:
            if err.status == 409:  # another candidate (or our own previous write) changed it first
                return False
            raise

    def release(self) -> None:
        """Give the Lease up (graceful stop): empty holder, 1 s duration. Best effort."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
            if (lease.spec.holder_identity or "") != self.identity:
                return
            lease.spec.holder_identity = ""
            lease.spec.lease_duration_seconds = 1
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=5)
            log.info("leader election: %s released %s/%s", self.identity, self.namespace, self.name)
        except Exception:
            log.exception("leader election: releasing the lease failed (the next leader waits for it to expire)")

    def _spec(self, now: datetime, *, acquired: Any, transitions: int) -> Any:
        return kubernetes.client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=int(self.lease_s),
            acquire_time=_micro(acquired),
            renew_time=_micro(now),
            lease_transitions=transitions,
        )


def _micro(t: Any) -> Any:
    """A MicroTime as the API server parses it (RFC 3339 with exactly six fractional digits; the
    client's own isoformat() drops them when they are zero)."""
    if isinstance(t, datetime):
        return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return t
