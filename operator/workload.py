"""The runner workload of one AgentRun: a Pod that runs ``agentfast resume NAMESPACE/NAME``.

Why bare Pods owned by the operator, not a Job: the Job controller replaces a failed pod only
after its exponential backoff (10 s, 20 s, ... capped at 6 min; measured: 11-12 s for the first
loss, 21 s for the second), although the runner leaves within 0.1 s of SIGTERM and resumes in
about a second. A deleted, evicted or killed runner loses nothing (every iteration is committed,
G1/G2), so there is nothing to back off from: the operator (``operator/lifecycle.py``) creates the
next pod as soon as the last one's runner container has stopped, and backs off only from
failures that would repeat (an OOM kill, a runner that dies at start), up to the restart limit.
One pod per attempt, named ``agentrun-NAME-N``: a retried create of the same attempt gets 409,
never a second runner; the fencing epoch in Postgres covers any overlap anyway (G6).

The pod needs no Kubernetes credentials (no service-account token), runs as non-root with a
read-only root filesystem, and reads the DSN and the model key from Secrets: the key only from the
Secret key the run's ModelConfig names, as ``AGENTFAST_MODEL_API_KEY``; an AgentRun names no
Secret and no variable. The tools' own settings (their databases, their API keys) come from the
namespace's Secret ``agentfast-tools`` (the chart's ``runner.toolSecret``), if there is one,
mounted as files that only the tool host turns into its environment (``runner/toolhost.py``):
the runner's process never has them in its environment, and the tools never see the DSN or the
model key (G11).

With the chart's ``networkPolicy.enabled``, :func:`build_network_policy` gives each runner pod a
NetworkPolicy of its own: no ingress, egress only to DNS, Postgres and the admin's model peers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from agentfast.runner import boundedjson
from agentfast.runner.errors import SettingError
from agentfast.runner.liveness import STALE_AFTER_S
from agentfast.runner.names import DEFAULT_MAX_ITERATION_CRASHES, MAX_ITERATION_CRASHES_ENV, format_run_id
from agentfast.runner.payloads import DEFAULT_MAX_BYTES, DEFAULT_THRESHOLD_BYTES, MAX_ENV, THRESHOLD_ENV
from agentfast.runner.spec import (
    DNS1123_SUBDOMAIN,
    MCP_COMMANDS_ENV,
    MCP_ENV_ENV,
    MCP_SERVERS_ENV,
    MODEL_API_KEY_ENV,
    OPERATOR_TOLERATION_KEYS,
    QUANTITY_PATTERN,
    Affinity,
    RunnerSpec,
    SpecError,
    Toleration,
    check_allowed_images,
    image_allowed,
)
from agentfast.runner.toolhost import TOOL_ENV_DIR_ENV

LABEL_RUN = "agentfast.dev/run"
#: The AgentRun's full name on its runner objects (a name over 63 characters does not fit the label).
ANNOTATION_RUN = "agentfast.dev/run-name"
RUNNER_CONTAINER = "runner"
#: The uid of the AgentRun a runner pod serves (a pod of an earlier AgentRun of the same name is not its).
LABEL_RUN_UID = "agentfast.dev/run-uid"
#: On a runner pod: its attempt number (1, 2, ...), failures counted against the restart limit so
#: far, and, on a replacement, when its predecessor was lost (ISO 8601; for the Resumed Event).
ANNOTATION_ATTEMPT = "agentfast.dev/attempt"
ANNOTATION_COUNTED = "agentfast.dev/counted-failures"
ANNOTATION_LOST_AT = "agentfast.dev/replaces-loss-at"
#: Seconds any one Kubernetes API call of the operator may take; then it is given up (the next
#: reconcile or resync tries again), so one hung call never stalls a handler for ever.
API_TIMEOUT_S = 30


def read_or_none(read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``read(*args, **kwargs)``, a kubernetes client read, with the API timeout unless
    ``_request_timeout`` is given; None when the object does not exist (404). Raises any other
    ApiException."""
    from kubernetes.client.exceptions import ApiException

    kwargs.setdefault("_request_timeout", API_TIMEOUT_S)
    try:
        return read(*args, **kwargs)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


#: Seconds a runner pod stays bound to a node that stopped answering before it is evicted.
NODE_LOSS_TOLERATION_S = 20
#: The Secret in a run's namespace holding its runners' DSN (made by operator/credentials.py).
RUNNER_SECRET = "agentfast-runner"
RUNNER_SECRET_KEY = "dsn"
#: Where a runner pod mounts its namespace's tool Secret (read by runner/toolhost.py).
TOOL_ENV_DIR = "/var/run/agentfast/tool-env"


