"""MCP tools: the tools of a run's ``spec.mcpServers``, called through the official ``mcp`` SDK.

Imported only by the tool host (``runner/toolhost.py``), never by the runner or the CLI: the
host connects to each server, lists its tools and turns each into a :class:`McpTool`, a
:class:`~agentfast.runner.tools.Tool` like any other. So an MCP call goes through the same
journal as a Python tool (``runner/journal.py``: intent before the call, result after; G3, G4),
with the same gates (G5, G10), in a process without the runner's credentials (G11).

**The idempotency key** travels in the request's ``_meta`` (MCP's place for metadata a client
attaches to a request), under reverse-DNS keys of agentfast's domain (``agentfast.dev``, so
``dev.agentfast/``, as MCP's rules for ``_meta`` keys ask): :data:`META_IDEMPOTENCY_KEY` (unique to
the call, stable across resumes), :data:`META_CALL_ID`, :data:`META_RUN_ID` and
:data:`META_EPOCH` (the fencing epoch). A server that changes anything should deduplicate on the
key, as a Python tool does with ``ctx.idempotency_key``.

**Defaults from annotations** (:func:`declarations`; annotations are hints of the server's):
``readOnlyHint`` or ``idempotentHint`` true: idempotent (an interrupted call re-runs with its
key); otherwise not (an interrupted call goes to a human). ``destructiveHint`` true, which MCP
takes as the default for a tool that is not read-only: every call waits for a human. The spec's
``spec.mcpServers[i].tools.NAME`` may add a gate, lift a gate a hint gave, or declare a tool not
idempotent; never declare idempotent a tool the server does not mark so.

**Failures**: a result with ``isError`` is the tool's error (the model reads it, as when a
Python tool raised: :class:`McpToolError`). A call whose answer never came (the connection
broke, the server died, the call timed out) may or may not have taken effect:
:class:`McpUnavailable`, never recorded as a result; the runner exits 75 and the resume settles
the call (G4). A server that cannot be reached at start is retried for
``AGENTFAST_MCP_CONNECT_SECONDS`` (default 30), then the runner exits 75 too: nothing ran, the
run is kept for a resume.

The SDK is asynchronous and the host is threaded: one asyncio loop runs in a thread of its own
(:class:`McpConnections`); each server's connection lives in one task of it, and calls are
submitted with ``asyncio.run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import boundedjson
from .errors import AgentfastError, CallOutcomeUnknown, SpecError
from .launch import env_refusal, env_value_refusal
from .spec import (
    AgentRun,
    McpServerSpec,
    allowed_modules_from_env,
    mcp_commands_from_env,
    mcp_env_from_env,
    mcp_policy_problems,
    mcp_servers_from_env,
)
from .tools import Tool, ToolArgumentsError, ToolContext, parse_arguments_object

if TYPE_CHECKING:
    from mcp.client import Client
    from mcp_types import CallToolResult
    from mcp_types import Tool as McpToolInfo

log = logging.getLogger("agentfast.mcp")

META_IDEMPOTENCY_KEY = "dev.agentfast/idempotency-key"
META_CALL_ID = "dev.agentfast/call-id"
META_RUN_ID = "dev.agentfast/run-id"
META_EPOCH = "dev.agentfast/epoch"
#: Seconds the host keeps trying to reach the run's MCP servers at start before the runner exits 75.
CONNECT_SECONDS_ENV = "AGENTFAST_MCP_CONNECT_SECONDS"
DEFAULT_CONNECT_S = 30.0
#: Seconds one MCP tool call may take; past it the call's outcome is unknown (exit 75, G4 settles it).
CALL_SECONDS_ENV = "AGENTFAST_MCP_CALL_SECONDS"
DEFAULT_CALL_S = 600.0
#: A tool name as the model sees it (OpenAI's function-name rule).
MODEL_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class McpUnavailable(CallOutcomeUnknown):
    """An MCP server could not be reached at start, or a call's answer never came (the connection
    broke, the server died, the call timed out): its effect may or may not have happened. Never
    recorded as a call's result: the runner exits 75 and the resume settles the call (G4)."""


