"""The project's errors: one base class, and the domain errors named by what they mean.

Every exception class of agentfast derives from :class:`AgentfastError`, so a caller can tell
ours from a library's or a bug's (tests/test_names.py checks it for every module). A domain
error that replaced a builtin (``KeyError``, ``ValueError``) also derives from that builtin, so
every ``except ValueError`` / ``except KeyError`` written before it still catches it (issue 16
item 4). This module imports only the standard library: the CLI imports it for free.

Here: the errors more than one part raises or catches. Errors that belong to one component stay
beside it, with this base: the store's (``runner/store.py``: StoreError, StoreUnavailable,
LeaseLost (fenced out, G6), DecisionConflict, UnknownCall (no such call awaits a decision now,
G10), UidTaken, UnreadableState, InvalidDsn, SchemaBehind; ``runner/liveness.py``: RunnerAlive,
ClaimStopped), the model client's (``runner/model.py``: ModelError), payloads'
(``runner/payloads.py``: PayloadTooLarge), the tool host's (``runner/toolhost.py``: ToolHostLost,
ToolRaised; ``runner/tools.py``: ToolArgumentsError; ``runner/journal.py``: RunEnding), the
operator's (``operator/main.py``: ModelConfigNotFound, RunnerPodRefused).
"""

from __future__ import annotations


class AgentfastError(Exception):
    """Base class of every error agentfast raises on purpose."""


class SpecError(AgentfastError, ValueError):
    """An AgentRun (or ModelConfig) that cannot run. ``str(err)`` is one line per problem, each
    naming its field. Raised by runner/spec.py's parsers and resolve(); the operator
    shows it as ``Failed``/``InvalidSpec``, the CLI exits 2."""


class InvalidDecision(AgentfastError, ValueError):
    """A decision that cannot be recorded as given (``str(err)`` says why and what to give).
    The rules are runner/decisions.py's ``check_decision``."""


class UnknownRun(AgentfastError, KeyError):
    """No run with this id is registered in the store (``Store.acquire_lease``,
    ``Store.request_cancel``). A ``KeyError``, as the store raised before; ``args[0]`` is the
    run id."""


class SettingError(AgentfastError, ValueError):
    """An admin's setting that is not valid: an environment variable of the operator (the chart's
    values, ``AGENTFAST_RUNNER_*``, ``AGENTFAST_NETWORK_POLICY``) or of the runner
    (``AGENTFAST_PAYLOAD_*``). ``str(err)`` names the variable. Raised at start, before any work."""


class CallOutcomeUnknown(AgentfastError):
    """A tool call's answer never came (an MCP server's connection broke, the call timed out):
    its effect may or may not have happened. Never recorded as the call's result: the tool host
    answers "lost", the runner raises ToolHostLost and exits 75, and the resume settles the call
    (G4). Also raised when a run's MCP server cannot be reached at start (nothing ran)."""


#: Top-level modules that only an extra of the package installs (pyproject.toml's
#: ``[project.optional-dependencies]``) -> the extra's name.
EXTRA_OF_MODULE = {
    "langgraph": "langgraph",
    "langchain_core": "langgraph",
    "kopf": "operator",
    "kubernetes": "operator",
    "prometheus_client": "operator",
    "opentelemetry": "otel",
}


def missing_extra(err: ImportError) -> str | None:
    """One line saying which extra to install when ``err`` is a module of an extra that is not
    installed, e.g. ``the langgraph extra is not installed (no module langgraph): pip install
    'agentfast[langgraph]'``; None for any other import error (a missing module of the user's, a
    broken install)."""
    name = getattr(err, "name", None) or ""
    extra = EXTRA_OF_MODULE.get(name.partition(".")[0])
    if not isinstance(err, ModuleNotFoundError) or extra is None:
        return None
    return f"the {extra} extra is not installed (no module {name}): pip install 'agentfast[{extra}]'"