#: Runner pod resources when the chart gives none (the chart's runner.resources default).
DEFAULT_RESOURCES: dict[str, Any] = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
#: The ServiceAccount the operator makes in each run namespace when runner.serviceAccount.create and no name is given.
DEFAULT_RUNNER_SERVICE_ACCOUNT = "agentfast-runner"
#: How long an ended run's last runner pod stays for ``kubectl logs``, s (the chart's
#: runner.podTTLSecondsAfterFinished default; its comment says why an hour).
DEFAULT_POD_TTL_S = 3600
#: The longest runner.podTTLSecondsAfterFinished, s (a year; longer is "keep": -1).
MAX_POD_TTL_S = 31536000


@dataclass(frozen=True)
class RunnerConfig:
    """Operator settings for runner pods, from the environment the chart sets.

    Placement and size (``resources``, ``node_selector``, ``tolerations``, ``affinity``,
    ``priority_class``) are the chart's defaults for every runner pod; a run's ``spec.runner``
    replaces them per key (:func:`runner_settings`). ``allowed_images``: image references or
    path prefixes (ending with ``/``) a run's ``spec.runner.image`` may name, besides ``image``.
    ``service_account``: the ServiceAccount of runner pods (in the run's namespace; "" the
    namespace's default); with ``service_account_create`` the operator makes it in each run
    namespace with ``service_account_annotations`` (operator/identity.py). ``automount_token``:
    mount its API token in the pod (off: the runner needs no Kubernetes credentials, and the
    tools, which run in the pod, would get them too)."""

    image: str = "agentfast:dev"
    image_pull_policy: str = "IfNotPresent"
    # The operator's own DSN Secret (release namespace): never mounted in a runner; named here so
    # a ModelConfig cannot name it as a model key.
    dsn_secret: str = "agentfast-postgres"
    dsn_secret_key: str = "dsn"
    # Failures that would repeat (an OOM kill, a runner dying at start), in a row, before the run
    # fails; deletions, evictions, a lost node and a clean "retry me" (75) never count.
    restart_limit: int = 6
    # An iteration that crashed its runner this many times in a row ends the run Failed/CrashLoop
    # (the runner's AGENTFAST_MAX_ITERATION_CRASHES, runner/loop.py; the chart's runner.maxIterationCrashes).
    max_iteration_crashes: int = DEFAULT_MAX_ITERATION_CRASHES
    # A run waiting for a human longer than this releases its pod (spec.suspendAfter wins; 0: never), s.
    suspend_after_s: int = 60
    # An ended run's runner pods (and its NetworkPolicy) are deleted this long after it ended, s
    # (the chart's runner.podTTLSecondsAfterFinished; 0: at once; None: kept, as before).
    pod_ttl_s: int | None = DEFAULT_POD_TTL_S
    service_account: str = ""
    service_account_create: bool = False
    service_account_annotations: dict[str, str] = field(default_factory=dict)
    automount_token: bool = False
    resources: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_RESOURCES)))
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class: str = ""
    allowed_images: tuple[str, ...] = ()
    termination_grace_s: int = 30
    # The Secret, in each run's namespace, whose keys become the tool host's environment ("": none).
    tool_secret: str = "agentfast-tools"
    # Large payloads, bytes (runner/payloads.py): stored out of line over the threshold, refused over the max.
    payload_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    payload_max_bytes: int = DEFAULT_MAX_BYTES
    # Traces (runner/tracing.py): the OTLP/HTTP base URL runner pods export spans to ("": not traced).
    otlp_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.service_account_create and not self.service_account:  # the name the operator makes
            object.__setattr__(self, "service_account", DEFAULT_RUNNER_SERVICE_ACCOUNT)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RunnerConfig:
        """The settings in ``env`` (default: the process's). Structured ones are JSON:
        ``AGENTFAST_RUNNER_RESOURCES`` ({"requests": {...}, "limits": {...}}),
        ``AGENTFAST_RUNNER_NODE_SELECTOR`` ({label: value}), ``AGENTFAST_RUNNER_TOLERATIONS``
        ([toleration]), ``AGENTFAST_RUNNER_AFFINITY`` (an Affinity or {}),
        ``AGENTFAST_RUNNER_ALLOWED_IMAGES`` ([image or prefix/]),
        ``AGENTFAST_RUNNER_SERVICE_ACCOUNT_ANNOTATIONS`` ({key: value}); plain:
        ``AGENTFAST_RUNNER_PRIORITY_CLASS``, ``AGENTFAST_RUNNER_SERVICE_ACCOUNT``,
        ``AGENTFAST_RUNNER_SERVICE_ACCOUNT_CREATE`` and ``AGENTFAST_RUNNER_AUTOMOUNT_TOKEN``
        (true/false), ``AGENTFAST_RUNNER_POD_TTL_SECONDS`` (seconds; -1 or empty: keep the pods),
        ``AGENTFAST_RUNNER_PAYLOAD_THRESHOLD_BYTES`` and ``AGENTFAST_RUNNER_PAYLOAD_MAX_BYTES``
        (bytes, positive, the threshold not over the max), ``AGENTFAST_RUNNER_OTLP_ENDPOINT``
        (an http(s) URL or empty).
        Raises ValueError naming the variable: malformed JSON or shape, the tool
        Secret being a Postgres credential (the runners' or the operator's Secret), the runner
        ServiceAccount being the operator's own (``AGENTFAST_OPERATOR_SERVICE_ACCOUNT``) or
        ``default`` with create."""
        e = dict(os.environ if env is None else env)
        tool_secret = e.get("AGENTFAST_RUNNER_TOOL_SECRET", cls.tool_secret)
        if tool_secret in (RUNNER_SECRET, e.get("AGENTFAST_DSN_SECRET", cls.dsn_secret)):
            raise SettingError(f"AGENTFAST_RUNNER_TOOL_SECRET: {tool_secret!r} is a Postgres credential; tools never receive one")
        create = _env_bool(e, "AGENTFAST_RUNNER_SERVICE_ACCOUNT_CREATE")
        account = e.get("AGENTFAST_RUNNER_SERVICE_ACCOUNT", "") or (DEFAULT_RUNNER_SERVICE_ACCOUNT if create else "")
        if account and (len(account) > 253 or not re.match(DNS1123_SUBDOMAIN, account)):
            raise SettingError(f"AGENTFAST_RUNNER_SERVICE_ACCOUNT: {account[:64]!r} is not a ServiceAccount name")
        if account and account == e.get("AGENTFAST_OPERATOR_SERVICE_ACCOUNT"):
            raise SettingError(
                f"AGENTFAST_RUNNER_SERVICE_ACCOUNT: {account!r} is the operator's own ServiceAccount; runners never get its rights"
            )
        if create and account == "default":
            raise SettingError(
                "AGENTFAST_RUNNER_SERVICE_ACCOUNT: the operator does not manage a namespace's default ServiceAccount; name another"
            )
        annotations = _env_json(e, "AGENTFAST_RUNNER_SERVICE_ACCOUNT_ANNOTATIONS", {})
        if not isinstance(annotations, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
        ):
            raise SettingError("AGENTFAST_RUNNER_SERVICE_ACCOUNT_ANNOTATIONS: expected an object of string values")
        if annotations and not create:
            raise SettingError(
                "AGENTFAST_RUNNER_SERVICE_ACCOUNT_ANNOTATIONS: set only with AGENTFAST_RUNNER_SERVICE_ACCOUNT_CREATE=true"
                " (the operator annotates only a ServiceAccount it makes)"
            )
        threshold = _env_bytes(e, "AGENTFAST_RUNNER_PAYLOAD_THRESHOLD_BYTES", DEFAULT_THRESHOLD_BYTES)
        ceiling = _env_bytes(e, "AGENTFAST_RUNNER_PAYLOAD_MAX_BYTES", DEFAULT_MAX_BYTES)
        if threshold > ceiling:
            raise SettingError(
                f"AGENTFAST_RUNNER_PAYLOAD_THRESHOLD_BYTES ({threshold}) is over AGENTFAST_RUNNER_PAYLOAD_MAX_BYTES ({ceiling})"
            )
        otlp = e.get("AGENTFAST_RUNNER_OTLP_ENDPOINT", "").strip()
        if otlp and not re.match(r"https?://\S+$", otlp):
            raise SettingError(f"AGENTFAST_RUNNER_OTLP_ENDPOINT: {otlp[:64]!r} is not an http(s) URL")
        priority = e.get("AGENTFAST_RUNNER_PRIORITY_CLASS", "")
        if priority and (len(priority) > 253 or not re.match(DNS1123_SUBDOMAIN, priority)):
            raise SettingError(f"AGENTFAST_RUNNER_PRIORITY_CLASS: {priority[:64]!r} is not a PriorityClass name")
        return cls(
            image=e.get("AGENTFAST_RUNNER_IMAGE", cls.image),
            image_pull_policy=e.get("AGENTFAST_RUNNER_PULL_POLICY", cls.image_pull_policy),
            dsn_secret=e.get("AGENTFAST_DSN_SECRET", cls.dsn_secret),
            dsn_secret_key=e.get("AGENTFAST_DSN_SECRET_KEY", cls.dsn_secret_key),
            restart_limit=int(e.get("AGENTFAST_RESTART_LIMIT", cls.restart_limit)),
            max_iteration_crashes=_max_crashes(e),
            suspend_after_s=int(e.get("AGENTFAST_SUSPEND_AFTER_SECONDS", cls.suspend_after_s)),
            pod_ttl_s=_pod_ttl(e),
            service_account=account,
            service_account_create=create,
            service_account_annotations=annotations,
            automount_token=_env_bool(e, "AGENTFAST_RUNNER_AUTOMOUNT_TOKEN"),
            resources=_check_resources(_env_json(e, "AGENTFAST_RUNNER_RESOURCES", DEFAULT_RESOURCES)),
            node_selector=_check_node_selector(_env_json(e, "AGENTFAST_RUNNER_NODE_SELECTOR", {})),
            tolerations=_check_tolerations(_env_json(e, "AGENTFAST_RUNNER_TOLERATIONS", [])),
            affinity=_check_affinity(_env_json(e, "AGENTFAST_RUNNER_AFFINITY", {})),
            priority_class=priority,
            allowed_images=check_allowed_images(
                _env_json(e, "AGENTFAST_RUNNER_ALLOWED_IMAGES", []), "AGENTFAST_RUNNER_ALLOWED_IMAGES"
            ),
            tool_secret=tool_secret,
            payload_threshold_bytes=threshold,
            payload_max_bytes=ceiling,
            otlp_endpoint=otlp,
        )


