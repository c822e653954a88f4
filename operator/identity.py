"""The runner pods' ServiceAccount in each run namespace (issue 14 item 7): cloud identity for
model endpoints (IRSA, GKE or Azure workload identity: an annotation on the ServiceAccount).

A ServiceAccount is namespaced and a pod can use only one of its own namespace, so a chart in
the release namespace cannot make it for every team. With the chart's
``runner.serviceAccount.create`` the operator makes it, as it makes the runner Secret
(``operator/credentials.py``): the ServiceAccount ``runner.serviceAccount.name`` (default
``agentfast-runner``) in each namespace that runs AgentRuns, labelled as the operator's, with
the chart's ``runner.serviceAccount.annotations``, kept in step with them. It never touches a
ServiceAccount of that name that it did not make (no label): that one is used as it is, and the
team or an admin owns it. Nothing is bound to it: it carries no Kubernetes rights, and its API
token is not mounted in the pod unless the chart's ``runner.serviceAccount.automountToken`` says
so. No AgentRun names a ServiceAccount.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from .workload import RunnerConfig, read_or_none

log = logging.getLogger("agentfast.operator")
MANAGED_BY = {"app.kubernetes.io/managed-by": "agentfast", "app.kubernetes.io/component": "runner-identity"}
RECHECK_S = 60.0  # how long a namespace's ServiceAccount is trusted to still be as made
_seen: dict[str, float] = {}
_lock = threading.Lock()


def ensure_runner_service_account(namespace: str, core: Any, cfg: RunnerConfig, *, timeout_s: float = 30) -> str:
    """Make sure ``namespace`` has the runner ServiceAccount with the chart's annotations, when
    ``cfg.service_account_create``. Returns what it did: ``"off"`` (create is off), ``"cached"``
    (checked less than :data:`RECHECK_S` s ago), ``"created"``, ``"updated"`` (its annotations
    differed: set to the chart's; annotations it does not manage are kept), ``"unchanged"``, or
    ``"foreign"`` (one of that name exists that the operator did not make: left alone, used as
    it is). ``core``: a kubernetes CoreV1Api allowed to get, create and patch ServiceAccounts.
    Raises kubernetes ApiException (other than a 409 from a concurrent create)."""
    if not cfg.service_account_create:
        return "off"
    name = cfg.service_account
    with _lock:
        at = _seen.get(namespace)
        if at is not None and time.monotonic() - at < RECHECK_S:
            return "cached"
        found = read_or_none(core.read_namespaced_service_account, name, namespace, _request_timeout=timeout_s)
        done = _make_or_mend(found, namespace, core, cfg, timeout_s)
        _seen[namespace] = time.monotonic()
        return done


def _make_or_mend(found: Any, namespace: str, core: Any, cfg: RunnerConfig, timeout_s: float) -> str:
    """Create the ServiceAccount when ``found`` is None, else set the chart's annotations on one
    the operator made; returns what it did (see :func:`ensure_runner_service_account`)."""
    name = cfg.service_account
    if found is None:
        body = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "automountServiceAccountToken": cfg.automount_token,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": dict(MANAGED_BY),
                "annotations": dict(cfg.service_account_annotations),
            },
        }
        try:
            core.create_namespaced_service_account(namespace, body, _request_timeout=timeout_s)
        except ApiException as err:
            if err.status != 409:
                raise
        return "created"
    labels = found.metadata.labels or {}
    if any(labels.get(k) != v for k, v in MANAGED_BY.items()):
        log.warning("ServiceAccount %s/%s exists and was not made by agentfast: runner pods use it as it is", namespace, name)
        return "foreign"
    have = found.metadata.annotations or {}
    if any(have.get(k) != v for k, v in cfg.service_account_annotations.items()):
        core.patch_namespaced_service_account(
            name, namespace, {"metadata": {"annotations": dict(cfg.service_account_annotations)}}, _request_timeout=timeout_s
        )
        return "updated"
    return "unchanged"


def forget(namespace: str | None = None) -> None:
    """Drop what is known of ``namespace``'s ServiceAccount (all namespaces when None)."""
    with _lock:
        if namespace is None:
            _seen.clear()
        else:
            _seen.pop(namespace, None)
