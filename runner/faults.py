"""Named fault points: where tests kill the runner with a real SIGKILL.

``AGENTFAST_FAULT=<point>[:<tool>][@<n>]`` makes the process SIGKILL itself the n-th time (default
1st) it reaches ``<point>`` (for a tool point, only for calls of ``<tool>``). Unset, a point costs
one dict lookup. The points, in the order a tool call passes them:

- ``model.before_call`` / ``model.after_call``: around a model request (after it, the reply
  exists but its turn is not persisted: a resume asks the model again).
- ``tool.before_call``: intent journaled as started; the tool has not run.
- ``tool.after_call``: the tool returned (its effect happened); the result is not persisted.
- ``tool.after_persist``: the result is persisted; the iteration's checkpoint is not.
- ``checkpoint.before_commit`` / ``checkpoint.after_commit``: around each checkpoint commit.
- ``approval.waiting``: the pending call's checkpoint is committed; about to wait for a human.

This is the technique of dbos-transact's single-execution tests: the kill lands at an exact,
named step instead of at a random sleep.
"""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def _parse(spec: str) -> tuple[str, int]:
    point, _, nth = spec.partition("@")
    return point, int(nth) if nth else 1


def point(name: str, tool: str | None = None) -> None:
    """Reach fault point ``name``; SIGKILL this process if ``AGENTFAST_FAULT`` selects it."""
    spec = os.environ.get("AGENTFAST_FAULT")
    if not spec:
        return
    want, nth = _parse(spec)
    here = f"{name}:{tool}" if tool else name
    if want not in (here, name if ":" not in want else None):
        return
    _counts[want] = _counts.get(want, 0) + 1
    if _counts[want] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
