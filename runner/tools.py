"""Tools: how a Python function becomes something an agent can call exactly once.

A tool is a function decorated with :func:`tool`. Its first parameter receives a
:class:`ToolContext` that carries the call's **idempotency key** (G4): ``"{run_uid}:{iteration}:
{position}"``, unique to that one call and stable across resumes. A tool with a side effect must
hand that key to whatever it changes (an ``Idempotency-Key`` header, a unique column), because a
call that was in flight when a process died is run again with the same key.

Tools declare two things, both overridable per AgentRun (``spec.tools[i]``):

- ``idempotent`` (default True): re-running with the same key is safe. A non-idempotent tool found
  in flight after a crash is never re-run blindly; it goes to a human like a gated call.
- ``requires_approval`` (default False): every call waits for a human decision.

A tool may also declare a **recovery check** (``@tool(recovery_check=fn)`` or
``@my_tool.recovery_check``): given the :class:`ToolContext` of a call that was in flight when a
runner died (same idempotency key), it answers whether the call's effect happened, and with what
result (:class:`Recovery`). The runtime asks it before re-running or asking a human: happened:
the call is recorded done with that result; not happened: it runs again with the same key;
unknown (or the check raises): an idempotent tool runs again with its key, a non-idempotent one
goes to a human.

Arguments arrive as the model's JSON text and are validated against the function's signature
with pydantic; bad arguments become a tool error the model can read, never a crash.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from pydantic import BaseModel, ValidationError, create_model

from . import boundedjson
from .arguments import DuplicateKey, loads_arguments
from .errors import AgentfastError
from .spec import AgentRun, SpecError, resolve_ref
from .storable import storable


@dataclass(frozen=True)
class ToolContext:
    """What a tool learns about the call it serves.

    ``idempotency_key``: unique to this call (run uid, iteration, position), stable across resumes.
    ``epoch``: the runner's fencing epoch, for services that accept a fencing token.

    No store credential (G11): a tool that keeps records of its own names its own database, in
    its own environment (``runner/toolhost.py``: in a runner pod, the namespace's Secret
    ``agentfast-tools``), as the bundled examples do (``runner/examples/__init__.py``).
    """

    run_id: str
    run_uid: str
    call_id: str
    iteration: int
    position: int
    idempotency_key: str
    epoch: int


@dataclass(frozen=True)
class Recovery:
    """What a recovery check found about an interrupted call's effect.

    Build it with :meth:`happened` (``result`` is what the tool would have returned: a dict is
    JSON-encoded, a str kept), :meth:`not_happened` (safe to run again with the same key) or
    :meth:`unknown` (ask a human if the tool is not idempotent).
    """

    status: Literal["happened", "not_happened", "unknown"]
    result: Any = None

    @classmethod
    def happened(cls, result: Any) -> Recovery:
        return cls("happened", result)

    @classmethod
    def not_happened(cls) -> Recovery:
        return cls("not_happened")

    @classmethod
    def unknown(cls) -> Recovery:
        return cls("unknown")


def render_result(out: Any) -> str:
    """A tool's return value as the text the model reads: a str as is, anything else as JSON."""
    if isinstance(out, str):
        return out
    return boundedjson.dumps(out, what="the tool's result", sort_keys=True, default=str)


class ToolArgumentsError(AgentfastError, ValueError):
    """The model's arguments could not be parsed or did not match the tool's signature."""


def parse_arguments_object(raw: str) -> dict[str, Any]:
    """The model's raw JSON arguments as a dict (empty text: ``{}``), made storable (NUL and lone
    surrogates become U+FFFD). Raises ToolArgumentsError when they are not a JSON object, or
    name a key twice in one object (:mod:`.arguments`: strict, so what a person approves is what
    the tool gets). The
    first step of every tool's argument check (Python tools, MCP tools)."""
    try:
        data = storable(loads_arguments(raw))
    except boundedjson.JsonLimitExceeded as err:  # too deep or too large: the model is told, the call never runs
        raise ToolArgumentsError(f"arguments refused: {err}") from None
    except json.JSONDecodeError as err:
        raise ToolArgumentsError(f"arguments are not valid JSON ({err.msg} at char {err.pos}): {raw[:200]!r}") from None
    except DuplicateKey as err:
        raise ToolArgumentsError(f"arguments refused: {err}") from None
    if not isinstance(data, dict):
        raise ToolArgumentsError(f"arguments must be a JSON object, got {type(data).__name__}")
    return data


