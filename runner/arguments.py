"""A tool call's arguments as text: the one strict parser and the digest a decision binds to.

The model sends a call's arguments as JSON text. That exact text is what the journal stores,
what a person is shown, what the tool receives, and what :func:`arguments_digest` hashes, so a
decision stored with the digest of the text its decider saw (G13, docs/security.md) runs the
call with exactly that text or not at all.

Parsing is strict where the standard library is lenient: an object with a key twice is refused
(:class:`DuplicateKey`). ``json.loads`` keeps the last value, so ``{"amount_cents": 4999, ...,
"amount_cents": 999999}`` shows a person the first and gives a tool the second (issue 30 item 8).
"""

from __future__ import annotations

import hashlib
from typing import Any

from . import boundedjson
from .errors import AgentfastError

DIGEST_PREFIX = "sha256:"


class DuplicateKey(AgentfastError, ValueError):
    """A JSON object in the arguments names one key twice (``key``: that key)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} appears twice in one object: send each key once")
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


def loads_arguments(raw: str) -> Any:
    """``raw`` (JSON text; empty means ``{}``) parsed strictly: any object in it with a key twice
    raises DuplicateKey (a ValueError); past the size or depth limits of :mod:`.boundedjson`,
    JsonLimitExceeded; text that is not JSON, json.JSONDecodeError (both ValueError)."""
    return boundedjson.loads(raw or "{}", what="tool arguments", object_pairs_hook=_refuse_duplicates)


def arguments_digest(arguments: str) -> str:
    """The digest a decision binds to: ``sha256:`` and 64 hex digits of the arguments' exact
    text, UTF-8 encoded (lone surrogates, which storable text never holds, as ``surrogatepass``).
    Two texts that parse the same but differ in a byte (spacing, key order) differ here: a
    decision is on what was shown, not on what it means."""
    return DIGEST_PREFIX + hashlib.sha256(arguments.encode("utf-8", "surrogatepass")).hexdigest()
