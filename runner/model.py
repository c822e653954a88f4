"""The model provider: any OpenAI-compatible Chat Completions endpoint, through the official client.

One call is :meth:`ChatModel.complete`: the transcript so far (``list[Message]``, the shape of
:mod:`agentfast.runner.snapshot`) and the tool schemas in, one assistant message and its token
usage out (:class:`ModelReply`). Tool-call ``arguments`` are kept as the raw strings the model
produced, malformed or not: parsing them is the runtime's job, so a bad call can be counted and
answered instead of crashing the run.

Retries are the ``openai`` client's own: on connection errors, timeouts, 408, 409, 429 and 5xx,
with exponential backoff (0.5 s doubling, at most 8 s, with jitter; a server's ``Retry-After``
is honoured). A call that still fails, or fails with another 4xx, raises :class:`ModelError`,
whose ``retriable`` says whether asking again later could succeed.

:func:`model_from_spec` builds the provider an AgentRun's ``spec.model`` asks for: with
``spec.model.config``, the endpoint and limits of the ModelConfig the run was registered with and
the key from ``AGENTFAST_MODEL_API_KEY``; with ``spec.model.script`` it also starts the scripted
model (:mod:`agentfast.testing.scripted`, test support) on localhost and talks to it over HTTP like to any
remote endpoint.
"""

from __future__ import annotations

import json
import operator
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from .boundedjson import JsonLimitExceeded, check
from .errors import AgentfastError
from .snapshot import Message, ToolCall
from .spec import MODEL_API_KEY_ENV, NO_KEY, ModelSpec, ResolvedModelConfig, check_model_allowed
from .storable import storable_text

if TYPE_CHECKING:
    import openai

    from agentfast.testing.scripted import Script

__all__ = ["ChatModel", "ModelError", "ModelReply", "OpenAIChatModel", "distinct_tool_call_ids", "model_from_spec"]

#: HTTP statuses the openai client retries; a call that still fails with one is retriable later.
_RETRIED_STATUSES = frozenset({408, 409, 429})


class ModelReply(BaseModel):
    """One model turn.

    ``message`` is the assistant message (``role="assistant"``, ``content`` and/or
    ``tool_calls``, each call's ``arguments`` the raw JSON text exactly as received).
    Token counts are as the provider reported them in ``usage`` (0 when it sent none).
    ``finish_reason`` is the provider's (``"stop"``, ``"tool_calls"``, ``"length"``, ...).
    """

    message: Message
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    total_tokens: int = Field(0, ge=0)
    finish_reason: str | None = None


class ModelError(AgentfastError):
    """A model call that failed for good.

    ``retriable`` is True when the failure was transient (429, 5xx, connection error, timeout)
    and the client's retries ran out: the same call may succeed later. It is False when asking
    again cannot help (400, 401, 403, 404, 422, a missing API key, an unusable response).
    ``status_code`` is the HTTP status when there was one. ``str(err)`` ends with
    ``[retriable]`` or ``[not retriable]``.
    """

    def __init__(self, message: str, *, retriable: bool, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retriable = retriable
        self.status_code = status_code

    def __str__(self) -> str:
        return f"{self.message} [{'retriable' if self.retriable else 'not retriable'}]"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_model_error, (self.message, self.retriable, self.status_code))


def _rebuild_model_error(message: str, retriable: bool, status_code: int | None) -> ModelError:
    return ModelError(message, retriable=retriable, status_code=status_code)


@runtime_checkable
class ChatModel(Protocol):
    """What the runtime needs from a model provider."""

    def complete(self, messages: list[Message], tools: list[dict[str, Any]]) -> ModelReply:
        """Ask for the next assistant message.

        ``messages``: the transcript, oldest first. ``tools``: OpenAI tool schemas
        (``{"type": "function", "function": {"name", "description", "parameters"}}``); may be
        empty. Raises :class:`ModelError`.
        """
        ...

    def close(self) -> None:
        """Release connections (and anything the provider started). Idempotent."""
        ...


