"""JSON from outside the product, parsed with limits: never a RecursionError, never a loop.

Every JSON text agentfast takes from a model (tool-call arguments), a tool or an MCP server (a
result), a person (a ``complete`` result, a spec) or the wire between the runner and its tool
host is parsed here, with two limits checked *before* the C parser sees it:

- **size**: at most ``max_bytes`` of UTF-8 (default :data:`MAX_BYTES`, 8 MiB);
- **depth**: at most ``max_depth`` nested arrays/objects (default :data:`MAX_DEPTH`, 64). The
  depth is measured by a linear scan of the brackets outside strings (regular expressions, no
  recursion), so a text like ``[[[[...`` 1,000 deep (2 KB of a model's output) is refused with a
  clear error instead of raising RecursionError inside ``json.loads``, which killed the tool host
  at every attempt of the same iteration (issue 30 item 4).

A value of at most 64 levels is also safe for everything downstream that walks it recursively
(``runner/storable.py``, ``runner/payloads.py``, ``json.dumps``).

A refusal raises :class:`JsonLimitExceeded`, a subclass of ``json.JSONDecodeError`` (so of
``ValueError``): every ``except json.JSONDecodeError`` / ``except ValueError`` written around a
``json.loads`` keeps catching it. A syntax error is the plain ``json.JSONDecodeError`` it was.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from .errors import AgentfastError

#: Default size limit of one JSON text: 8 MiB of UTF-8.
MAX_BYTES = 8 * 1024 * 1024
#: Default depth limit: nested arrays/objects (``[]`` is depth 1, ``[[]]`` depth 2).
MAX_DEPTH = 64

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# +1 for an opening bracket, -1 for a closing one, indexed by the byte.
_DELTA = [0] * 256
_DELTA[ord("[")] = _DELTA[ord("{")] = 1
_DELTA[ord("]")] = _DELTA[ord("}")] = -1


class JsonLimitExceeded(AgentfastError, json.JSONDecodeError):
    """A JSON text refused by a limit: larger than its ``max_bytes``, nested deeper than its
    ``max_depth``, or holding a number Python will not convert (over 4,300 digits).

    ``what`` names the text's source (``"tool arguments"``); ``limit`` is the kind
    (``"size"``, ``"depth"``, ``"number"``); ``str(err)`` says both and the limit in one line,
    without echoing the text. ``msg``/``pos`` as ``json.JSONDecodeError`` (pos: 0 for size)."""

    def __init__(self, what: str, limit: str, msg: str, doc: str, pos: int = 0) -> None:
        json.JSONDecodeError.__init__(self, msg, doc[: pos + 1] if pos else "", pos)
        self.what = what
        self.limit = limit

    def __str__(self) -> str:
        return f"{self.what}: {self.msg}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (JsonLimitExceeded, (self.what, self.limit, self.msg, self.doc, self.pos))


def depth(text: str) -> int:
    """The deepest nesting of arrays/objects in ``text`` (0 for a scalar, 1 for ``[]``).

    Brackets inside JSON strings do not count. Linear in ``len(text)``, no recursion. A text that
    is not JSON gets a number all the same (an unterminated string's brackets count).
    """
    if text.count("[") + text.count("{") == 0:
        return 0
    if "\\" not in text and '"' not in text:
        bare = text
    else:
        bare = _STRING.sub('""', text)
    brackets = _NOT_BRACKET.sub("", bare).encode("ascii")
    if not brackets:
        return 0
    return max(itertools.accumulate(map(_DELTA.__getitem__, brackets)))


def check(text: str | bytes, *, what: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> str:
    """``text`` as str once it passes the size and depth limits (bytes are decoded as UTF-8).

    Raises JsonLimitExceeded (``what`` names the source in its message) or, for bytes that are not
    UTF-8, ``json.JSONDecodeError``."""
    size = len(text)
    if isinstance(text, str):
        if size * 4 > max_bytes:
            size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise JsonLimitExceeded(what, "size", f"{size} bytes of JSON; the limit is {max_bytes} bytes", "")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise json.JSONDecodeError(f"not UTF-8 ({err.reason})", "", err.start) from None
    if text.count("[") + text.count("{") > max_depth:  # else it cannot be deeper
        found = depth(text)
        if found > max_depth:
            raise JsonLimitExceeded(what, "depth", f"JSON nested {found} levels deep; the limit is {max_depth}", text)
    return text


def loads(text: str | bytes, *, what: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, **kwargs: Any) -> Any:
    """``json.loads(text)`` after :func:`check`: refused when larger than ``max_bytes`` (UTF-8
    bytes) or nested deeper than ``max_depth``. ``what`` names the source in error messages
    ("tool arguments", "the model's reply"); ``kwargs`` go to ``json.loads``.

    Raises JsonLimitExceeded (a limit) or json.JSONDecodeError (not JSON); both are ValueError.
    """
    text = check(text, what=what, max_bytes=max_bytes, max_depth=max_depth)
    try:
        return json.loads(text, **kwargs)
    except RecursionError:  # not reachable after the depth check with sane limits; never let it out
        raise JsonLimitExceeded(what, "depth", "JSON nested too deep for the parser", text) from None
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # e.g. an integer over sys.get_int_max_str_digits() digits
        if type(err) is not ValueError:  # a hook's own refusal (arguments.DuplicateKey): the caller's to tell
            raise
        raise JsonLimitExceeded(what, "number", f"JSON not convertible: {err}", text) from None


def value_depth(value: Any, *, limit: int = MAX_DEPTH) -> int:
    """The nesting depth of a JSON-shaped Python value (dicts, lists, tuples; 0 for a scalar),
    measured without recursion; stops counting once past ``limit`` (returns ``limit + 1``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        d += 1
        if d > deepest:
            deepest = d
            if deepest > limit:
                return deepest
        stack.extend((c, d) for c in children)
    return deepest


def dumps(value: Any, *, what: str, max_depth: int = MAX_DEPTH, **kwargs: Any) -> str:
    """``json.dumps(value, **kwargs)`` once ``value`` is at most ``max_depth`` deep (a value a tool
    or an MCP server returned, before it becomes the text the model reads). Raises
    JsonLimitExceeded (``what`` names the value) instead of the encoder's RecursionError."""
    if value_depth(value, limit=max_depth) > max_depth:
        raise JsonLimitExceeded(what, "depth", f"a value nested deeper than {max_depth} levels; the limit is {max_depth}", "")
    try:
        return json.dumps(value, **kwargs)
    except RecursionError:  # a default= that returns deeper values: never let it out
        raise JsonLimitExceeded(what, "depth", "a value nested too deep for the encoder", "") from None
