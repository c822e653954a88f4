"""Named fault points: the places in the runtime where a test may SIGKILL the runner.

The runtime calls :func:`point` at each; it does nothing unless ``AGENTFAST_FAULT`` is set when
this module is first imported, and only then is the trigger, :mod:`agentfast.testing.faults`
(test support, left out of the production image), loaded. Its syntax is there. The points, in
the order a tool call passes them:

- ``model.before_call`` / ``model.after_call``: around a model request (after it, the reply
  exists but its turn is not persisted: a resume asks the model again).
- ``tool.before_call``: intent journaled as started; the tool has not run.
- ``tool.after_call``: the tool returned (its effect happened); the result is not persisted.
- ``tool.after_persist``: the result is persisted; the iteration's checkpoint is not.
- ``checkpoint.before_commit`` / ``checkpoint.after_commit``: around each checkpoint commit.
- ``approval.waiting``: the pending call's checkpoint is committed; about to wait for a human.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .errors import SettingError

FAULT_ENV = "AGENTFAST_FAULT"

_trigger: Callable[[str, str | None], None] | None = None


def point(name: str, tool: str | None = None) -> None:
    """Reach fault point ``name`` (of a call of ``tool``, for a tool point). Without
    ``AGENTFAST_FAULT`` this is one test of a module global."""
    if _trigger is not None:
        _trigger(name, tool)


if os.environ.get(FAULT_ENV):
    try:
        from agentfast.testing.faults import point as _trigger
    except ModuleNotFoundError as err:  # the production image: test support is not installed
        if not (err.name or "").startswith("agentfast.testing"):
            raise
        raise SettingError(
            f"{FAULT_ENV} is set, but fault points are test support (agentfast.testing) and this install"
            " leaves it out (the production image); unset it, or use the image's testing target"
        ) from None