class McpToolError(AgentfastError):
    """An MCP tool answered with ``isError``: its text is what the model reads (like a Python
    tool that raised)."""


def declarations(annotations: Any) -> tuple[bool, bool]:
    """``(idempotent, requires_approval)`` from an MCP tool's annotations (a ``ToolAnnotations``
    or None), by MCP's defaults: ``readOnlyHint`` false, ``destructiveHint`` true,
    ``idempotentHint`` false. Idempotent when read-only or ``idempotentHint``; gated when not
    read-only and ``destructiveHint`` is not false."""
    read_only = bool(getattr(annotations, "read_only_hint", None))
    idempotent_hint = bool(getattr(annotations, "idempotent_hint", None))
    destructive = getattr(annotations, "destructive_hint", None)
    idempotent = read_only or idempotent_hint
    gated = not read_only and destructive is not False
    return idempotent, gated


def model_tool_name(server: str, tool: str) -> str:
    """The name the model sees for ``tool`` of ``server``: ``SERVER_TOOL``, each character outside
    ``[a-zA-Z0-9_-]`` made ``_``. Raises SpecError when it is longer than 64 characters."""
    name = f"{server}_{re.sub(r'[^a-zA-Z0-9_-]', '_', tool)}"
    if not MODEL_TOOL_NAME.match(name):
        raise SpecError(
            f"spec.mcpServers: tool {tool[:80]!r} of MCP server {server!r} would be named {name[:80]!r}, longer than"
            " the 64 characters a model's tool name may have; give the server a shorter name"
        )
    return name


def render(result: CallToolResult) -> str:
    """A CallToolResult as the text the model reads: its text contents joined by newlines (other
    content named by type), or, with no text, its ``structuredContent`` as JSON."""
    parts: list[str] = []
    for item in result.content:
        kind = getattr(item, "type", "?")
        if kind == "text":
            parts.append(item.text)  # type: ignore[union-attr]
        elif kind == "resource_link":
            parts.append(f"[resource {getattr(item, 'uri', '')}]")
        else:
            parts.append(
                f"[{kind} content, {getattr(item, 'mime_type', None) or getattr(item, 'mimeType', '') or 'unknown type'}]"
            )
    if not any(p for p in parts) and result.structured_content is not None:
        return boundedjson.dumps(
            result.structured_content, what="the MCP server's structured result", sort_keys=True, default=str
        )
    return "\n".join(parts)


def _ignore(ctx: ToolContext, **arguments: Any) -> None:  # pragma: no cover - McpTool.invoke replaces it
    raise NotImplementedError


@dataclass
class McpTool(Tool):
    """One tool of an MCP server, as the runtime calls it: ``name`` is what the model sees
    (``SERVER_TOOL``), ``remote`` the server's own name, ``input_schema`` its JSON schema (the
    model's ``parameters``; the arguments are checked against it before a call is journaled)."""

    server: str = ""
    remote: str = ""
    input_schema: dict[str, Any] = field(default_factory=dict)
    connections: McpConnections | None = field(default=None, repr=False)
    _validator: Any = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        from jsonschema import Draft202012Validator, validators  # type: ignore[import-untyped]  # no stubs; a dependency of mcp

        schema = self.input_schema or {"type": "object"}
        cls = validators.validator_for(schema, default=Draft202012Validator)
        try:
            cls.check_schema(schema)
        except Exception as err:  # the server's schema is not one: it can never be called correctly
            raise SpecError(
                f"spec.mcpServers: tool {self.remote!r} of MCP server {self.server!r} has an invalid inputSchema: {err}"
            ) from None
        self._validator = cls(schema)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry, the server's input schema as ``parameters``."""
        params = dict(self.input_schema or {"type": "object", "properties": {}})
        params.pop("title", None)
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": params}}

    def parse_arguments(self, raw: str) -> dict[str, Any]:
        """The model's raw JSON arguments, parsed and checked against the input schema (NUL and lone
        surrogates made U+FFFD, as for a Python tool). Raises ToolArgumentsError."""
        data = parse_arguments_object(raw)
        problems = sorted(self._validator.iter_errors(data), key=lambda e: list(e.path))
        if problems:
            shown = "; ".join(f"{'.'.join(map(str, e.path)) or '(arguments)'}: {e.message}" for e in problems[:5])
            raise ToolArgumentsError(f"arguments do not match {self.name}'s parameters: {shown}")
        return data

    def invoke(self, ctx: ToolContext, arguments: dict[str, Any]) -> str:
        """Call the tool on its server with the idempotency key in ``_meta``; returns the text the
        model reads. Raises McpToolError (``isError``), McpUnavailable (no answer)."""
        assert self.connections is not None
        meta = {
            META_IDEMPOTENCY_KEY: ctx.idempotency_key,
            META_CALL_ID: ctx.call_id,
            META_RUN_ID: ctx.run_id,
            META_EPOCH: ctx.epoch,
        }
        result = self.connections.call(self.server, self.remote, arguments, meta)
        text = render(result)
        if result.is_error:
            raise McpToolError(text or f"{self.remote} answered isError without a text")
        return text


