"""The operator's notifications (issue 18 item 4; the sender is ``runner/notify.py``, shared with
the local CLI): :func:`start` at startup, :func:`offer` from ``publish_status``. The admin's
settings come from the operator's environment (the chart's ``notifications.webhook``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentfast.runner.notify import EVENT_REASON_FAILED, Notifier, WebhookConfig
from agentfast.runner.snapshot import PendingToolCall

__all__ = ["EVENT_REASON_FAILED", "offer", "start"]

log = logging.getLogger("agentfast.notify")

_ACTIVE: list[Notifier] = []


def start(dsn: str, stop: threading.Event, warn: Callable[[dict[str, str], str], None] | None = None) -> Notifier | None:
    """Start notifying when the environment configures a webhook (:meth:`WebhookConfig.from_env`);
    returns the running Notifier (a daemon thread until ``stop``), or None when notifications are
    off. ``warn(run, message)``: called once per notification given up. Raises
    NotificationConfigError for malformed settings."""
    config = WebhookConfig.from_env()
    _ACTIVE.clear()
    if config is None:
        return None
    notifier = Notifier(dsn, config, warn=warn)
    notifier.start(stop)
    _ACTIVE.append(notifier)
    log.info("notifications on: %s format, arguments %s", config.format, "included" if config.include_arguments else "left out")
    return notifier


def offer(body: Mapping[str, Any], pending: PendingToolCall | None, listed: Sequence[Mapping[str, Any]]) -> None:
    """:meth:`Notifier.offer` on the running notifier (``body``: the AgentRun; ``listed``: the new
    ``status.pendingApprovals``); nothing when notifications are off. Never blocks on the network."""
    for notifier in _ACTIVE:
        notifier.offer(body, pending, listed)