@dataclass
class Tool:
    """A callable tool with its JSON schema and durability declarations."""

    name: str
    fn: Callable[..., Any]
    description: str
    idempotent: bool = True
    requires_approval: bool = False
    recovery: Callable[[ToolContext], Recovery] | None = field(default=None, repr=False)
    _args_model: type[BaseModel] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        params = list(inspect.signature(self.fn).parameters.values())
        if not params or params[0].name != "ctx":
            raise TypeError(f"tool {self.name}: the first parameter must be `ctx: ToolContext`")
        fields: dict[str, Any] = {}
        for p in params[1:]:
            annotation = p.annotation if p.annotation is not inspect.Parameter.empty else Any
            default = p.default if p.default is not inspect.Parameter.empty else ...
            fields[p.name] = (annotation, default)
        self._args_model = create_model(f"{self.name}_args", __config__={"extra": "forbid"}, **fields)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry: ``{"type": "function", "function": {name, description, parameters}}``."""
        params = self._args_model.model_json_schema()
        params.pop("title", None)
        for prop in params.get("properties", {}).values():
            prop.pop("title", None)
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": params}}

    def parse_arguments(self, raw: str) -> dict[str, Any]:
        """Parse and validate the model's raw JSON arguments. Raises ToolArgumentsError.

        The parsed values are made storable (:func:`agentfast.runner.storable.storable`): a JSON
        escape of NUL or of a lone surrogate (``\\u0000``, ``\\udcff``) reaches the tool as
        U+FFFD, so a tool never receives text the store could not hold.
        """
        data = parse_arguments_object(raw)
        try:
            return self._args_model.model_validate(data).model_dump()
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ToolArgumentsError(f"arguments do not match {self.name}'s parameters: {problems}") from None

    def invoke(self, ctx: ToolContext, arguments: dict[str, Any]) -> str:
        """Run the tool; returns its result as text (a dict is JSON-encoded). Exceptions propagate."""
        return render_result(self.fn(ctx, **arguments))

    def recovery_check(self, check: Callable[[ToolContext], Recovery]) -> Callable[[ToolContext], Recovery]:
        """Decorator: declare ``check`` as this tool's recovery check (see the module doc)."""
        self.recovery = check
        return check


@overload
def tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    idempotent: bool = True,
    requires_approval: bool = False,
    recovery_check: Callable[[ToolContext], Recovery] | None = None,
) -> Tool: ...
@overload
def tool(
    fn: None = None,
    *,
    name: str | None = None,
    idempotent: bool = True,
    requires_approval: bool = False,
    recovery_check: Callable[[ToolContext], Recovery] | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    idempotent: bool = True,
    requires_approval: bool = False,
    recovery_check: Callable[[ToolContext], Recovery] | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: ``@tool`` or ``@tool(idempotent=False, requires_approval=True, recovery_check=fn)``.

    The function's docstring becomes the description the model sees; its parameters after
    ``ctx`` become the JSON schema. ``recovery_check``: see the module doc.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(
            name=name or f.__name__,
            fn=f,
            description=inspect.cleandoc(f.__doc__ or f.__name__),
            idempotent=idempotent,
            requires_approval=requires_approval,
            recovery=recovery_check,
        )

    return wrap(fn) if fn is not None else wrap


class ToolRegistry:
    """The tools of one run, by name, with the AgentRun's per-tool overrides applied."""

    def __init__(self, tools: list[Tool]):
        self._tools = {t.name: t for t in tools}

    @classmethod
    def from_agentrun(cls, run: AgentRun) -> ToolRegistry:
        """Import every ``spec.tools[i].ref``. Raises SpecError naming the field.

        A spec can make a tool more careful than its author declared it, never less (G4, G10):
        ``requiresApproval: false`` on a tool declared ``requires_approval=True`` is refused (an
        AgentRun cannot opt a refund out of its human decision), and so is ``idempotent: true``
        on a tool declared ``idempotent=False`` (an interrupted call would re-run blindly instead
        of going to a human). The opposite overrides (add a gate, declare a tool not idempotent)
        are accepted.
        """
        tools = []
        for i, spec in enumerate(run.spec.tools):
            try:
                obj = resolve_ref(spec.ref)
            except (ImportError, AttributeError) as err:
                raise SpecError(f"spec.tools[{i}].ref: unknown tool {spec.name!r}: {err}") from None
            if not isinstance(obj, Tool):
                raise SpecError(f"spec.tools[{i}].ref: {spec.ref} is not decorated with @agentfast.runner.tools.tool")
            if obj.requires_approval and spec.requiresApproval is False:
                raise SpecError(
                    f"spec.tools[{i}].requiresApproval: tool {spec.name!r} ({spec.ref}) is declared requires_approval=True by its"
                    " author; a spec can add a gate, never remove one: drop requiresApproval or set it to true"
                )
            if not obj.idempotent and spec.idempotent is True:
                raise SpecError(
                    f"spec.tools[{i}].idempotent: tool {spec.name!r} ({spec.ref}) is declared idempotent=False by its author"
                    " (re-running it may repeat its effect); a spec cannot declare it safe to re-run: drop idempotent or set it to false"
                )
            tools.append(
                Tool(
                    name=spec.name,
                    fn=obj.fn,
                    description=obj.description,
                    idempotent=obj.idempotent if spec.idempotent is None else spec.idempotent,
                    requires_approval=obj.requires_approval if spec.requiresApproval is None else spec.requiresApproval,
                    recovery=obj.recovery,
                )
            )
        return cls(tools)

    def with_builtin(self, builtin: Any) -> ToolRegistry:
        """This registry plus ``builtin`` (a tool the runtime provides, e.g. ``ask_user``: the
        surface of :class:`Tool`). Raises SpecError when a spec tool has its name."""
        if builtin.name in self._tools:
            raise SpecError(f"spec.tools: {builtin.name!r} is the name of a built-in tool of this run; rename yours")
        return ToolRegistry([*self._tools.values(), builtin])

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self._tools.values()]

    @property
    def names(self) -> list[str]:
        return list(self._tools)