@dataclass(frozen=True)
class _Target:
    """Where one server is: a stdio command (argv, extra env) or a streamable HTTP URL."""

    name: str
    argv: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str | None = None

    def describe(self) -> str:
        return f"MCP server {self.name!r} ({self.url or ' '.join(self.argv)[:200]})"


def resolve_target(i: int, spec: McpServerSpec, servers: dict[str, str]) -> _Target:
    """Where ``spec.mcpServers[i]`` is: its command, its url, or its serverRef looked up in
    ``servers`` (``AGENTFAST_MCP_SERVERS``). Raises SpecError for an unknown serverRef."""
    if spec.command is not None:
        # Where the server's environment is made: the built-in refusals once more (runner/launch.py),
        # whatever path the spec took here.
        for name, value in spec.env.items():
            why = env_refusal(name) or env_value_refusal(value)
            if why is not None:
                raise SpecError(f"spec.mcpServers[{i}].env.{name[:64]}: {why}")
        return _Target(spec.name, argv=tuple(spec.command), env=tuple(sorted(spec.env.items())))
    if spec.url is not None:
        return _Target(spec.name, url=spec.url)
    assert spec.serverRef is not None
    url = servers.get(spec.serverRef)
    if url is None:
        raise SpecError(
            f"spec.mcpServers[{i}].serverRef: {spec.serverRef!r} names no MCP server here (AGENTFAST_MCP_SERVERS:"
            f" {', '.join(sorted(servers)) or 'unset'})"
        )
    return _Target(spec.name, url=url)


