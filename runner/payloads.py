"""Large payloads: a string over a size threshold is stored once, outside the hot rows.

A tool output or a model message of megabytes would otherwise be written into the journal row
(``agentfast_tool_calls.result``), again into the transcript row (``agentfast_messages``), into
a pending call's sibling results and into LangGraph's ``sdk_state`` at every checkpoint, and
parsed as ``jsonb`` each time. Instead every string leaf of a stored JSON value whose UTF-8 size
is over ``threshold_bytes`` (default 1 MiB, ``AGENTFAST_PAYLOAD_THRESHOLD_BYTES``) is replaced by
a reference string, ``@agentfast/payload:sha256:<64 hex>:<bytes>``, and its text goes once into
``agentfast_payloads`` (migration 9), keyed by (run_id, sha256 of the text): the same output in
the journal, the transcript and a checkpoint is one row. The store resolves references when it
loads rows, so the loop and the adapters only ever see the values themselves.

A string that merely *looks* like a reference (any string starting with :data:`PREFIX`, of any
size) is stored out of line as well, so every reference found in a row is one the store wrote:
text a tool or a model produced never turns into something else on load.

A string over ``max_bytes`` (default 64 MiB, ``AGENTFAST_PAYLOAD_MAX_BYTES``) is refused with
:class:`PayloadTooLarge`, as is any value Postgres itself cannot store (an error of SQLSTATE
class 54, program_limit_exceeded, mapped by the store): permanent, never retried; the runner ends
the run ``Failed`` with a reason naming the value and its size (exit 1).

Payload rows are deleted with the run (``ON DELETE CASCADE``), renamed with it when it is
archived (``ON UPDATE CASCADE``), fenced like every run table (G6), and reached by a runner's
role only for its own namespace (row-level security, G11). They are not pruned with superseded
checkpoints: the transcript and the journal, which refer to most of them, are never pruned.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from . import boundedjson
from .errors import AgentfastError, SettingError
from .storable import storable_text

#: Every reference starts with this; so does every string the store keeps out of line for it.
PREFIX = "@agentfast/payload:"
_REF = re.compile(r"@agentfast/payload:sha256:([0-9a-f]{64}):([0-9]+)\Z")

DEFAULT_THRESHOLD_BYTES = 1 << 20  # 1 MiB
DEFAULT_MAX_BYTES = 64 << 20  # 64 MiB
THRESHOLD_ENV = "AGENTFAST_PAYLOAD_THRESHOLD_BYTES"
MAX_ENV = "AGENTFAST_PAYLOAD_MAX_BYTES"


class PayloadTooLarge(AgentfastError):
    """A value the store will not or cannot keep: a string over ``max_bytes``, or one Postgres
    refused with a program-limit error (SQLSTATE class 54). Permanent: retrying changes nothing.

    ``what``: which value (e.g. ``the result of call-2-0 (fetch)``); ``size``: its size in bytes
    (None: unknown, a Postgres refusal of a statement); ``limit``: the ceiling in bytes (None for
    a Postgres refusal); ``detail``: Postgres's first line, if it refused. ``str()`` is one line.
    """

    def __init__(self, what: str, size: int | None, limit: int | None, detail: str = ""):
        self.what, self.size, self.limit, self.detail = what, size, limit, detail
        super().__init__(self._text())

    def _text(self) -> str:
        size = f" of {human_bytes(self.size)}" if self.size is not None else ""
        if self.limit is not None:
            why = f"over the limit of {human_bytes(self.limit)} ({MAX_ENV}, the chart's runner.payloadMaxBytes)"
        else:
            why = f"Postgres cannot store it ({self.detail})" if self.detail else "Postgres cannot store it"
        return f"{self.what}{size} cannot be stored: {why}"

    def about(self, what: str, size: int | None = None) -> PayloadTooLarge:
        """The same refusal naming ``what`` (and ``size`` in bytes, when this one knew none)."""
        return PayloadTooLarge(what, self.size if self.size is not None else size, self.limit, self.detail)


def human_bytes(n: int) -> str:
    """``n`` bytes for a message: ``2.0 MiB (2097152 bytes)``, or ``512 bytes``."""
    if n < 1024:
        return f"{n} bytes"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit} ({n} bytes)"
    return f"{n} bytes"  # pragma: no cover


def _env_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(f"{name}: {raw[:40]!r} is not a whole number of bytes") from None
    if value < 1:
        raise SettingError(f"{name}: {value} is not a positive number of bytes")
    return value


@dataclass(frozen=True)
class Limits:
    """``threshold_bytes``: a string whose UTF-8 size is over it is stored out of line;
    ``max_bytes``: one over it is refused (:class:`PayloadTooLarge`). Both in bytes, >= 1."""

    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.threshold_bytes < 1 or self.max_bytes < 1:
            raise ValueError("payload limits must be at least 1 byte")

    @classmethod
    def from_env(cls) -> Limits:
        """From ``AGENTFAST_PAYLOAD_THRESHOLD_BYTES`` and ``AGENTFAST_PAYLOAD_MAX_BYTES`` (unset or
        empty: the defaults, 1 MiB and 64 MiB). Raises ValueError naming a malformed variable."""
        return cls(_env_bytes(THRESHOLD_ENV, DEFAULT_THRESHOLD_BYTES), _env_bytes(MAX_ENV, DEFAULT_MAX_BYTES))


def reference(digest: str, size: int) -> str:
    """The reference string of a payload: its sha256 (hex) and UTF-8 size in bytes."""
    return f"{PREFIX}sha256:{digest}:{size}"


def parse_reference(text: str) -> tuple[str, int] | None:
    """``(sha256 hex, size in bytes)`` of a reference string, or None if ``text`` is not one."""
    m = _REF.match(text) if text.startswith(PREFIX) else None
    return (m.group(1), int(m.group(2))) if m else None


def externalize(value: Any, limits: Limits, out: dict[str, str], *, what: str) -> Any:
    """``value`` (JSON-shaped: dicts, lists, str, numbers) with every string that must be stored
    out of line replaced by its :func:`reference`; each such text (made storable) is added to
    ``out`` (sha256 hex -> text) for :func:`write`. A value with nothing to replace is returned as
    the same object. Raises :class:`PayloadTooLarge` (naming ``what``) for a string over
    ``limits.max_bytes``."""
    if isinstance(value, str):
        # A str's UTF-8 size is at most 4 bytes a character: short ones need no encoding to know.
        if len(value) * 4 <= limits.threshold_bytes and not value.startswith(PREFIX):
            return value
        text = storable_text(value)
        data = text.encode("utf-8")
        if len(data) > limits.max_bytes:
            raise PayloadTooLarge(what, len(data), limits.max_bytes)
        if len(data) <= limits.threshold_bytes and not text.startswith(PREFIX):
            return value
        digest = hashlib.sha256(data).hexdigest()
        out[digest] = text
        return reference(digest, len(data))
    if isinstance(value, dict):
        changed = {k: externalize(v, limits, out, what=what) for k, v in value.items()}
        return changed if any(changed[k] is not v for k, v in value.items()) else value
    if isinstance(value, list):
        items = [externalize(v, limits, out, what=what) for v in value]
        return items if any(a is not b for a, b in zip(items, value)) else value
    return value


def externalize_json(text: str, limits: Limits, out: dict[str, str], *, what: str) -> str:
    """:func:`externalize` for a value given as JSON text; returns JSON text. The common case
    costs one scan: text too short to hold a string over the threshold, and without
    :data:`PREFIX` in it, is returned as it is without being parsed."""
    if len(text) * 4 <= limits.threshold_bytes and PREFIX not in text:
        return text
    # Our own serialization of a row: each string in it is held to limits.max_bytes by externalize;
    # the whole is bounded in depth only (a value nested past the parser is refused, never a crash).
    value = boundedjson.loads(text, what=what, max_bytes=len(text) * 4)
    new = externalize(value, limits, out, what=what)
    return text if new is value else json.dumps(new, ensure_ascii=False, separators=(",", ":"))


def references(value: Any, out: set[str] | None = None) -> set[str]:
    """The sha256 digests of every reference in ``value`` (JSON-shaped), added to ``out``."""
    found: set[str] = set() if out is None else out
    # Iterative, exact types (what json decoding gives): every transcript row of a resume passes here.
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str:
            if v.startswith(PREFIX):
                ref = parse_reference(v)
                if ref is not None:
                    found.add(ref[0])
        elif t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
    return found


def resolve(value: Any, contents: dict[str, str]) -> Any:
    """``value`` with every reference replaced by its text from ``contents`` (sha256 hex ->
    text). Raises KeyError naming a digest that ``contents`` lacks (the store reports that as an
    unreadable row). A value without references is returned as the same object."""
    if isinstance(value, str):
        ref = parse_reference(value)
        return value if ref is None else contents[ref[0]]
    if isinstance(value, dict):
        changed = {k: resolve(v, contents) for k, v in value.items()}
        return changed if any(changed[k] is not v for k, v in value.items()) else value
    if isinstance(value, list):
        items = [resolve(v, contents) for v in value]
        return items if any(a is not b for a, b in zip(items, value)) else value
    return value


def write(conn: Any, run_id: str, texts: dict[str, str]) -> None:
    """Insert ``texts`` (sha256 hex -> text, from :func:`externalize`) as payloads of ``run_id``,
    one statement each on ``conn`` (a psycopg connection inside the caller's fenced transaction:
    the rows carry the lease's epoch). A payload already stored (same run, same digest) is kept.
    One plain text parameter per row, not an array: psycopg quotes array elements with a regular
    expression, which costs ~30 ms a MiB."""
    for digest, text in texts.items():
        conn.execute(
            """INSERT INTO agentfast_payloads (run_id, digest, size_bytes, content, epoch)
               SELECT %s, %s, octet_length(t.c), t.c, 0 FROM (SELECT %s::text AS c) t
               ON CONFLICT (run_id, digest) DO NOTHING""",
            (run_id, digest, text),
        )


def fetch(conn: Any, run_id: str, digests: set[str]) -> dict[str, str]:
    """The texts of ``digests`` stored for ``run_id`` (sha256 hex -> text; missing ones absent)."""
    if not digests:
        return {}
    rows = conn.execute(
        "SELECT digest, content FROM agentfast_payloads WHERE run_id = %s AND digest = ANY(%s)", (run_id, sorted(digests))
    ).fetchall()
    return {r["digest"] if isinstance(r, dict) else r[0]: r["content"] if isinstance(r, dict) else r[1] for r in rows}
