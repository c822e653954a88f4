"""The fault points' trigger: where tests kill the runner with a real SIGKILL.

``AGENTFAST_FAULT=<point>[:<tool>][@<n>]`` makes the process SIGKILL itself the n-th time (default
1st) it reaches ``<point>`` (for a tool point, only for calls of ``<tool>``). The points, and where
the runtime reaches them, are listed in :mod:`agentfast.runner.faults`, which loads this module
only when the variable is set at start; a process without it never imports test support.

This is the technique of dbos-transact's single-execution tests: the kill lands at an exact,
named step instead of at a random sleep.
"""

from __future__ import annotations

import os
import signal

from agentfast.runner.faults import FAULT_ENV

_counts: dict[str, int] = {}


def _parse(spec: str) -> tuple[str, int]:
    point, _, nth = spec.partition("@")
    return point, int(nth) if nth else 1


def point(name: str, tool: str | None = None) -> None:
    """Reach fault point ``name`` (of a call of ``tool``, for a tool point); SIGKILL this process
    if ``AGENTFAST_FAULT`` selects it, this many times reached. Raises ValueError when the
    variable's ``@n`` is not a number."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, nth = _parse(spec)
    here = f"{name}:{tool}" if tool else name
    if want not in (here, name if ":" not in want else None):
        return
    _counts[want] = _counts.get(want, 0) + 1
    if _counts[want] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
