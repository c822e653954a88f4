"""The CLI's output: text is data, and output is best effort.

Two rules, kept here so that no command has to remember them:

1. **Text is data, never markup or control.** What a model, a tool, a user, a spec or an error
   message says is printed as it is: ``[bold]``, ``[/INST]``, ``[link=...]``, ``[@click]`` and
   ``:emoji:`` codes are not interpreted (the consoles below have markup, emoji codes and
   highlighting switched off, for every ``str`` they render, however it is passed: ``print``,
   table cells, titles, rules). Characters that would control the terminal (C0 controls but
   tab and newline, DEL, C1 controls: ``ESC [2J``, ``ESC ]8;;``...) are shown as ``\\xNN``; NUL
   and lone surrogates become U+FFFD, as in the store (:mod:`.storable`). Style comes only from
   the product's own words: :func:`styled` pieces and ``Text`` objects built from them.
2. **Output is best effort.** A closed or full stdout or stderr, a terminal that went away or a
   character its encoding cannot show never raises into the caller: the write is dropped (or
   the character escaped) and the run goes on with its exit code unchanged. After a failed
   write the stream's file descriptor is pointed at ``/dev/null``, so Python's own flush at
   exit cannot fail either (a failed flush at exit would make the exit code 120).

Use :data:`out` (stdout) and :data:`err` (stderr) for everything the CLI prints; the CLI's
``main`` also installs :class:`BestEffortStream` as ``sys.stdout`` and ``sys.stderr`` (for click,
prompts, logging and tracebacks), see :func:`install`.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.style import Style
from rich.text import Text

from .storable import storable, storable_text

__all__ = [
    "BestEffortStream",
    "detached_writes",
    "err",
    "finish",
    "install",
    "json_text",
    "one_line",
    "out",
    "printable",
    "styled",
    "attached_writes",
]

#: Text queued by a detached stream beyond this (characters) is dropped, not waited for.
MAX_PENDING_CHARS = 4 * 1024 * 1024
_DETACHED = threading.Event()

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but \t and \n, DEL, C1
_JSON_UNSAFE = re.compile("[\x7f-\x9f]")  # json.dumps escapes C0 itself, not DEL and C1


def now_ms() -> int:
    """Now, in ms since the Unix epoch (the store's unit of time)."""
    return time.time_ns() // 1_000_000


def age(since_ms: int | None, now: int | None = None) -> str:
    """How long ago ``since_ms`` (ms since the Unix epoch; ``now`` default the clock's now) was,
    as ``kubectl get`` says it: ``45s``, ``12m``, ``3h``, ``2d``; ``-`` for None."""
    if since_ms is None:
        return "-"
    s = max(0, (now_ms() if now is None else now) - since_ms) // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def printable(text: Any) -> str:
    """``text`` (anything, ``str()`` of it) as a terminal shows it literally: NUL and lone
    surrogates as U+FFFD, ``\\r\\n`` as ``\\n``, other control characters as ``\\xNN``."""
    s = storable_text(text if isinstance(text, str) else str(text))
    if "\r\n" in s:
        s = s.replace("\r\n", "\n")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", s)


def one_line(text: Any, limit: int | None = None) -> str:
    """:func:`printable` for a place that holds one line: newlines shown as ``\\n``; cut to
    ``limit`` characters with ``…`` when given."""
    s = printable(text).replace("\n", "\\n")
    return s if limit is None or len(s) <= limit else s[: max(0, limit - 1)] + "…"


def styled(*parts: str | tuple[Any, str | Style]) -> Text:
    """A line built from pieces: a plain ``str`` (data) or ``(data, style)``.

    Every piece is data (:func:`printable`); only ``style`` is interpreted, so put nothing
    user-controlled in a style. Example: ``styled(("waiting", "bold yellow"), " of ", (call_id, "bold"))``.
    """
    text = Text()
    for part in parts:
        if isinstance(part, tuple):
            text.append(printable(part[0]), style=part[1])
        else:
            text.append(printable(part))
    return text


def json_text(obj: Any, *, indent: int | None = 2) -> str:
    """``obj`` as JSON text fit for a terminal and a parser: strings made storable, non-ASCII
    kept readable, DEL and C1 controls escaped (``\\u009b``) like JSON escapes C0 itself."""
    text = json.dumps(storable(obj), ensure_ascii=False, indent=indent, default=str)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class BestEffortStream(io.TextIOBase):
    """A text stream that forwards to another and never raises from ``write`` or ``flush``.

    ``target``: the stream, or a function returning the current one (e.g. ``lambda:
    sys.stdout``; None means there is none, as when Python started with the fd closed).
    A character the target's encoding cannot take is written escaped (``\\u2500``); a write
    or flush that fails with OSError (EPIPE, EIO, ENOSPC...) or ValueError (closed file) marks
    the stream broken: later writes are dropped, and the target's file descriptor is pointed
    at ``/dev/null`` so that nothing else (Python's flush at exit) fails on it. A write that
    would block on a non-blocking descriptor is dropped without breaking the stream.

    Inside :func:`detached_writes` (the CLI uses it while a runner works) a write never waits
    for the reader either: it is queued and written by a daemon thread, and dropped when more
    than :data:`MAX_PENDING_CHARS` are waiting (a pipe nobody reads, ``| less`` on a page).
    Outside it, writes wait for the queue first, so the order is kept; :func:`finish` waits for
    it at exit. A stream whose target is itself a BestEffortStream passes everything on.
    """

    def __init__(self, target: Any | Callable[[], Any]):
        super().__init__()
        self._get: Callable[[], Any] = target if callable(target) and not hasattr(target, "write") else (lambda: target)
        self.broken = False
        self.dropped = 0  # writes dropped because the detached queue was full
        self._pending: collections.deque[str] = collections.deque()
        self._pending_chars = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> Any:
        """The stream written to now (None if there is none)."""
        return self._get()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.target, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "backslashreplace"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        if self.broken:
            return False
        try:
            return bool(self.target.isatty())
        except Exception:
            return False

    def fileno(self) -> int:
        target = self.target
        if target is None:
            raise io.UnsupportedOperation("no underlying stream")
        fd: int = target.fileno()
        return fd

    def write(self, s: str) -> int:
        # click (its echo, prompt and --help) probes a stream with write(b"") and, if that
        # works, writes bytes to it: they are decoded and written, never passed to a text target
        # that refuses them, nor dropped (the approval prompt's question must reach the terminal).
        if isinstance(s, (bytes, bytearray)):
            s = bytes(s).decode(self.encoding, "replace")
        target = self.target
        if isinstance(target, BestEffortStream):
            return target.write(s)
        if self.broken or target is None or not s:
            return len(s)
        with self._cond:
            if _DETACHED.is_set():
                if self._pending_chars + len(s) > MAX_PENDING_CHARS:
                    self.dropped += 1
                else:
                    self._pending.append(s)
                    self._pending_chars += len(s)
                    self._start_writer()
                    self._cond.notify_all()
                return len(s)
            while self._pending and not self.broken:
                self._cond.wait(0.5)
        self._write_now(target, s)
        return len(s)

    def wait_drained(self, timeout: float | None = None) -> bool:
        """Block until every queued write has been written (or dropped by a broken stream), or
        ``timeout`` seconds passed (None: no limit). True when nothing is left queued."""
        target = self.target
        if isinstance(target, BestEffortStream):
            return target.wait_drained(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending and not self.broken:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _start_writer(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._drain, name="agentfast-output", daemon=True)
            self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                s = self._pending[0]
            target = self.target
            if target is not None and not self.broken:
                try:
                    self._write_now(target, s)
                    self._flush_now(target)
                except Exception:  # never let the writer die with text queued behind it
                    pass
            with self._cond:
                self._pending.popleft()
                self._pending_chars -= len(s)
                self._cond.notify_all()

    def _write_now(self, target: Any, s: str) -> None:
        if self.broken:
            return
        try:
            try:
                target.write(s)
            except UnicodeEncodeError:
                enc = getattr(target, "encoding", None) or "utf-8"
                target.write(storable_text(s).encode(enc, "backslashreplace").decode(enc, "replace"))
        except BlockingIOError:
            pass  # a non-blocking descriptor that is full: drop this write, keep the stream
        except (OSError, ValueError):
            self._break(target)

    def flush(self) -> None:
        target = self.target
        if isinstance(target, BestEffortStream):
            target.flush()
            return
        if self.broken or target is None or _DETACHED.is_set():
            return  # detached: the writer thread flushes after each write
        self.wait_drained()
        self._flush_now(target)

    def _flush_now(self, target: Any) -> None:
        if self.broken:
            return
        try:
            target.flush()
        except BlockingIOError:
            pass
        except (OSError, ValueError):
            self._break(target)

    def _break(self, target: Any) -> None:
        self.broken = True
        try:
            fd = target.fileno()
        except Exception:
            return
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)
        except OSError:
            pass


class _DataConsole(Console):
    """A rich Console for which every ``str`` is data (see the module's rule 1) and whose
    output never raises (rule 2)."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        kwargs.update(markup=False, emoji=False, highlight=False)
        return super().render_str(printable(text), **kwargs)

    def on_broken_pipe(self) -> None:
        # rich's default raises SystemExit(1): that would end a durable run. Our stream never
        # raises BrokenPipeError, so this is only a second line of defence.
        self.quiet = True

    def print_json(self, json: str | None = None, *, data: Any = None, indent: None | int | str = 2, **_ignored: Any) -> None:
        """JSON text (``json``) or an object (``data``) printed as :func:`json_text` gives it:
        parseable, no rendering, no highlighting (rich's own would pass C1 controls through)."""
        import json as _json

        obj = _json.loads(json) if json is not None else data
        self.file.write(json_text(obj, indent=indent if isinstance(indent, int) else 2) + "\n")
        self.file.flush()


def _console(name: str) -> _DataConsole:
    stream = BestEffortStream(lambda: getattr(sys, name))
    # typeshed's io.TextIOBase is no IO[str] (rich's type of file), though it is a text stream.
    return _DataConsole(file=stream, soft_wrap=True, markup=False, emoji=False, highlight=False)  # type: ignore[arg-type]


#: The CLI's consoles: stdout for results, stderr for errors and notices.
out = _console("stdout")
err = _console("stderr")


def install() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` best effort for the whole process (idempotent).

    For what does not go through :data:`out`/:data:`err`: click's messages and prompts, logging,
    a traceback. Called by the CLI's ``main``. A standard descriptor (0, 1, 2) that was closed
    when the process started is opened on ``/dev/null`` first, so that no file or socket opened
    later (a Postgres connection) takes its number and receives what is meant for the terminal.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
            except OSError:
                pass
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        if current is not None and not isinstance(current, BestEffortStream):
            setattr(sys, name, BestEffortStream(current))


@contextlib.contextmanager
def detached_writes() -> Iterator[None]:
    """While inside, no write to a BestEffortStream waits for its reader (see the class).

    The CLI drives a runner inside it: a terminal scrolled back, a pager or a pipe that nobody
    reads must not hold up a durable run. Leaving it does not wait; the next ordinary write or
    :func:`finish` does.
    """
    _DETACHED.set()
    try:
        yield
    finally:
        _DETACHED.clear()


@contextlib.contextmanager
def attached_writes() -> Iterator[None]:
    """Inside :func:`detached_writes`, write in order again for a while: each write waits for
    what is queued before it. For a prompt: its question is written through ``sys.stdout`` while
    ``input()`` writes the prompt's end to the terminal itself, so a queued question would come
    after it, or not at all. Use it only while a person is at the terminal (both ends a tty)."""
    was = _DETACHED.is_set()
    _DETACHED.clear()
    try:
        yield
    finally:
        if was:
            _DETACHED.set()


def finish() -> None:
    """Write what is queued and flush both streams, never raising (call before the process
    exits). Waits for a reader that is slow, as any program writing to it would."""
    _DETACHED.clear()
    for stream in (sys.stdout, sys.stderr, out.file, err.file):
        if stream is None:
            continue
        try:
            stream.flush()
        except Exception:
            pass
