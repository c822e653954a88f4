"""Adapters: each drives one agent framework under the runtime's guarantees, through the core's
public adapter contract (:class:`~agentfast.runner.loop.RunnerBase`) and nothing else of it.

:data:`ADAPTERS` maps a ``spec.adapter`` value to its adapter class, named rather than imported:
:func:`adapter_class` imports only the one a run asks for (LangGraph is an optional extra, and a
heavy import). The CLI, the composition root, is the only caller; the core never imports this
package (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..loop import RunnerBase

#: ``spec.adapter`` -> ``module:class`` of its adapter, the module relative to this package.
ADAPTERS: dict[str, str] = {
    "vanilla": "vanilla:VanillaRunner",
    "langgraph": "langgraph:LangGraphRunner",
}


def adapter_class(name: str) -> type[RunnerBase]:
    """The adapter class for ``spec.adapter`` = ``name``, its module imported now.

    Raises KeyError for a name no adapter has (``spec.py`` admits only the keys of
    :data:`ADAPTERS`), ImportError when the adapter's extra is not installed."""
    module, _, attr = ADAPTERS[name].partition(":")
    cls: type[RunnerBase] = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    return cls
