"""agentfast's durable runtime: snapshot model, Postgres store, journal, loop, adapters, CLI.

Start with ``docs/architecture.md``. The runner never imports the operator.

The public API is what ``__all__`` names, importable from here::

    from agentfast.runner import tool, ToolContext, Recovery, AgentRun, load_agentrun

Each name is imported from its home module on first use (PEP 562 ``__getattr__``), so importing
this package costs nothing: the CLI's commands import only what they use
(tests/test_cli_imports.py), and ``GraphRuntime`` imports LangGraph (an optional extra) only when
asked for. Everything else is internal and may change; ``tests/test_public_api.py`` pins this list.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module (relative to this package) that defines it.
_HOMES: dict[str, str] = {
    # Writing tools (docs/tools.md)
    "tool": "tools",
    "ToolContext": "tools",
    "Recovery": "tools",
    # Writing a LangGraph graph for the adapter (needs the langgraph extra)
    "GraphRuntime": "adapters.langgraph",
    # The AgentRun and ModelConfig documents
    "AgentRun": "spec",
    "ModelConfig": "spec",
    "load_agentrun": "spec",
    "parse_agentrun": "spec",
    # The snapshot (the seed's names) and what it holds
    "StateSnapshot": "snapshot",
    "RunContext": "snapshot",
    "PendingToolCall": "snapshot",
    "Message": "snapshot",
    "ToolCall": "snapshot",
    "ToolResult": "snapshot",
    # Reading runs from Postgres
    "Store": "store",
    # Shared names and the errors
    "Phase": "names",
    "ExitCode": "names",
    "AgentfastError": "errors",
    "SpecError": "errors",
}

#: A literal list, so that static tools (ruff, mypy, an IDE) read it; the same names as _HOMES.
__all__ = [
    "AgentRun",
    "AgentfastError",
    "ExitCode",
    "GraphRuntime",
    "Message",
    "ModelConfig",
    "PendingToolCall",
    "Phase",
    "Recovery",
    "RunContext",
    "SpecError",
    "StateSnapshot",
    "Store",
    "ToolCall",
    "ToolContext",
    "ToolResult",
    "load_agentrun",
    "parse_agentrun",
    "tool",
]

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports on first use
    from .adapters.langgraph import GraphRuntime
    from .errors import AgentfastError, SpecError
    from .names import ExitCode, Phase
    from .snapshot import Message, PendingToolCall, RunContext, StateSnapshot, ToolCall, ToolResult
    from .spec import AgentRun, ModelConfig, load_agentrun, parse_agentrun
    from .store import Store
    from .tools import Recovery, ToolContext, tool


def __getattr__(name: str) -> Any:
    """A public name, imported from its home module now (PEP 562). Raises AttributeError for any
    other name, and ImportError for ``GraphRuntime`` without the langgraph extra."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