class McpConnections:
    """The host's connections to a run's MCP servers: one asyncio loop in a thread of its own,
    one task per server holding its SDK ``Client`` open. Thread-safe: :meth:`call` from any thread."""

    def __init__(self, *, call_timeout_s: float = DEFAULT_CALL_S):
        self.call_timeout_s = call_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-loop", daemon=True)
        self._thread.start()
        self._stop = concurrent.futures.Future[None]()
        self._clients: dict[str, Client] = {}
        self._holders: list[tuple[concurrent.futures.Future[None], threading.Event]] = []

    def connect(self, target: _Target, *, deadline: float, where: str = "spec.mcpServers") -> list[McpToolInfo]:
        """Open ``target``'s connection and list its tools (every page), retrying until
        ``deadline`` (time.monotonic()). Raises McpUnavailable when it could not (in time), and,
        for a stdio server, SpecError naming ``where`` when its program failed before the
        handshake (it does not exist, or it exited: a program of the runner image that fails at
        start fails the same way at every resume, so the run ends InvalidSpec instead of retrying)."""
        delay, last = 0.2, "it did not finish the handshake"
        while True:
            ready: concurrent.futures.Future[list[McpToolInfo]] = concurrent.futures.Future()
            ended = threading.Event()  # set when the attempt's task has closed its connection (a stdio server stopped)
            holder = asyncio.run_coroutine_threadsafe(self._hold(target, ready, ended), self._loop)
            try:
                tools = ready.result(timeout=max(0.1, deadline - time.monotonic()))
                self._holders.append((holder, ended))
                return tools
            except concurrent.futures.TimeoutError:
                holder.cancel()
                ended.wait(10)  # the SDK stops a stdio server it started (stdin closed, then TERM, then KILL)
                raise McpUnavailable(f"{target.describe()} cannot be reached in time: {last}") from None
            except Exception as err:
                last = _reason(err)
                holder.cancel()
                ended.wait(10)
                if target.url is None:
                    raise SpecError(f"{where}.command: {target.describe()} did not start: {last}") from None
            if time.monotonic() + delay >= deadline:
                raise McpUnavailable(f"{target.describe()} cannot be reached: {last}")
            log.warning("%s cannot be reached (%s); trying again in %.1f s", target.describe(), last, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _hold(self, target: _Target, ready: concurrent.futures.Future[list[McpToolInfo]], ended: threading.Event) -> None:
        from mcp.client import Client
        from mcp.client.stdio import StdioServerParameters

        server: Any
        if target.url is not None:
            server = target.url
        else:
            server = StdioServerParameters(
                command=target.argv[0], args=list(target.argv[1:]), env={**os.environ, **dict(target.env)}
            )
        try:
            async with Client(server, cache=None, read_timeout_seconds=self.call_timeout_s) as client:
                tools: list[McpToolInfo] = []
                cursor: str | None = None
                for _ in range(100):
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                self._clients[target.name] = client
                ready.set_result(tools)
                await asyncio.wrap_future(self._stop)
        except BaseException as err:
            if not ready.done():
                ready.set_exception(err if isinstance(err, Exception) else McpUnavailable(f"{target.describe()}: {err!r}"))
            else:
                log.warning("%s: connection ended: %s", target.describe(), _reason(err))
            if not isinstance(err, Exception):
                raise
        finally:
            self._clients.pop(target.name, None)
            ended.set()

    def call(self, server: str, tool: str, arguments: dict[str, Any], meta: dict[str, Any]) -> CallToolResult:
        """``tools/call`` of ``tool`` on ``server`` with ``meta`` as the request's ``_meta``.
        Raises McpUnavailable when no answer came (the outcome is unknown), McpToolError when the
        server answered with a JSON-RPC error (it refused the request) or with a result the SDK
        refuses (not MCP's shape, or not matching the tool's outputSchema)."""
        from mcp.shared.exceptions import MCPError
        from mcp_types.jsonrpc import CONNECTION_CLOSED, REQUEST_TIMEOUT
        from pydantic import ValidationError

        client = self._clients.get(server)
        if client is None:
            raise McpUnavailable(f"the connection to MCP server {server!r} is gone")
        future = asyncio.run_coroutine_threadsafe(client.call_tool(tool, arguments, meta=meta), self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout=self.call_timeout_s + 5)
        except MCPError as err:
            if err.error.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
                raise McpUnavailable(f"MCP server {server!r}: no answer to {tool}: {err.error.message}") from None
            raise McpToolError(f"MCP server {server!r} refused the call: {err.error.message} (code {err.error.code})") from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise McpUnavailable(f"MCP server {server!r}: no answer to {tool} in {self.call_timeout_s:.0f} s") from None
        except McpToolError:
            raise
        except (ValidationError, RuntimeError) as err:
            # An answer came, but the SDK refused it (a result not of MCP's shape, structured content
            # not matching the tool's outputSchema): a definitive outcome, never a reason to re-run.
            raise McpToolError(f"MCP server {server!r} answered {tool} with a result that is not valid: {_reason(err)}") from None
        except Exception as err:  # transport errors: the request may have reached the server
            raise McpUnavailable(
                f"MCP server {server!r}: the call of {tool} got no answer: {type(err).__name__}: {_reason(err)}"
            ) from None

    def close(self) -> None:
        """Close every connection (a stdio server gets end of input) and stop the loop; at most ~5 s."""
        if not self._stop.done():
            self._stop.set_result(None)
        for _, ended in self._holders:
            ended.wait(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _reason(err: BaseException) -> str:
    """A short reason for ``err``; an exception group's first leaf (anyio raises them)."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return f"{type(err).__name__}: {err}"[:300]


def mcp_tools(run: AgentRun, taken: set[str], *, env: dict[str, str] | None = None) -> tuple[list[Tool], McpConnections | None]:
    """Connect to every server of ``run.spec.mcpServers`` and make its tools. ``taken``: the names
    of the run's other tools (``spec.tools``), which an MCP tool's name may not repeat.

    Returns ``(tools, connections)`` (connections None for a run without MCP servers; close it at
    the end). Raises SpecError naming the field (an unknown serverRef, a name collision, an
    override of a tool the server does not have or that declares idempotent a tool the server does
    not mark so), McpUnavailable (a server not reached within ``AGENTFAST_MCP_CONNECT_SECONDS``).
    """
    if not run.spec.mcpServers:
        return [], None
    e = dict(os.environ if env is None else env)
    servers = mcp_servers_from_env(e)
    if allowed_modules_from_env(e) is not None:
        # An admin's policy applies (every runner pod): checked once more where the programs start,
        # whoever called (the runner checked it before telling this host what to start).
        problems = mcp_policy_problems(run, servers, mcp_commands_from_env(e), mcp_env_from_env(e))
        if problems:
            raise SpecError("\n".join(problems))
    targets = [resolve_target(i, m, servers) for i, m in enumerate(run.spec.mcpServers)]
    connections = McpConnections(call_timeout_s=_seconds(e, CALL_SECONDS_ENV, DEFAULT_CALL_S))
    try:
        deadline = time.monotonic() + _seconds(e, CONNECT_SECONDS_ENV, DEFAULT_CONNECT_S)
        tools: list[Tool] = []
        names = set(taken)
        for i, (spec, target) in enumerate(zip(run.spec.mcpServers, targets)):
            listed = connections.connect(target, deadline=deadline, where=f"spec.mcpServers[{i}]")
            by_name = {t.name: t for t in listed}
            unknown = sorted(set(spec.tools) - set(by_name))
            if unknown:
                raise SpecError(
                    f"spec.mcpServers[{i}].tools: MCP server {spec.name!r} has no tool {unknown[0]!r} (it has:"
                    f" {', '.join(sorted(by_name))[:400] or 'none'})"
                )
            for info in listed:
                tools.append(_make_tool(i, spec, info, names, connections))
        return tools, connections
    except BaseException:
        connections.close()
        raise


def _make_tool(i: int, spec: McpServerSpec, info: McpToolInfo, names: set[str], connections: McpConnections) -> McpTool:
    name = model_tool_name(spec.name, info.name)
    if name in names:
        raise SpecError(
            f"spec.mcpServers[{i}]: tool {info.name!r} of MCP server {spec.name!r} would be named {name!r}, which another"
            " tool of the run already has; rename the server or the spec.tools entry"
        )
    names.add(name)
    idempotent, gated = declarations(info.annotations)
    override = spec.tools.get(info.name)
    if override is not None and override.idempotent is True and not idempotent:
        raise SpecError(
            f"spec.mcpServers[{i}].tools.{info.name}.idempotent: MCP server {spec.name!r} does not mark {info.name!r}"
            " read-only or idempotent (re-running it may repeat its effect); a spec cannot declare it safe to re-run:"
            " drop idempotent or set it to false"
        )
    if override is not None and override.idempotent is not None:
        idempotent = override.idempotent
    if override is not None and override.requiresApproval is not None:
        gated = override.requiresApproval
    return McpTool(
        name=name,
        fn=_ignore,
        description=(info.description or info.title or info.name)[:4096],
        idempotent=idempotent,
        requires_approval=gated,
        server=spec.name,
        remote=info.name,
        input_schema=dict(info.input_schema or {}),
        connections=connections,
    )


def _seconds(env: dict[str, str], name: str, default: float) -> float:
    try:
        value = float(env.get(name) or default)
    except ValueError:
        value = default
    return value if value > 0 else default
