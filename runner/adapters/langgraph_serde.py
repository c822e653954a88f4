"""The LangGraph adapter's serializer: LangGraph's own encoding, decoding only an allow-list of types.

Stored state is data, whoever wrote it. LangGraph's ``JsonPlusSerializer`` revives a msgpack
extension value by importing the module the bytes name and calling the name with the bytes'
arguments: by default any name (a warning is all), so a row of ``agentfast_sdk_blobs`` or a
checkpoint's ``sdk_state`` spelling ``os.system`` ran a command when its run resumed (issue 30
item 9). LangGraph's strict mode (``LANGGRAPH_STRICT_MSGPACK``) has an allow-list, but a value
it blocks is silently decoded as its raw arguments, its ``"json"`` tag revives langchain objects
and ``pickle_fallback`` would unpickle. :class:`AllowListSerializer` writes exactly what LangGraph
writes and reads it back through its own decoder, which

- accepts the tags LangGraph writes without pickle (``null``, ``bytes``, ``bytearray``,
  ``msgpack``) and refuses every other one (``pickle``, ``json``, anything else);
- rebuilds an extension value only when its ``(module, name)`` is allowed, calling the class
  the allow-list holds; the one method call LangGraph encodes (``datetime.fromisoformat``) only
  as LangGraph's ``SAFE_MSGPACK_METHODS`` names it; a numpy array only when the graph has
  imported numpy, never of object dtype; nothing else (LangGraph's ``DeltaChannel`` snapshot
  included: the adapter refuses that channel);
- refuses anything else with :class:`StateRefused` naming the type, before anything of the value
  is called: no import, no call. Nested values are checked the same way, at any depth.

The allow-list: LangGraph's own list of safe types (``SAFE_MSGPACK_TYPES``: langchain_core's
message types and ``Document``, LangGraph's ``Send``, ``Interrupt``, ``Command`` and the like, and
standard value types: datetime, UUID, Decimal, set, Path, ...), plus the types a graph's code
declares: :func:`graph_state_types` derives them from the compiled graph's schemas (its state,
input, output and node input schemas and its channels, subgraphs' too), as LangGraph's strict
mode does, and a graph factory may add more with ``GraphRuntime.allow_state_types``. Only code
(the admin-allowed graph module) adds to it; nothing read from the store or the spec does.

Writing checks the same list: a value the run could not read back is refused when it is written
(:meth:`AllowListSerializer.dumps_typed`), so a graph holding an undeclared type fails at once with
the type named, not at its first resume.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import ormsgpack
from langgraph._internal._serde import collect_allowlist_from_schemas
from langgraph.checkpoint.serde._msgpack import SAFE_MSGPACK_METHODS, SAFE_MSGPACK_TYPES
from langgraph.checkpoint.serde.jsonplus import (
    EXT_CONSTRUCTOR_KW_ARGS,
    EXT_CONSTRUCTOR_POS_ARGS,
    EXT_CONSTRUCTOR_SINGLE_ARG,
    EXT_METHOD_SINGLE_ARG,
    EXT_NUMPY_ARRAY,
    EXT_PYDANTIC_V1,
    EXT_PYDANTIC_V2,
    JsonPlusSerializer,
    _send_from_args,
)

from ..errors import AgentfastError

_OPTION = ormsgpack.OPT_NON_STR_KEYS  # what LangGraph's loads_typed passes
_PLAIN_TAGS = frozenset({"null", "bytes", "bytearray"})
_CONSTRUCTORS = frozenset({EXT_CONSTRUCTOR_SINGLE_ARG, EXT_CONSTRUCTOR_POS_ARGS, EXT_CONSTRUCTOR_KW_ARGS})
_PYDANTIC = frozenset({EXT_PYDANTIC_V1, EXT_PYDANTIC_V2})
_SEND = ("langgraph.types", "Send")
_HOW = (
    "allowed: LangGraph's and langchain_core's types, standard value types, the types the graph's "
    "state schemas declare and those its factory passes to rt.allow_state_types()"
)

TypeKey = tuple[str, ...]


class StateRefused(AgentfastError, ValueError):
    """The LangGraph adapter refused a value of a run's stored state, or one the graph would store.

    ``type_name``: what was refused, e.g. ``"os.system"``, ``"serialization 'pickle'"``, ``"ext
    type 9"``; ``str()`` is one line saying where and why (no traceback, no stored text beyond
    the names). Nothing of a refused value was imported or called. The runner ends the run
    ``Failed`` with reason ``StateRefused`` and this message (exit 1: retrying reads the same
    bytes). A ``ValueError``, as state that does not decode always raised."""

    def __init__(self, message: str, type_name: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name

    def at(self, where: str) -> StateRefused:
        """The same refusal with ``where`` (the row or part of the state) in front of the message."""
        return StateRefused(f"{where}: {self}", self.type_name)


class AllowListSerializer(JsonPlusSerializer):
    """LangGraph's ``JsonPlusSerializer`` encoding (never pickle) with an allow-list decoder.

    ``types``: classes allowed besides LangGraph's safe list. :meth:`allow` adds more, in place
    (the saver is one run's; only the graph's code adds). ``loads_typed`` raises StateRefused for
    a refused tag or type and for bytes that do not decode; ``dumps_typed`` raises it for a value
    holding a type ``loads_typed`` would refuse. Thread-safe for decoding (each call keeps its own
    state); :meth:`allow` is called before the graph runs."""

    def __init__(self, types: Iterable[type | TypeKey] = ()) -> None:
        super().__init__(pickle_fallback=False, allowed_json_modules=None, allowed_msgpack_modules=None)
        # (module, name) -> the allowed callable, or None until first use (imported then: only
        # names of this list, which code wrote, are ever imported).
        self._allowed: dict[TypeKey, Any] = dict.fromkeys(SAFE_MSGPACK_TYPES)
        self.allow(types)

    def allow(self, types: Iterable[type | TypeKey]) -> None:
        """Allow ``types``: classes (kept as they are: decoding calls exactly them) or
        ``(module, name)`` keys (as LangGraph's schema walk gives them)."""
        for t in types:
            if isinstance(t, type):
                self._allowed[(t.__module__, t.__name__)] = t
            else:
                self._allowed.setdefault(tuple(t), None)

    def allowed(self) -> frozenset[TypeKey]:
        """The allowed ``(module, name)`` keys."""
        return frozenset(self._allowed)

    def with_msgpack_allowlist(self, extra_allowlist: Iterable[TypeKey | type]) -> AllowListSerializer:
        """LangGraph's hook (its strict mode calls it at compile): adds to this serializer, in place."""
        self.allow(extra_allowlist)
        return self

    # -- writing ----------------------------------------------------------------------------

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        """LangGraph's encoding of ``obj`` (``pickle_fallback`` off: a value msgpack cannot hold
        raises LangGraph's error), checked: raises StateRefused for a type this serializer
        would refuse to read back."""
        typed = super().dumps_typed(obj)
        if typed[0] == "msgpack":
            try:
                self._decode(typed[1], build=False)
            except StateRefused as err:
                raise StateRefused(
                    f"the graph's state holds a value of type {err.type_name}, which the LangGraph adapter "
                    "would refuse to read back when the run resumes: declare it in the graph's state schema "
                    "or pass it to rt.allow_state_types() in the graph factory",
                    err.type_name,
                ) from None
        return typed

    # -- reading ----------------------------------------------------------------------------

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        """The value ``data`` (``(tag, bytes)`` as ``dumps_typed`` gave) holds. Raises
        StateRefused for a tag other than LangGraph's non-pickle ones, a type not allowed, or
        bytes that do not decode."""
        tag, raw = data
        if tag in _PLAIN_TAGS:
            return super().loads_typed(data)
        if tag != "msgpack":
            name = f"serialization {tag!r}"
            raise StateRefused(f"{name} is refused: only LangGraph's msgpack is read, never pickle or json", name)
        return self._decode(raw, build=True)

    def _decode(self, raw: bytes, *, build: bool) -> Any:
        # ormsgpack replaces an exception of the hook by a bare ValueError("ext_hook failed"):
        # the first refusal is kept here and raised in its place.
        refused: list[StateRefused] = []

        def hook(code: int, payload: bytes) -> Any:
            try:
                return self._ext(code, payload, hook, build)
            except StateRefused as err:
                if not refused:
                    refused.append(err)
                raise

        try:
            return ormsgpack.unpackb(raw, ext_hook=hook, option=_OPTION)
        except (ValueError, RecursionError) as err:  # ormsgpack's MsgpackDecodeError is a ValueError
            if refused:
                raise refused[0] from None
            raise StateRefused(f"the stored value does not decode as msgpack ({err})", "undecodable") from None

    def _ext(self, code: int, payload: bytes, hook: Callable[[int, bytes], Any], build: bool) -> Any:
        """One extension value: its parts decoded (nested values through ``hook``), its type
        checked, then (``build``) rebuilt as LangGraph's decoder rebuilds it."""
        if code == EXT_NUMPY_ARRAY:
            return self._numpy(payload, hook, build)
        if code not in _CONSTRUCTORS and code != EXT_METHOD_SINGLE_ARG and code not in _PYDANTIC:
            name = f"msgpack ext type {code}"
            raise StateRefused(f"{name} is refused (not one LangGraph writes for an allowed type; {_HOW})", name)
        parts = ormsgpack.unpackb(payload, ext_hook=hook, option=_OPTION)
        n = 4 if code == EXT_METHOD_SINGLE_ARG else 3
        if not isinstance(parts, list) or len(parts) < n or not all(isinstance(p, str) for p in parts[:2]):
            name = f"malformed ext type {code}"
            raise StateRefused(f"a msgpack value of {name} is refused", name)
        module, name, arg = parts[0], parts[1], parts[2]
        dotted = f"{module}.{name}"
        if code == EXT_METHOD_SINGLE_ARG:
            method = parts[3]
            if (module, name, method) not in SAFE_MSGPACK_METHODS:
                dotted = f"{dotted}.{method}"
                raise StateRefused(
                    f"the stored state names {dotted}, which is not an allowed method: refused, nothing run", dotted
                )
        elif (module, name) not in self._allowed:
            raise StateRefused(
                f"the stored state names {dotted}, which is not an allowed type: refused, nothing of it imported or run ({_HOW})",
                dotted,
            )
        if not build:
            return None
        return _rebuild(code, self._resolve((module, name)), parts, arg)

    def _resolve(self, key: TypeKey) -> Any:
        obj = self._allowed[key]
        if obj is None:
            # An allowed key only (a class a graph's schema reached, or LangGraph's safe list):
            # importing its module imports what the allow-list's author named, not the bytes.
            try:
                obj = getattr(sys.modules.get(key[0]) or importlib.import_module(key[0]), key[1])
            except (ImportError, AttributeError):
                obj = _unresolvable
            self._allowed[key] = obj
        return obj

    def _numpy(self, payload: bytes, hook: Callable[[int, bytes], Any], build: bool) -> Any:
        np = sys.modules.get("numpy")
        if np is None:  # never imported here for the bytes' sake: the graph holds no arrays
            raise StateRefused("a numpy.ndarray is refused: the graph does not use numpy", "numpy.ndarray")
        dtype_str, shape, order, buf = ormsgpack.unpackb(payload, ext_hook=hook, option=_OPTION)
        dtype = np.dtype(dtype_str)
        if dtype.hasobject:  # object arrays hold Python objects: never rebuilt from bytes
            raise StateRefused(f"a numpy.ndarray of dtype {dtype_str!r} (Python objects) is refused", "numpy.ndarray[object]")
        if not build:
            return None
        return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


def _unresolvable(*args: Any, **kwargs: Any) -> Any:
    raise LookupError("an allowed type that this process cannot import")


def _rebuild(code: int, fn: Any, parts: list[Any], arg: Any) -> Any:
    """LangGraph's reconstruction (``jsonplus._create_msgpack_ext_hook``) of an allowed value,
    with its fallbacks: a pydantic model that does not validate is constructed unvalidated, and
    any other value that cannot be rebuilt is its stored arguments."""
    try:
        if code == EXT_METHOD_SINGLE_ARG:
            return getattr(fn, parts[3])(arg)
        if code == EXT_CONSTRUCTOR_SINGLE_ARG:
            return fn(arg)
        if code == EXT_CONSTRUCTOR_POS_ARGS:
            return _send_from_args(arg) if (parts[0], parts[1]) == _SEND else fn(*arg)
        if code == EXT_CONSTRUCTOR_KW_ARGS:
            return fn(**arg)
        try:
            return fn(**arg)
        except Exception:  # noqa: BLE001 - LangGraph's fallback for a model that changed since
            return (fn.model_construct if code == EXT_PYDANTIC_V2 else fn.construct)(**arg)
    except Exception:  # noqa: BLE001 - as LangGraph: the stored arguments rather than nothing
        return arg


def graph_state_types(compiled: Any) -> set[TypeKey]:
    """The ``(module, name)`` of every pydantic model, dataclass and enum that the schemas of
    ``compiled`` (a compiled StateGraph) and of its subgraphs reach: their state, input, output
    and node and branch input schemas and their channels' value types, walked by LangGraph's
    own ``collect_allowlist_from_schemas`` (what its strict mode allows at compile)."""
    keys: set[TypeKey] = set()
    graphs = [compiled, *(sub for _, sub in compiled.get_subgraphs(recurse=True))]
    for g in graphs:
        b = getattr(g, "builder", None)
        if b is None:
            continue
        schemas = [b.state_schema, b.input_schema, b.output_schema, *(n.input_schema for n in b.nodes.values())]
        schemas += [br.input_schema for branches in b.branches.values() for br in branches.values()]
        keys |= collect_allowlist_from_schemas(schemas=[s for s in schemas if s is not None], channels=b.channels)
    return keys
