"""Storable text: the one place where characters Postgres cannot hold are replaced.

Text reaches the store from outside the product: a model's content, tool-call ids, names and
arguments, tool results (a tool may return what ``os.fsdecode`` or a ``surrogateescape`` decode
gave it), error messages, a user's spec and a human's reason. Two kinds of character in it can
never be stored:

- U+0000 (NUL): Postgres ``text`` rejects it, and ``jsonb`` rejects the escape ``\\u0000``;
- a lone UTF-16 surrogate (U+D800 to U+DFFF that is not half of a pair): no UTF-8 encoder takes
  it, and ``jsonb`` rejects its escape.

Each of them becomes U+FFFD (the replacement character); a surrogate *pair* that arrived as two
code points is joined into the character it encodes. Everything else is kept as it is.

:func:`storable` is applied by the store itself (``runner/store.py`` registers it as the dumper
of every ``str`` and ``jsonb`` parameter of its connections), so no write can fail on content,
whichever store method makes it; the store's write methods hand the stored form back to the
runner, so what the runner keeps in memory (and sends to the model) is what a resume will read.
The CLI's output (``runner/output.py``) applies the same replacement before printing.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

REPLACEMENT = "\ufffd"

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: A lone or paired surrogate code point in a str (what UTF-8, hence Postgres, cannot hold).
SURROGATE = re.compile("[\ud800-\udfff]")

T = TypeVar("T")


def storable_text(text: str) -> str:
    """``text`` with NUL and lone surrogates replaced by U+FFFD (surrogate pairs joined).

    Returns ``text`` itself (the same object) when there is nothing to replace.
    """
    if text.isascii():  # O(1) in CPython (a flag of the str), and no surrogate is ASCII: only NUL to look for
        return text.replace("\x00", REPLACEMENT) if "\x00" in text else text
    if not _UNSTORABLE.search(text):
        return text
    if SURROGATE.search(text):
        # UTF-16 round trip: a high+low pair becomes its character, a lone half becomes U+FFFD.
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text.replace("\x00", REPLACEMENT)


def storable(value: T) -> T:
    """``value`` with every string in it made storable (:func:`storable_text`).

    Walks dicts (keys and values), lists and tuples; other values are returned unchanged. A
    container with nothing to replace is returned as the same object (no copy).
    """
    if isinstance(value, str):
        return storable_text(value)  # type: ignore[return-value]
    if isinstance(value, dict):
        changed = False
        items = []
        for k, v in value.items():
            ck, cv = storable(k), storable(v)
            changed = changed or ck is not k or cv is not v
            items.append((ck, cv))
        return dict(items) if changed else value  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        clean = [storable(v) for v in value]
        if all(c is v for c, v in zip(clean, value)):
            return value
        return clean if isinstance(value, list) else tuple(clean)  # type: ignore[return-value]
    return value


def is_storable(value: Any) -> bool:
    """True when :func:`storable` would leave ``value`` unchanged."""
    return storable(value) is value
