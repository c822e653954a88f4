"""Reading YAML a user hands us (an AgentRun file, a model script): bounded before it is parsed.

Three limits, checked before anything is built from the text: the file's size (at most
``max_bytes``, default :data:`MAX_BYTES`, read with a bounded read, so ``/dev/zero`` or a FIFO
cannot fill memory; :func:`load_all` checks a text it is given too), YAML anchors and aliases,
refused outright: a 20-line "billion laughs" document of aliases expands to gigabytes when loaded,
and no AgentRun needs one (the API server's own YAML-to-JSON conversion would expand it too), and
the nesting depth of sequences and mappings (at most ``max_depth``, default :data:`MAX_DEPTH`,
64, as for JSON: ``runner/boundedjson.py``): PyYAML's composer recurses once per level, so a
document ``[[[[...`` a few thousand deep raised RecursionError instead of a clear error (issue 30
item 4). The checks walk the parser's events, which never expands an alias and never recurses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import AgentfastError

#: Default limit: 1 MiB (a Kubernetes object is capped near 1.5 MiB in etcd anyway).
MAX_BYTES = 1024 * 1024
#: Default depth limit: nested sequences/mappings (the same as JSON's, runner/boundedjson.py).
MAX_DEPTH = 64


class UnsafeYaml(AgentfastError, ValueError):
    """A file too large, unreadable, not YAML, or holding anchors/aliases. ``str(err)`` names it
    and says why in one line, without echoing its content."""


def read_text(path: str | Path, *, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``, refused when larger than ``max_bytes``. Raises UnsafeYaml."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise UnsafeYaml(f"{path}: cannot read: {err.strerror}") from None
    if len(data) > max_bytes:
        raise UnsafeYaml(f"{path}: larger than {max_bytes} bytes; refused without reading further")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnsafeYaml(f"{path}: not UTF-8 text (byte {err.start})") from None


def load_all(text: str, where: str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> list[Any]:
    """Every non-empty document of ``text`` (safe_load_all), after refusing a text over
    ``max_bytes`` (UTF-8 bytes), anchors and aliases, and sequences/mappings nested deeper than
    ``max_depth``.

    ``where`` names the source in messages. Raises UnsafeYaml (a YAML syntax error included:
    the message keeps the parser's line and column, not the text).
    """
    size = len(text.encode("utf-8", "surrogatepass")) if len(text) * 4 > max_bytes else len(text)
    if size > max_bytes:
        raise UnsafeYaml(f"{where}: {size} bytes of YAML; the limit is {max_bytes} bytes")
    try:
        level = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise UnsafeYaml(f"{where}: YAML anchors and aliases are not accepted (line {line}): write the value out")
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                level += 1
                if level > max_depth:
                    line = event.start_mark.line + 1 if event.start_mark else "?"
                    raise UnsafeYaml(
                        f"{where}: YAML nested deeper than {max_depth} levels (line {line}); the limit is {max_depth}"
                    )
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                level -= 1
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise UnsafeYaml(f"{where}: not valid YAML: {err}") from None
    except RecursionError:  # not reachable within max_depth; never let it out
        raise UnsafeYaml(f"{where}: YAML nested too deep to load") from None
