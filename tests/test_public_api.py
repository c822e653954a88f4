"""The public API: ``from agentfast.runner import ...`` gives exactly the names ``__all__`` lists, each
the object its home module defines, and importing the package imports none of them until asked.

    pytest tests/test_public_api.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import agentfast.runner as api

PUBLIC = [
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


def test_the_public_names_are_pinned() -> None:
    """A name added to or removed from the public API is a decision: change this list with it."""
    assert api.__all__ == PUBLIC
    assert sorted(api._HOMES) == PUBLIC  # each public name has its home module


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_name_is_its_home_modules_object(name: str) -> None:
    from importlib import import_module

    home = import_module(f"agentfast.runner.{api._HOMES[name]}")
    assert getattr(api, name) is getattr(home, name)
    assert name in dir(api)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        api.nope  # noqa: B018
    with pytest.raises(ImportError):
        from agentfast.runner import nope  # noqa: F401


def test_importing_the_package_imports_no_public_module_yet() -> None:
    """The CLI imports ``agentfast.runner.cli``, so this package's import is on every command's path:
    it must not pull in pydantic models, psycopg or LangGraph by itself."""
    code = "import sys, agentfast.runner; print(' '.join(sorted(m for m in sys.modules if m.startswith(('agentfast', 'pydantic', 'psycopg', 'langgraph')))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["agentfast", "agentfast.runner"]