class OpenAIChatModel(ChatModel):
    """A Chat Completions endpoint reached with the official sync ``openai.OpenAI`` client.

    ``base_url``: the endpoint's API root, e.g. ``https://api.openai.com/v1`` or
    ``http://vllm:8000/v1``. ``model``: the model name sent in each request.
    ``timeout_s``: seconds allowed for one HTTP attempt (each retry gets its own).
    ``max_retries``: retries after the first attempt on connection errors, timeouts, 408, 409,
    429 and 5xx, with exponential backoff. ``temperature``: sent only when not None.
    ``max_tokens``: the most completion tokens one request may produce, sent as
    ``max_completion_tokens`` (OpenAI's name for it; vLLM and LiteLLM take it too) when not None.
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str,
        timeout_s: float = 60,
        max_retries: int = 4,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        if not api_key:
            raise ModelError("model API key is empty", retriable=False)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.base_url = base_url
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.temperature = temperature
        self._api_key = api_key
        # Made at the first call: importing openai takes ~0.5 s, and a runner taking a run over
        # (a lost pod's replacement) commits its takeover before it needs the model.
        self._client: openai.OpenAI | None = None
        self._client_lock = threading.Lock()
        self._wire = _WireBody()
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        #: The ScriptedModelServer behind this model when built by ``model_from_spec`` from a
        #: script (its ``requests`` are useful in tests and demos); None otherwise.
        self.server: Any = None

    def __repr__(self) -> str:
        return f"OpenAIChatModel(base_url={self.base_url!r}, model={self.model!r})"

    def client(self) -> openai.OpenAI:
        """The ``openai.OpenAI`` client, made (and openai imported) on first use. Thread-safe."""
        with self._client_lock:
            if self._client is None:
                import openai

                self._client = openai.OpenAI(
                    base_url=self.base_url,
                    api_key=self._api_key,
                    timeout=self.timeout_s,
                    max_retries=self.max_retries,
                    http_client=openai.DefaultHttpxClient(event_hooks={"response": [_bounded_reply]}),
                )
            return self._client

    def warm(self) -> None:
        """Make the client in a background thread (the runner calls this once it holds the run and
        committed its takeover), so the next model call does not pay the import either."""
        threading.Thread(target=self.client, name="agentfast-model-warm", daemon=True).start()

    def request_params(self, messages: list[Message], tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The keyword arguments ``client.chat.completions.create`` would take for this call: ``model``,
        ``messages`` (``Message.to_openai()`` each), and ``tools``, ``temperature``,
        ``max_completion_tokens`` when set. :meth:`complete` sends the same body without building
        this dict (see :class:`_WireBody`); tests and the benchmark use it as the SDK's own path."""
        kwargs: dict[str, Any] = {"model": self.model, "messages": [m.to_openai() for m in messages]}
        kwargs.update(self._fields(tools))
        return kwargs

    def _fields(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        # In the order the SDK's create() writes them after "messages" (the wire bytes depend on it).
        fields: dict[str, Any] = {}
        if self.max_tokens is not None:
            fields["max_completion_tokens"] = self.max_tokens
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if tools:
            fields["tools"] = tools
        return fields

    def complete(self, messages: list[Message], tools: list[dict[str, Any]]) -> ModelReply:
        """One Chat Completions call (with the client's retries). Raises :class:`ModelError`.

        The body is the one ``chat.completions.create`` sends, byte for byte, but serialised by
        :class:`_WireBody` (each message once per process) and posted with the client's ``post``:
        the SDK's per-call transform walks the whole transcript, which made a call at 3,000
        messages cost 50x one at 30 (issue 15, item 4). Retries, auth, errors and the parsed
        ``ChatCompletion`` are the SDK's as before.
        """
        if self._closed:
            raise ModelError(f"{self!r} is closed", retriable=False)
        import openai
        from openai._base_client import make_request_options
        from openai.types.chat import ChatCompletion

        client = self.client()
        body = self._wire.body(self.model, messages, self._fields(tools))
        try:
            response = client.post(
                "/chat/completions",
                cast_to=ChatCompletion,
                content=body,
                # What create() passes: the bearer key (auth), no extras.
                options=make_request_options(security={"bearer_auth": True}),
            )
        except JsonLimitExceeded as err:  # the endpoint's reply itself (_bounded_reply): asking again gives the same
            raise ModelError(f"model call to {self.base_url} (model {self.model!r}) refused: {err}", retriable=False) from None
        except openai.APIStatusError as err:
            raise self._status_error(err) from err
        except openai.APITimeoutError as err:
            raise ModelError(
                f"model call to {self.base_url} (model {self.model!r}) timed out after {self.timeout_s} s per attempt;"
                f" gave up after {self.max_retries} retries",
                retriable=True,
            ) from err
        except openai.APIConnectionError as err:
            cause = err.__cause__ or err
            if isinstance(cause, JsonLimitExceeded):  # the endpoint's reply itself: asking again gives the same
                raise ModelError(
                    f"model call to {self.base_url} (model {self.model!r}) refused: {cause}", retriable=False
                ) from err
            raise ModelError(
                f"model call to {self.base_url} (model {self.model!r}) could not connect: {cause};"
                f" gave up after {self.max_retries} retries",
                retriable=True,
            ) from err
        except openai.OpenAIError as err:
            raise ModelError(f"model call to {self.base_url} (model {self.model!r}) failed: {err}", retriable=False) from err
        return self._reply(response)

    def _status_error(self, err: openai.APIStatusError) -> ModelError:
        status = err.status_code
        detail = _error_detail(err)
        where = f"model call to {self.base_url} (model {self.model!r}) failed: HTTP {status}: {detail}"
        if status in _RETRIED_STATUSES or status >= 500:
            return ModelError(f"{where}; gave up after {self.max_retries} retries", retriable=True, status_code=status)
        return ModelError(where, retriable=False, status_code=status)

    def _reply(self, response: Any) -> ModelReply:
        try:
            choice = response.choices[0]
            msg = choice.message
        except (AttributeError, IndexError, TypeError):
            raise ModelError(
                f"model call to {self.base_url} (model {self.model!r}) returned no choices", retriable=False
            ) from None
        calls: list[ToolCall] = []
        for position, tc in enumerate(getattr(msg, "tool_calls", None) or []):
            fn = getattr(tc, "function", None)
            if fn is None:
                raise ModelError(
                    f"model {self.model!r} returned a tool call of type {getattr(tc, 'type', None)!r};"
                    " only function tool calls are supported",
                    retriable=False,
                )
            args = fn.arguments
            if not isinstance(args, str):  # non-conforming servers send an object; keep it as text
                args = "" if args is None else json.dumps(args)
            calls.append(ToolCall(id=getattr(tc, "id", None) or f"call_{position}", name=fn.name or "", arguments=args))
        content = getattr(msg, "content", None)
        refusal = getattr(msg, "refusal", None) or None
        if content is None and not calls:
            content = refusal  # a refusal is the model's answer
        usage = getattr(response, "usage", None)
        prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
        completion = int(getattr(usage, "completion_tokens", 0) or 0)
        total = int(getattr(usage, "total_tokens", 0) or 0) or prompt + completion
        return ModelReply(
            message=Message(role="assistant", content=content, tool_calls=calls, refusal=refusal),
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=total,
            finish_reason=getattr(choice, "finish_reason", None),
        )

    def close(self) -> None:
        """Close the HTTP client, then run close hooks (e.g. stop a scripted server). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._client is not None:
                self._client.close()
        finally:
            for hook in self._on_close:
                hook()

    def __enter__(self) -> OpenAIChatModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WireBody:
    """Serialises Chat Completions request bodies, each message once.

    :meth:`body` returns the UTF-8 JSON bytes the openai SDK would send for ``{"model", "messages",
    **fields}`` (its ``openapi_dumps``: compact separators, non-ASCII as is, no NaN). The bytes of
    each message are cached against the ``Message`` object, so a growing transcript costs one
    serialisation per new message plus a join, instead of a transform and a dump of the whole
    list per call. Messages are values: the runtime never mutates one in place (a changed message
    is a new object), so an object seen at the same position before has the same bytes; any other
    object there, and every one after it, is serialised again. Holds the transcript's bytes once
    (about its JSON size) for as long as the model lives. Thread-safe.
    """

    def __init__(self) -> None:
        self._objs: list[Message] = []  # held, so an id cannot be reused while its bytes are cached
        self._parts: list[bytes] = []
        self._lock = threading.Lock()

    def body(self, model: str, messages: list[Message], fields: Mapping[str, Any]) -> bytes:
        """The request body (bytes). Raises ``ValueError`` (NaN) or ``UnicodeEncodeError`` (a lone
        surrogate) as the SDK would; the runtime stores only storable text (runner/storable.py)."""
        with self._lock:
            return self._body(model, messages, fields)

    def _body(self, model: str, messages: list[Message], fields: Mapping[str, Any]) -> bytes:
        from openai._utils._json import openapi_dumps

        objs, parts = self._objs, self._parts
        # How many leading messages are the very objects serialised before: the usual case (the
        # transcript only grew, or is one iteration shorter) is one identity pass in C; else find
        # where the two first differ.
        same = min(len(objs), len(messages))
        if not all(map(operator.is_, objs, messages)):
            same = next(i for i, (a, b) in enumerate(zip(objs, messages)) if a is not b)
        del objs[same:], parts[same:]
        for i, m in enumerate(messages[same:], same):
            # Every part but the first carries its separator: the body is then one join, one copy.
            part = openapi_dumps(m.to_openai())
            parts.append(b"," + part if i else part)
            objs.append(m)  # after its bytes: a message that cannot be serialised is not cached
        head = openapi_dumps({"model": model, "messages": []})[:-2]  # '{"model":...,"messages":['
        tail = b"]" + (b"," + openapi_dumps(dict(fields))[1:] if fields else b"}")
        return b"".join([head, *parts, tail])


#: Longest tool-call id the runtime makes: OpenAI rejects ids longer than 40 characters.
MAX_TOOL_CALL_ID = 40
_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def _bounded_reply(response: Any) -> None:
    """The HTTP client's response hook: a successful reply's JSON body is read and checked
    against :mod:`~agentfast.runner.boundedjson`'s limits (8 MiB, 64 levels) before the SDK parses
    it. Raises JsonLimitExceeded (as it is, or wrapped by the SDK: :meth:`OpenAIChatModel.complete` turns it into
    a ModelError that is not retriable)."""
    if response.is_success and "json" in response.headers.get("content-type", ""):
        response.read()
        check(response.content, what="the model endpoint's reply")


def distinct_tool_call_ids(message: Message, earlier: Iterable[Message], iteration: int) -> Message:
    """``message`` with each tool-call id distinct from its other calls' and from every id in ``earlier``.

    Some providers repeat a tool-call id within one response or across turns, or send none. The
    whole transcript goes back to the provider on every request, and a strict endpoint (OpenAI's)
    rejects a request whose messages hold one id twice, after the tools already ran. So an id that
    is empty or already taken becomes ``<id>_<iteration>_<position>``: only ``[A-Za-z0-9_-]`` of
    the provider's id, shortened so the whole is at most :data:`MAX_TOOL_CALL_ID` characters
    (``_2``, ``_3``... appended in the unlikely case that is taken too); ``ToolCall.provider_id``
    keeps the provider's. ``earlier``: the transcript the model was sent (assistant calls and
    tool results). Deterministic, and a no-op (the same object) when every id is already distinct.
    """
    taken = {c.id for m in earlier for c in m.tool_calls} | {m.tool_call_id for m in earlier if m.tool_call_id}
    calls: list[ToolCall] = []
    changed = False
    for position, call in enumerate(message.tool_calls):
        cid = storable_text(call.id)
        if cid and cid not in taken:
            calls.append(call)
            taken.add(cid)
            continue
        stem = _ID_CHARS.sub("", cid) or "call"
        suffix, n = f"_{iteration}_{position}", 1
        new = stem[: MAX_TOOL_CALL_ID - len(suffix)] + suffix
        while new in taken:
            n += 1
            more = f"{suffix}_{n}"
            new = stem[: MAX_TOOL_CALL_ID - len(more)] + more
        calls.append(call.model_copy(update={"id": new, "provider_id": call.id}))
        taken.add(new)
        changed = True
    return message.model_copy(update={"tool_calls": calls}) if changed else message


def _error_detail(err: openai.APIStatusError) -> str:
    body = err.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return err.message


def model_from_spec(
    spec: ModelSpec,
    config: ResolvedModelConfig | None = None,
    env: Mapping[str, str] = os.environ,
    *,
    script: Script | None = None,
) -> ChatModel:
    """The provider for an AgentRun's ``spec.model``.

    With ``spec.script``: loads the script (or takes ``script``, the one ``spec.resolve`` loaded),
    starts a :class:`ScriptedModelServer` on 127.0.0.1
    (a free port) and returns an :class:`OpenAIChatModel` pointed at it (API key ``"scripted"``,
    the ModelConfig defaults: 60 s per attempt, 4 retries); closing the model stops the server.
    With ``spec.config``: ``config`` is the run's resolved ModelConfig (``AgentRun.modelConfig``,
    written when the run was registered): its ``baseURL``, ``timeoutSeconds``, ``maxRetries`` and
    ``maxTokensPerRequest``; the key is ``env["AGENTFAST_MODEL_API_KEY"]`` when the ModelConfig
    names a Secret (the operator sets that variable from it; locally the user does), else the
    placeholder ``none``. Nothing else in ``env`` is read.
    Raises :class:`ModelError` (not retriable) when the script cannot be loaded, the run has no
    resolved ModelConfig, the model is not one it allows, or its key is missing.
    """
    if spec.script:
        from .spec import SpecError, scripted_module

        try:
            scripted = scripted_module()
        except SpecError as err:
            raise ModelError(str(err), retriable=False) from None
        if script is None:
            try:
                script = scripted.load_script(spec.script)
            except ValueError as err:
                raise ModelError(f"model script (spec.model.script): {err}", retriable=False) from err
        server = scripted.ScriptedModelServer(script, host="127.0.0.1", port=0)
        base_url = server.start()
        defaults = ResolvedModelConfig.model_fields
        try:
            model = OpenAIChatModel(
                base_url=base_url,
                api_key="scripted",
                model=spec.name,
                timeout_s=defaults["timeoutSeconds"].default,
                max_retries=defaults["maxRetries"].default,
                temperature=spec.temperature,
            )
        except BaseException:
            server.stop()
            raise
        model._on_close.append(server.stop)
        model.server = server
        return model

    if config is None:
        raise ModelError(
            f"spec.model.config: ModelConfig {spec.config!r} was not resolved when the run was registered;"
            " register the run again (agentfast run FILE with the ModelConfig beside it, or through the operator)",
            retriable=False,
        )
    try:
        check_model_allowed(spec, config)
    except ValueError as err:
        raise ModelError(str(err), retriable=False) from None
    api_key = NO_KEY
    if config.apiKeySecretRef is not None:
        api_key = env.get(MODEL_API_KEY_ENV, "")
        if not api_key:
            raise ModelError(
                f"model API key: {MODEL_API_KEY_ENV} is not set; ModelConfig {config.name!r} names a key (Secret"
                f" {config.apiKeySecretRef.name!r}, key {config.apiKeySecretRef.key!r}), which the operator mounts"
                f" there in a cluster; locally, export {MODEL_API_KEY_ENV}",
                retriable=False,
            )
    return OpenAIChatModel(
        base_url=config.baseURL,
        api_key=api_key,
        model=spec.name,
        timeout_s=config.timeoutSeconds,
        max_retries=config.maxRetries,
        temperature=spec.temperature,
        max_tokens=config.maxTokensPerRequest,
    )