def _pod_ttl(env: dict[str, str]) -> int | None:
    """``AGENTFAST_RUNNER_POD_TTL_SECONDS``: seconds from 0 to :data:`MAX_POD_TTL_S`; -1, empty or
    ``null`` (the chart's null): None, keep the pods; unset: :data:`DEFAULT_POD_TTL_S`."""
    raw = env.get("AGENTFAST_RUNNER_POD_TTL_SECONDS")
    if raw is None:
        return DEFAULT_POD_TTL_S
    raw = raw.strip()
    if raw in ("", "-1", "null"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if not 0 <= value <= MAX_POD_TTL_S:
        raise SettingError(
            f"AGENTFAST_RUNNER_POD_TTL_SECONDS: expected seconds from 0 to {MAX_POD_TTL_S}, or -1 to keep the pods,"
            f" not {raw[:16]!r}"
        )
    return value


def _max_crashes(env: dict[str, str]) -> int:
    """``AGENTFAST_RUNNER_MAX_ITERATION_CRASHES`` as the runner reads its own variable. Raises SettingError."""
    raw = env.get("AGENTFAST_RUNNER_MAX_ITERATION_CRASHES", "").strip()
    if not raw:
        return DEFAULT_MAX_ITERATION_CRASHES
    if not raw.isdigit() or int(raw) < 1:
        raise SettingError(f"AGENTFAST_RUNNER_MAX_ITERATION_CRASHES: {raw[:32]!r} is not an integer >= 1")
    return int(raw)


def _env_bytes(env: dict[str, str], name: str, default: int) -> int:
    """A positive whole number of bytes from ``env[name]`` (unset or empty: ``default``). Raises ValueError naming it."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise SettingError(f"{name}: {raw[:40]!r} is not a positive whole number of bytes")
    return int(raw)


def _env_bool(env: dict[str, str], name: str) -> bool:
    value = env.get(name, "false").strip().lower()
    if value not in ("true", "false", ""):
        raise SettingError(f"{name}: expected true or false, not {value[:16]!r}")
    return value == "true"


def _env_json(env: dict[str, str], name: str, default: Any) -> Any:
    raw = env.get(name, "").strip()
    if not raw or raw == "null":
        return default
    try:
        return boundedjson.loads(raw, what=name)
    except ValueError as err:
        raise SettingError(f"{name} is not JSON: {err}") from None


def _check_resources(value: Any) -> dict[str, Any]:
    """The chart's runner resources: {"requests": {name: quantity}, "limits": {...}}, any resource
    names (an admin may give GPUs or ephemeral storage); numbers become strings."""
    if not isinstance(value, dict) or set(value) - {"requests", "limits"}:
        raise SettingError("AGENTFAST_RUNNER_RESOURCES: expected an object with requests and limits")
    out: dict[str, Any] = {}
    for part, entries in value.items():
        if entries is None:
            continue
        if not isinstance(entries, dict) or not all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in entries.values()
        ):
            raise SettingError(f"AGENTFAST_RUNNER_RESOURCES.{part}: expected an object of quantities (cpu: 500m, memory: 1Gi)")
        out[part] = {k: str(v) for k, v in entries.items()}
    return out


def _check_node_selector(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SettingError("AGENTFAST_RUNNER_NODE_SELECTOR: expected an object of label values")
    return value


def _check_tolerations(value: Any) -> tuple[dict[str, Any], ...]:
    """The chart's tolerations, checked for shape (an admin's may tolerate every taint: no key)."""
    if not isinstance(value, list):
        raise SettingError("AGENTFAST_RUNNER_TOLERATIONS: expected a list of tolerations")
    out = []
    for i, t in enumerate(value):
        try:
            out.append(Toleration.model_validate(t).model_dump(exclude_none=True))
        except ValidationError as err:
            raise SettingError(f"AGENTFAST_RUNNER_TOLERATIONS: [{i}].{_first_error(err)}") from None
    return tuple(out)


def _check_affinity(value: Any) -> dict[str, Any] | None:
    if value in ({}, None):
        return None
    try:
        return Affinity.model_validate(value).model_dump(exclude_none=True, exclude_defaults=True)
    except ValidationError as err:
        raise SettingError(f"AGENTFAST_RUNNER_AFFINITY: {_first_error(err)}") from None


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
    return f"{where}: {e['msg'].removeprefix('Value error, ')}" if where else e["msg"]


_QUANTITY_SUFFIX: dict[str, int | Decimal] = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def parse_quantity(text: str) -> Decimal | None:
    """The value of a quantity in the forms :data:`QUANTITY_PATTERN` allows (``500m`` = 0.5,
    ``1Gi`` = 1073741824), or None for another form (left to the API server)."""
    if not re.match(QUANTITY_PATTERN, text):
        return None
    number = re.match(r"^[0-9.]+", text).group(0)  # type: ignore[union-attr]
    return Decimal(number) * Decimal(_QUANTITY_SUFFIX[text[len(number) :]])


def runner_settings(body: dict[str, Any], cfg: RunnerConfig) -> dict[str, Any]:
    """The runner pod's image, resources and placement for the AgentRun ``body``: the chart's
    defaults in ``cfg``, then its ``spec.runner`` (validated again here: nothing else of it is
    read). Merge rule, per key: ``image``, ``affinity`` and ``priorityClassName`` replace the
    chart's; ``resources`` replace the chart's per entry (``requests.cpu``, ``limits.memory``...);
    ``nodeSelector`` per label; ``tolerations`` are added after the operator's and the chart's.

    Returns ``{"image", "resources", "nodeSelector", "tolerations", "affinity",
    "priorityClassName"}`` (empty values left out of the pod). Raises SpecError naming the field:
    an image not allowed (:func:`agentfast.runner.spec.image_allowed`), a malformed
    ``spec.runner``, a request above its limit once merged (e.g. the run's ``requests.memory: 1Gi``
    under the chart's ``limits.memory: 512Mi``: give ``limits.memory`` too)."""
    raw = (body.get("spec") or {}).get("runner")
    try:
        spec = RunnerSpec.model_validate(raw or {})
    except ValidationError as err:
        raise SpecError(f"spec.runner: {_first_error(err)}") from None
    image = cfg.image
    if spec.image is not None:
        if not image_allowed(spec.image, cfg.allowed_images, cfg.image):
            listed = ", ".join([cfg.image, *cfg.allowed_images][:8])
            raise SpecError(
                f"spec.runner.image: {spec.image[:128]!r} is not an image this cluster allows for runners"
                f" (runner.allowedImages: {listed})"
            )
        image = spec.image
    resources = {part: dict(entries) for part, entries in cfg.resources.items()}
    if spec.resources is not None:
        for part in ("requests", "limits"):
            given = getattr(spec.resources, part)
            if given is not None:
                resources.setdefault(part, {}).update(given.model_dump(exclude_none=True))
    for name, request in (resources.get("requests") or {}).items():
        limit = (resources.get("limits") or {}).get(name)
        r, lim = parse_quantity(str(request)), parse_quantity(str(limit)) if limit is not None else None
        if r is not None and lim is not None and r > lim:
            raise SpecError(
                f"spec.runner.resources: requests.{name} {request} is above limits.{name} {limit} (the chart's"
                f" runner.resources, unless the run sets it): give limits.{name} too"
            )
    own = [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": NODE_LOSS_TOLERATION_S}
        for key in OPERATOR_TOLERATION_KEYS
    ]
    run_tolerations = [t.model_dump(exclude_none=True) for t in spec.tolerations]
    affinity = spec.affinity.model_dump(exclude_none=True, exclude_defaults=True) if spec.affinity is not None else cfg.affinity
    return {
        "image": image,
        "resources": resources,
        "nodeSelector": {**cfg.node_selector, **spec.nodeSelector},
        "tolerations": [*own, *cfg.tolerations, *run_tolerations],
        "affinity": affinity or None,
        "priorityClassName": spec.priorityClassName or cfg.priority_class or None,
    }


def _fit63(text: str, key: str) -> str:
    """``text`` if at most 63 characters, else its first 54 (no trailing - or .) plus ``-`` and 8
    hex digits of sha256(``key``): deterministic, distinct for distinct keys, a valid DNS label
    and label value (begins and ends alphanumeric)."""
    if len(text) <= 63:
        return text
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return f"{text[:54].rstrip('-.')}-{digest}"


def runner_name(run_name: str) -> str:
    """The base name of a run's runner objects (its NetworkPolicy; its pods add ``-N``), ≤ 63
    chars: AgentRun names may be up to 253 characters, so a long one is cut and made unique with
    a hash of the whole name."""
    return _fit63(f"agentrun-{run_name}", run_name)


def pod_name(run_name: str, attempt: int) -> str:
    """The name of attempt ``attempt`` (1, 2, ...) of the run's runner pod: deterministic, so a
    create retried after the operator died mid-reconcile gets 409, never a second runner."""
    return f"{runner_name(run_name)}-{attempt}"


def run_label(run_name: str) -> str:
    """The value of the ``agentfast.dev/run`` label: the AgentRun's name when it fits a label
    value (63 characters), else a cut of it plus a hash of the whole (the annotation
    ``agentfast.dev/run-name`` always holds the full name)."""
    return _fit63(run_name, run_name)


def build_pod(
    body: dict[str, Any],
    cfg: RunnerConfig,
    *,
    attempt: int = 1,
    counted_failures: int = 0,
    lost_at: str | None = None,
    allowed_modules: tuple[str, ...] = (),
    model_key: dict[str, str] | None = None,
    mcp_servers: dict[str, str] | None = None,
    mcp_commands: tuple[str, ...] = (),
    mcp_env: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The manifest of attempt ``attempt`` of the runner pod of an AgentRun ``body`` (the
    ownerReference is added by kopf.adopt). ``counted_failures`` and ``lost_at`` are carried in
    its annotations (operator/lifecycle.py reads them back from the latest pod).

    ``allowed_modules`` reaches the runner as ``AGENTFAST_ALLOWED_MODULES``: the runner checks
    the refs against it again before importing anything. ``model_key`` is the ``apiKeySecretRef``
    (``{"name", "key"}``) of the ModelConfig the run was registered with, or None (the scripted
    model, an endpoint without a key): that one Secret key, and no other, becomes
    ``AGENTFAST_MODEL_API_KEY``, a fixed name of ours; nothing in the AgentRun's spec reaches the
    environment. Image, resources and placement: :func:`runner_settings` (chart defaults, then
    the run's ``spec.runner``, whose other parts never reach the pod).

    ``mcp_servers`` (the chart's ``mcp.servers``, name to URL) reaches the runner as
    ``AGENTFAST_MCP_SERVERS``, cut to the servers the run's ``spec.mcpServers`` name by
    ``serverRef``; ``mcp_commands`` as ``AGENTFAST_MCP_ALLOWED_COMMANDS`` and ``mcp_env`` as
    ``AGENTFAST_MCP_ALLOWED_ENV``: the runner checks the run against them again before its tool
    host starts anything (docs/mcp.md). A run's ``spec.mcpServers[].env`` never reaches the pod:
    the tool host passes it to that server alone, once checked.

    Raises ValueError when ``model_key`` is the DSN's Secret key itself, SpecError (a ValueError)
    when ``spec.runner`` is not allowed (:func:`runner_settings`)."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    env: list[dict[str, Any]] = [
        # The namespace's runner credential (operator/credentials.py), never the operator's DSN.
        {"name": "AGENTFAST_DSN", "valueFrom": {"secretKeyRef": {"name": RUNNER_SECRET, "key": RUNNER_SECRET_KEY}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "AGENTFAST_LOG_LEVEL", "value": "INFO"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "AGENTFAST_ALLOWED_MODULES", "value": ",".join(allowed_modules)},
        # The admin's MCP servers this run names (serverRef), and the programs a stdio server may be (docs/mcp.md).
        {"name": MCP_SERVERS_ENV, "value": json.dumps(_run_mcp_servers(body, mcp_servers or {}), sort_keys=True)},
        {"name": MCP_COMMANDS_ENV, "value": ",".join(mcp_commands)},
        {"name": MCP_ENV_ENV, "value": ",".join(mcp_env)},
        # A run waiting for a human longer than this commits, exits 0 and frees its pod (spec.suspendAfter wins).
        {"name": "AGENTFAST_SUSPEND_AFTER_SECONDS", "value": str(suspend_after_s(body, cfg))},
        # Started while its predecessor is still stopping (operator/lifecycle.py): wait for it to let go.
        {"name": "AGENTFAST_WAIT_FOR_HOLDER_SECONDS", "value": str(holder_wait_s(cfg))},
        # Large payloads (runner/payloads.py): the chart's runner.payloadThresholdBytes / payloadMaxBytes.
        {"name": THRESHOLD_ENV, "value": str(cfg.payload_threshold_bytes)},
        {"name": MAX_ENV, "value": str(cfg.payload_max_bytes)},
        # An iteration that keeps killing its runner ends the run Failed/CrashLoop (runner/loop.py).
        {"name": MAX_ITERATION_CRASHES_ENV, "value": str(cfg.max_iteration_crashes)},
    ]
    if cfg.otlp_endpoint:  # traces (runner/tracing.py), with the standard variables; the run's namespace as a resource attribute
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": cfg.otlp_endpoint})
        env.append({"name": "OTEL_RESOURCE_ATTRIBUTES", "value": f"k8s.namespace.name={namespace}"})
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if cfg.tool_secret:
        # optional: a namespace whose tools need no settings has no such Secret, and its runs start all the same
        env.append({"name": TOOL_ENV_DIR_ENV, "value": TOOL_ENV_DIR})
        mounts.append({"name": "tool-env", "mountPath": TOOL_ENV_DIR, "readOnly": True})
        volumes.append({"name": "tool-env", "secret": {"secretName": cfg.tool_secret, "optional": True}})
    if model_key is not None:
        if (model_key["name"], model_key["key"]) == (cfg.dsn_secret, cfg.dsn_secret_key) or model_key["name"] == RUNNER_SECRET:
            raise ValueError(
                f"the model key would be a Postgres credential (Secret {model_key['name']!r}, key {model_key['key']!r})"
            )
        env.append(
            {"name": MODEL_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": model_key["name"], "key": model_key["key"]}}}
        )
    placed = runner_settings(body, cfg)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # The runner needs no Kubernetes credentials; a token in the pod would be the tools' too.
        "automountServiceAccountToken": cfg.automount_token,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": cfg.termination_grace_s,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # First the operator's own: a lost node's pods are evicted after 20 s instead of the
        # default 300 s; the operator replaces a pod once its deletion deadline passes, even if
        # the kubelet never confirms (G6 fences a runner that is in fact still alive there).
        # Then the chart's, then the run's.
        "tolerations": placed["tolerations"],
        "containers": [
            {
                "name": RUNNER_CONTAINER,
                "image": placed["image"],
                "imagePullPolicy": cfg.image_pull_policy,
                "command": ["agentfast", "resume", format_run_id(namespace, name)],
                "env": env,
                "resources": placed["resources"],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    for key in ("nodeSelector", "affinity", "priorityClassName"):
        if placed[key]:
            pod_spec[key] = placed[key]
    if cfg.service_account:  # the chart's, never a run's: spec.runner names no ServiceAccount
        pod_spec["serviceAccountName"] = cfg.service_account
    pod_meta = _runner_object_meta(name, namespace)
    pod_meta["name"] = pod_name(name, attempt)
    pod_meta["labels"][LABEL_RUN_UID] = meta["uid"]
    pod_meta["annotations"].update({ANNOTATION_ATTEMPT: str(attempt), ANNOTATION_COUNTED: str(counted_failures)})
    if lost_at:
        pod_meta["annotations"][ANNOTATION_LOST_AT] = lost_at
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": pod_spec}


def _run_mcp_servers(body: dict[str, Any], servers: dict[str, str]) -> dict[str, str]:
    """The entries of ``servers`` (name to URL) the AgentRun ``body`` names in
    ``spec.mcpServers[i].serverRef``: a runner pod learns no other server's address."""
    wanted = {m.get("serverRef") for m in (body.get("spec") or {}).get("mcpServers") or [] if isinstance(m, dict)}
    return {name: url for name, url in servers.items() if name in wanted}


def suspend_after_s(body: dict[str, Any], cfg: RunnerConfig) -> int:
    """How long the run's runner waits for a human before it releases its pod, s: the AgentRun's
    ``spec.suspendAfter``, else the chart's ``runner.suspendAfterSeconds``; 0: never."""
    value = (body.get("spec") or {}).get("suspendAfter")
    return cfg.suspend_after_s if value is None else int(value)


def holder_wait_s(cfg: RunnerConfig) -> int:
    """How long a runner pod's claim waits for the run's previous runner to let go before it
    gives up with exit 76, s. The operator starts a replacement as soon as the old pod is being
    deleted: that runner lets go when it exits (within a second of SIGTERM, or when a tool call in
    flight ends), at the latest when the kubelet kills it at the end of its grace period; a
    runner on a lost node never exits, and its heartbeat goes stale after ``STALE_AFTER_S``
    (then it is taken over). A few seconds on top of the longer of the two."""
    return int(max(cfg.termination_grace_s, STALE_AFTER_S)) + 5


#: Egress to the cluster DNS when the admin gives none: kube-system, port 53 over UDP and TCP.
DEFAULT_DNS_EGRESS: tuple[dict[str, Any], ...] = (
    {
        "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    },
)
_RULE_KEYS = {"to", "ports"}
_PEER_KEYS = {"ipBlock", "namespaceSelector", "podSelector"}
_PORT_KEYS = {"port", "endPort", "protocol"}


@dataclass(frozen=True)
class EgressPolicy:
    """Where runner pods may connect when the chart enables ``networkPolicy``: NetworkPolicy egress
    rules (``{"to": [peers], "ports": [ports]}``, the Kubernetes shape: a NetworkPolicy names pods,
    namespaces and IP blocks, never host names) for DNS, Postgres and the model endpoints."""

    dns: tuple[dict[str, Any], ...] = DEFAULT_DNS_EGRESS
    postgres: tuple[dict[str, Any], ...] = ()
    model: tuple[dict[str, Any], ...] = ()
    mcp: tuple[dict[str, Any], ...] = ()  # the MCP servers of the chart's mcp.servers (docs/mcp.md)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> EgressPolicy | None:
        """The policy in ``AGENTFAST_NETWORK_POLICY`` (JSON ``{"dns": [...], "postgres": [...],
        "model": [...], "mcp": [...]}``, set by the chart when ``networkPolicy.enabled``), or None when unset or
        empty (no NetworkPolicy). Raises ValueError on a malformed value or no Postgres rule (every
        runner would be cut off from its store)."""
        raw = (os.environ if env is None else env).get("AGENTFAST_NETWORK_POLICY", "").strip()
        if not raw:
            return None
        try:
            doc = boundedjson.loads(raw, what="AGENTFAST_NETWORK_POLICY")
        except ValueError as err:
            raise SettingError(f"AGENTFAST_NETWORK_POLICY is not JSON: {err}") from None
        if not isinstance(doc, dict) or set(doc) - {"dns", "postgres", "model", "mcp"}:
            raise SettingError("AGENTFAST_NETWORK_POLICY must be an object with keys dns, postgres, model, mcp")
        parts = {k: tuple(_check_rules(doc.get(k) or [], k)) for k in ("dns", "postgres", "model", "mcp")}
        if not parts["postgres"]:
            raise SettingError(
                "AGENTFAST_NETWORK_POLICY has no postgres rule: runners could not reach their store (networkPolicy.postgresEgress)"
            )
        return cls(dns=parts["dns"] or DEFAULT_DNS_EGRESS, postgres=parts["postgres"], model=parts["model"], mcp=parts["mcp"])


def _check_rules(rules: Any, where: str) -> list[dict[str, Any]]:
    """``rules`` if it is a list of egress rules with only the keys a NetworkPolicy knows (the API
    server checks the rest); raises ValueError naming ``where`` otherwise."""
    if not isinstance(rules, list):
        raise SettingError(f"AGENTFAST_NETWORK_POLICY.{where}: expected a list of egress rules")
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or set(rule) - _RULE_KEYS:
            raise SettingError(f"AGENTFAST_NETWORK_POLICY.{where}[{i}]: an egress rule has only 'to' and 'ports'")
        for peer in rule.get("to") or []:
            if not isinstance(peer, dict) or not peer or set(peer) - _PEER_KEYS:
                raise SettingError(
                    f"AGENTFAST_NETWORK_POLICY.{where}[{i}].to: a peer has ipBlock, namespaceSelector or podSelector"
                )
        for port in rule.get("ports") or []:
            if not isinstance(port, dict) or set(port) - _PORT_KEYS:
                raise SettingError(f"AGENTFAST_NETWORK_POLICY.{where}[{i}].ports: a port has port, endPort, protocol")
    return rules


def _runner_object_meta(name: str, namespace: str) -> dict[str, Any]:
    """Metadata of the objects made for one AgentRun's runner (its pods, its NetworkPolicy): the
    base name, the run label (cut with a hash past 63 characters) and the full name in an
    annotation."""
    return {
        "name": runner_name(name),
        "namespace": namespace,
        "labels": {
            LABEL_RUN: run_label(name),
            "app.kubernetes.io/managed-by": "agentfast",
            "app.kubernetes.io/component": "runner",
        },
        "annotations": {ANNOTATION_RUN: name},
    }


def build_network_policy(body: dict[str, Any], policy: EgressPolicy) -> dict[str, Any]:
    """The NetworkPolicy of one AgentRun's runner pods (ownerReference added by kopf.adopt, like
    the pods'): it selects them by their labels, allows no ingress, and allows egress only
    by ``policy``'s rules, DNS first, then Postgres, then the model endpoints. A pod running the
    scripted model talks to it over loopback, which no NetworkPolicy filters."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _runner_object_meta(name, namespace),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_RUN: run_label(name), "app.kubernetes.io/component": "runner"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [*policy.dns, *policy.postgres, *policy.model, *policy.mcp],
        },
    }
