"""Per-namespace runner credentials, made by the operator (issue 13 item 3, G11).

Runner pods never get the operator's DSN. For each namespace that runs AgentRuns the operator
makes a Postgres login role (``Store.set_tenant_password``: member of ``agentfast_runner``,
confined by row-level security to that namespace's runs, no right to write a decision) and the
Secret :data:`RUNNER_SECRET` in that namespace, holding a DSN for it under :data:`RUNNER_SECRET_KEY`,
which every runner pod mounts as ``AGENTFAST_DSN``. Nobody copies Secrets by hand.

The Secret's annotation :data:`CREDENTIAL_ANNOTATION` carries the id of the credential it holds
(``agentfast_tenants.credential_id``): when the two differ (the Secret was deleted or edited, the
database was replaced), the operator gives the role a new password and rewrites the Secret; so it
does when the credential is older than the rotation period. A namespace left with no AgentRun (or
no longer watched) loses its credential (:func:`revoke_unused`, every resync). It
looks only at a Secret's metadata, and only at its own Secret. A re-key leaves running runners connected; a new pod gets the new
password (a pod started from the old one fails to log in, and the operator starts the next one).
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
import time
from typing import Any

import psycopg
from kubernetes.client.exceptions import ApiException

from .workload import API_TIMEOUT_S, RUNNER_SECRET, RUNNER_SECRET_KEY, read_or_none

CREDENTIAL_ANNOTATION = "agentfast.dev/credential-id"
MANAGED_BY = {"app.kubernetes.io/managed-by": "agentfast", "app.kubernetes.io/component": "runner-credentials"}

log = logging.getLogger("agentfast.operator")

RECHECK_S = 60.0  # how long a namespace's Secret is trusted to still hold its credential
_verified: dict[str, tuple[str, float]] = {}  # namespace -> (credential id in its Secret, when seen)
_stale: set[str] = set()  # namespaces whose credential is due for rotation
_lock = threading.Lock()


def runner_dsn(operator_dsn: str, role: str, password: str) -> str:
    """The operator's DSN with ``role`` and ``password`` as its user and password: the same host,
    port, database and options (sslmode...). Raises psycopg.ProgrammingError for a DSN libpq
    cannot parse (it parsed for the operator, so never in practice)."""
    return psycopg.conninfo.make_conninfo(operator_dsn, user=role, password=password)


def ensure_runner_secret(namespace: str, store: Any, core: Any, operator_dsn: str) -> bool:
    """Make sure ``namespace`` has a runner role and its Secret, in agreement; returns whether it
    (re)made them. ``store``: the operator's Store (a role with CREATEROLE); ``core``: a
    kubernetes CoreV1Api allowed to read, create and replace Secrets. Cheap when nothing changed:
    one query, and a read of the Secret at most every :data:`RECHECK_S` s (a Secret deleted or
    edited behind the operator's back is remade within that). Raises StoreUnavailable, kubernetes
    ApiException."""
    with _lock:
        tenant = store.tenant(namespace)
        seen = _verified.get(namespace)
        if tenant is not None and seen is not None and seen[0] == tenant[1] and time.monotonic() - seen[1] < RECHECK_S:
            return False
        found = read_or_none(core.read_namespaced_secret, RUNNER_SECRET, namespace)
        rotate = namespace in _stale
        if (
            not rotate
            and tenant is not None
            and found is not None
            and (found.metadata.annotations or {}).get(CREDENTIAL_ANNOTATION) == tenant[1]
        ):
            _verified[namespace] = (tenant[1], time.monotonic())
            return False
        password = secrets.token_urlsafe(32)
        role, credential_id = store.set_tenant_password(namespace, password)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": RUNNER_SECRET,
                "namespace": namespace,
                "labels": dict(MANAGED_BY),
                "annotations": {CREDENTIAL_ANNOTATION: credential_id},
            },
            "data": {RUNNER_SECRET_KEY: base64.b64encode(runner_dsn(operator_dsn, role, password).encode()).decode()},
        }
        if found is None:
            core.create_namespaced_secret(namespace, body, _request_timeout=API_TIMEOUT_S)
        else:
            body["metadata"]["resourceVersion"] = found.metadata.resource_version
            core.replace_namespaced_secret(RUNNER_SECRET, namespace, body, _request_timeout=API_TIMEOUT_S)
        _verified[namespace] = (credential_id, time.monotonic())
        _stale.discard(namespace)
        return True


REVOKE_GRACE_S = 300.0  # a credential younger than this is never revoked: its run may be newer than the list


def revoke_unused(store: Any, core: Any, in_use: set[str], rotate_after_s: float) -> list[str]:
    """Revoke the runner credential of every namespace not in ``in_use`` (the namespaces whose
    AgentRuns the operator serves now: none left there, or no longer watched) and older than
    :data:`REVOKE_GRACE_S`, deleting its Secret; returns those namespaces. A run created there later gets a fresh credential. Also
    marks for re-keying (at their next :func:`ensure_runner_secret`) the credentials of
    namespaces in use older than ``rotate_after_s`` (0: never). A Secret the operator may not
    delete (403: a namespace no longer watched, where the chart grants it nothing) is left,
    logged, holding a password that no longer logs in. Raises StoreUnavailable, kubernetes
    ApiException (other than 404 for a Secret already gone, and 403)."""
    revoked = []
    with _lock:
        for namespace, age_s in store.tenants().items():
            if namespace in in_use:
                if rotate_after_s and age_s > rotate_after_s:
                    _verified.pop(namespace, None)
                    _stale.add(namespace)
                continue
            if age_s < REVOKE_GRACE_S:
                continue
            store.revoke_tenant(namespace)
            _verified.pop(namespace, None)
            try:
                core.delete_namespaced_secret(RUNNER_SECRET, namespace, _request_timeout=API_TIMEOUT_S)
            except ApiException as err:
                if err.status == 403:
                    log.warning(
                        "revoked the runner credential of namespace %s; its Secret %s stays (the operator may not delete"
                        " it there: not a watched namespace), its password no longer logs in",
                        namespace,
                        RUNNER_SECRET,
                    )
                elif err.status != 404:
                    raise
            revoked.append(namespace)
    return revoked


def forget(namespace: str | None = None) -> None:
    """Drop what is known of ``namespace``'s Secret (all namespaces when None): the next
    :func:`ensure_runner_secret` looks at the Secret again."""
    with _lock:
        if namespace is None:
            _verified.clear()
        else:
            _verified.pop(namespace, None)
