"""The rules of one human decision on an awaited tool call: approve, deny or complete.

Kept out of :mod:`.spec` (which re-exports them, for ``spec.approvals``) so that the store, which
enforces them on every decision, and the CLI's ``approve``/``deny``/``complete`` need not import
the spec models (issue 15: a command imports only what it uses).
"""

from __future__ import annotations

import json

from .errors import InvalidDecision as InvalidDecision  # its home is errors.py; raised and imported from here
from .storable import storable_text

REASON_MAX_CHARS = 1024
RESULT_MAX_CHARS = 4096
DECISIONS = ("approve", "deny", "complete")


def check_decision(decision: str, reason: str | None, result: str | None) -> tuple[str | None, str | None]:
    """Validate one human decision; returns ``(reason, result)`` as they are to be stored.

    ``approve``: the call runs (``reason`` an optional note). ``deny``: the call does not run and
    the model reads ``reason``, which is required (a denial without one tells the model nothing).
    ``complete``: the call's effect already happened; ``result`` (required, JSON text, kept
    verbatim) is what the model reads as the call's result. ``result`` is refused for the others.
    Limits: reason 1024 characters, result 4096. NUL and lone surrogates become U+FFFD.
    Raises InvalidDecision. The one home of these rules: the store, the CLI, ``spec.approvals``.
    """
    if decision not in DECISIONS:
        raise InvalidDecision(f"decision must be one of {', '.join(DECISIONS)}, got {decision!r}")
    if reason is not None:
        reason = storable_text(reason)
        if not reason.strip():
            reason = None
        elif len(reason) > REASON_MAX_CHARS:
            raise InvalidDecision(f"the reason is {len(reason)} characters; at most {REASON_MAX_CHARS}")
    if decision == "deny" and reason is None:
        raise InvalidDecision(
            "a denial needs a reason: the model reads it as the call's result (e.g. --reason 'customer withdrew')"
        )
    if decision == "complete":
        if result is None or not result.strip():
            raise InvalidDecision('complete needs the call\'s result as JSON text, e.g. --result \'{"voucher": "V-100"}\'')
        if len(result) > RESULT_MAX_CHARS:
            raise InvalidDecision(f"the result is {len(result)} characters; at most {RESULT_MAX_CHARS}")
        try:
            json.loads(result)
        except ValueError as err:
            raise InvalidDecision(
                f"the result must be JSON text (an object, array, string in quotes, number...): {err}"
            ) from None
        result = storable_text(result)
    elif result is not None:
        raise InvalidDecision(f"a result is given only with complete, not with {decision}")
    return reason, result
