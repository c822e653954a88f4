"""A scripted model: an OpenAI-compatible Chat Completions server that replays a YAML script.

It stands for a remote model in demos and tests. It speaks the real wire format over real HTTP
(``POST /v1/chat/completions``, ``GET /v1/models``), so the runner talks to it through the same
official ``openai`` client, retries and error handling it uses for a real provider.

Script format (YAML)::

    model: scripted-refund            # the model id reported by the server (required)
    name: refund                      # optional; defaults to the file's stem / bundled name
    turns:                            # one entry per model call (at least one)
      - tool_calls:                   # a parallel batch: several entries, returned in this order
          - {id: call_1, name: lookup_order, arguments: {order_id: "A-1042"}}
            # arguments: a mapping, sent as json.dumps(mapping); or
          - {id: call_2, name: x, arguments_raw: "{not json"}
            # arguments_raw: a string sent as-is (for malformed-arguments tests)
            # neither: "{}"
        content: "optional text alongside the calls"
        usage: {prompt_tokens: 150, completion_tokens: 24}
            # optional; total_tokens defaults to the sum. Without ``usage`` the server reports a
            # deterministic estimate: ceil(chars / 4) of the canonical JSON of the request's
            # messages + tools (prompt) and of the reply (completion).
      - content: "final answer"
        fail: [429, 500]
            # optional: the first requests for this turn get these HTTP statuses, in order, with
            # an OpenAI-shaped error body; later requests for the turn succeed. The counters
            # belong to one server instance.

A multi-turn conversation (docs/conversation.md) is a script whose turns call ``ask_user`` (or,
with ``spec.conversation``, end their content in a question); the next turn can say what the
user's reply must contain (``expect: "A-1042"``: the request's last message must contain that
text, else HTTP 400), so a script proves the reply reached the model.

A turn needs ``content``, ``tool_calls`` or ``refusal`` (any of them together). ``refusal``
is sent as the message's ``refusal`` field, as OpenAI does when a model declines. A turn with
tool calls finishes with ``finish_reason: "tool_calls"``, otherwise ``"stop"``. Unknown keys are
errors.

Strict mode (``strict: true`` at the top of a script, ``ScriptedModelServer(strict=True)`` or
``--strict``) checks a request's ``messages`` as OpenAI does and answers HTTP 400
(``invalid_request_error``) when a tool-call id appears twice among the assistant messages'
``tool_calls``, when a ``tool`` message answers no call of the assistant message before it, or
when an assistant message's call has no ``tool`` message answering it.

Turn selection is stateless: the turn index is the number of ``assistant`` messages in the
request's ``messages``. A process that resumes a run and asks again gets the same turn. A request
past the last turn gets HTTP 400 with an ``invalid_request_error`` body.

``load_script("refund")`` reads the bundled ``scripts/refund.yaml`` of package
``agentfast.testing``; ``load_script("path/to/x.yaml")`` reads a file. A bad script raises
ValueError naming the field (``script 'x': turns[1].tool_calls[0].name: Field required``).

A server given an API key (``ScriptedModelServer(api_key=...)``, ``--require-key-env VAR``)
answers HTTP 401 (``invalid_api_key``) to any request whose ``Authorization`` is not
``Bearer <key>``, as a real provider does; without one it accepts any key.

Serve one in the foreground (e.g. as a Service in a cluster; use ``--host 0.0.0.0`` there)::

    python -m agentfast.testing.scripted --script refund --port 8089
    MODEL_KEY=s3cret python -m agentfast.testing.scripted --script refund --require-key-env MODEL_KEY
"""

from __future__ import annotations

import argparse
import collections
import hmac
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger(__name__)

#: Largest request body the server reads, in bytes.
MAX_REQUEST_BYTES = 32 * 1024 * 1024

_BUNDLED_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


# --------------------------------------------------------------------------------------------
# The script model
# --------------------------------------------------------------------------------------------


class _ScriptModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScriptToolCall(_ScriptModel):
    """One scripted tool call. ``arguments`` (a mapping) or ``arguments_raw`` (sent verbatim)."""

    id: str
    name: str
    arguments: dict[str, Any] | None = None
    arguments_raw: str | None = None

    @field_validator("id", "name")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        # Checked here, not with min_length: pydantic cannot measure a string holding a lone
        # surrogate, and a script may carry one to stand for a provider that sends it.
        if not v:
            raise ValueError("String should have at least 1 character")
        return v

    @field_validator("arguments", mode="before")
    @classmethod
    def _mapping(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"must be a mapping (use arguments_raw for a raw string), got {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> ScriptToolCall:
        if self.arguments is not None and self.arguments_raw is not None:
            raise ValueError("set arguments or arguments_raw, not both")
        return self

    def wire_arguments(self) -> str:
        """The ``function.arguments`` string sent on the wire."""
        if self.arguments_raw is not None:
            return self.arguments_raw
        return json.dumps(self.arguments if self.arguments is not None else {})


class ScriptUsage(_ScriptModel):
    """Token counts reported for a turn; ``total_tokens`` defaults to the sum."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int | None = Field(None, ge=0)


class ScriptTurn(_ScriptModel):
    """The reply to the request that carries as many assistant messages as this turn's index."""

    content: str | None = None
    tool_calls: list[ScriptToolCall] = Field(default_factory=list)
    refusal: str | None = None
    usage: ScriptUsage | None = None
    fail: list[int] = Field(default_factory=list, description="HTTP statuses for the first requests of this turn")
    expect: str | None = Field(
        None, description="text the request's last message must contain (e.g. the user's reply), else HTTP 400"
    )

    @field_validator("fail")
    @classmethod
    def _statuses(cls, v: list[int]) -> list[int]:
        bad = [s for s in v if not 400 <= s <= 599]
        if bad:
            raise ValueError(f"HTTP statuses must be 400-599, got {bad}")
        return v

    @model_validator(mode="after")
    def _has_reply(self) -> ScriptTurn:
        if self.content is None and not self.tool_calls and self.refusal is None:
            raise ValueError("a turn needs content, tool_calls or refusal")
        return self


class Script(_ScriptModel):
    """A whole script: the model id reported and the turns, in order."""

    name: str = ""
    model: str = Field(min_length=1)
    strict: bool = Field(
        False, description="check each request's messages as OpenAI does (duplicate tool-call ids, unanswered calls)"
    )
    turns: list[ScriptTurn] = Field(min_length=1)

    @property
    def label(self) -> str:
        """The name used in messages: ``name`` if set, else ``model``."""
        return self.name or self.model


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def parse_script(doc: Any, *, name: str = "") -> Script:
    """Validate a script document (a dict as YAML gives it). Raises ValueError naming the field."""
    label = name or "(inline)"
    if not isinstance(doc, dict):
        raise ValueError(f"script {label!r}: (document): expected a mapping with model and turns, got {type(doc).__name__}")
    try:
        script = Script.model_validate(doc)
    except ValidationError as err:
        lines = [f"{_loc(tuple(e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in err.errors()]
        raise ValueError(f"script {label!r}: " + "; ".join(lines)) from None
    if not script.name and name:
        script = script.model_copy(update={"name": name})
    return script


def _bundled_dir() -> Any:
    """The ``scripts`` folder of this package (a Traversable), however it was installed."""
    try:
        return resources.files("agentfast.testing").joinpath("scripts")
    except (NotADirectoryError, ModuleNotFoundError, TypeError):
        return Path(__file__).resolve().parent / "scripts"


def bundled_scripts() -> list[str]:
    """Names of the scripts bundled with the package (``testing/scripts/*.yaml``)."""
    d = _bundled_dir()
    try:
        return sorted(p.name[: -len(".yaml")] for p in d.iterdir() if p.name.endswith(".yaml"))
    except (OSError, NotADirectoryError):
        return []


def load_script(name_or_path: str) -> Script:
    """Load a script: a path to a YAML file, or the name of a bundled one (``"refund"``).

    Raises ValueError when the file is missing, is not YAML, or does not validate (the message
    names the field).
    """
    looks_like_path = (
        "/" in name_or_path
        or "\\" in name_or_path
        or name_or_path.endswith((".yaml", ".yml"))
        or not _BUNDLED_NAME.match(name_or_path)
    )
    from agentfast.runner.safeyaml import UnsafeYaml, read_text

    if looks_like_path or Path(name_or_path).is_file():
        path = Path(name_or_path)
        try:
            text = read_text(path)  # bounded: at most 1 MiB, so /dev/zero or a FIFO cannot fill memory
        except UnsafeYaml as err:
            raise ValueError(f"script {err}") from None
        name = path.stem
    else:
        res = _bundled_dir().joinpath(f"{name_or_path}.yaml")
        try:
            text = res.read_text(encoding="utf-8")
        except (OSError, NotADirectoryError):
            known = ", ".join(bundled_scripts()) or "none"
            raise ValueError(
                f"script {name_or_path!r}: no such file and no bundled script of that name (bundled: {known})"
            ) from None
        name = name_or_path
    return _parsed(text, name)


def _parsed(text: str, name: str) -> Script:
    """The script ``text`` (named ``name``) as :func:`load_script` returns it. Raises ValueError.
    PyYAML's safe parser takes ~5 ms per KB of it (issue 15): a run loads its script once
    (``spec.resolve``), and its model takes that (``model.model_from_spec(..., script=)``)."""
    from agentfast.runner.safeyaml import UnsafeYaml, load_all

    try:
        docs = load_all(text, f"script {name!r}")
    except UnsafeYaml as err:
        raise ValueError(str(err)) from None
    doc = docs[0] if len(docs) == 1 else docs
    return parse_script(doc, name=name)


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def _error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _estimate_tokens(obj: Any) -> int:
    return math.ceil(len(json.dumps(obj, sort_keys=True, separators=(",", ":"))) / 4)


_FAIL_BODIES: dict[int, tuple[str, str | None]] = {
    429: ("requests", "rate_limit_exceeded"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: ScriptedModelServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agentfast-scripted/0.1"
    timeout = 60  # an idle keep-alive connection is closed after this many seconds
    # TCP_NODELAY: a reply written in two sends (headers, body) would otherwise wait for the
    # client's delayed ACK, 40 ms per request, which swamps what a benchmark measures.
    disable_nagle_algorithm = True
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    def _authorized(self) -> bool:
        """True when the server needs no key or the request carries it; else answers 401."""
        owner = self.server.owner
        got = self.headers.get("Authorization") or ""
        with owner._lock:
            owner.authorizations.append(got)
        key = owner.api_key
        if key is None:
            return True
        if hmac.compare_digest(got.encode("utf-8", "replace"), f"Bearer {key}".encode()):
            return True
        with self.server.owner._lock:
            self.server.owner.unauthorized += 1
        self._send(401, _error_body("Incorrect API key provided.", "invalid_request_error", "invalid_api_key"))
        return False

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if not self._authorized():
            return
        if self._path() in ("/v1/models", "/models"):
            self._send(200, self.server.owner.models_payload())
        else:
            self._send(404, _error_body(f"no route GET {self._path() or '/'}", "invalid_request_error", "not_found"))

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_REQUEST_BYTES:
            self.close_connection = True
            self._send(413 if length > 0 else 400, _error_body("bad or too large Content-Length", "invalid_request_error"))
            return
        raw = self.rfile.read(length)
        owner = self.server.owner
        if owner.wire.maxlen:
            with owner._lock:
                owner.wire.append((dict(self.headers.items()), raw))
        if not self._authorized():
            return
        if self._path() not in ("/v1/chat/completions", "/chat/completions"):
            self._send(404, _error_body(f"no route POST {self._path() or '/'}", "invalid_request_error", "not_found"))
            return
        status, payload = self.server.owner.handle_chat(raw)
        self._send(status, payload)


class ScriptedModelServer:
    """Serves one :class:`Script` over HTTP in a daemon thread.

    ``start()`` binds ``host:port`` (port 0 picks a free one) and returns the base URL
    (``"http://127.0.0.1:PORT/v1"``); ``stop()`` closes the listener and any open connections.
    Usable as a context manager. With ``api_key`` a request without ``Authorization: Bearer
    <api_key>`` gets HTTP 401 (counted in ``unauthorized``, not kept in ``requests``). ``requests`` holds the latest ``keep_requests`` (256)
    chat-completions request bodies received, in arrival order (the parsed JSON, or the raw text
    when it was not JSON), failed ones included. Bounded: each body carries the whole transcript,
    and a runner hosting the server for a long run must not keep them all (1.5 GiB after 1,000
    iterations, measured in docs/benchmarks.md). ``keep_wire`` (default 0) keeps that many raw
    POSTs in ``wire``, headers and bytes as received.
    """

    def __init__(
        self,
        script: Script,
        host: str = "127.0.0.1",
        port: int = 0,
        keep_requests: int = 256,
        strict: bool | None = None,
        api_key: str | None = None,
        keep_wire: int = 0,
    ) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string or None (no key checked)")
        self.script = script
        #: The key every request must carry as ``Authorization: Bearer <key>`` (401 otherwise); None: any.
        self.api_key = api_key
        #: Requests answered 401 for a missing or wrong key.
        self.unauthorized = 0
        #: The ``Authorization`` header of the latest ``keep_requests`` requests ("" when absent), in arrival order.
        self.authorizations: collections.deque[str] = collections.deque(maxlen=keep_requests)
        #: Reject requests whose messages OpenAI would reject (see :func:`strict_violation`); default: the script's ``strict``.
        self.strict = script.strict if strict is None else strict
        self.host = host
        self.port = port
        self.requests: collections.deque[Any] = collections.deque(maxlen=keep_requests)
        #: ``(headers, body bytes)`` of the latest ``keep_wire`` POSTs exactly as received (any path,
        #: unauthorized ones too), in arrival order: what a client put on the wire. Off (0) unless
        #: asked: it doubles what ``requests`` keeps.
        self.wire: collections.deque[tuple[dict[str, str], bytes]] = collections.deque(maxlen=keep_wire)
        self._lock = threading.Lock()
        self._failures_served: dict[int, int] = {}
        self._conns: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._seq = 0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``. Raises RuntimeError before ``start()``."""
        if self._httpd is None:
            raise RuntimeError("scripted model server is not started")
        host, port = self._httpd.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server's address: (host, port)
        return f"http://{host}:{port}/v1"

    def start(self) -> str:
        """Bind and serve in a daemon thread; return the base URL. Idempotent."""
        if self._httpd is None:
            httpd = _HTTPServer((self.host, self.port), _Handler)
            httpd.owner = self
            self._httpd = httpd
            self._thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"scripted-model-{self.script.label}",
                daemon=True,
            )
            self._thread.start()
        return self.base_url

    def stop(self) -> None:
        """Stop serving, close open connections and the listening socket. Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ScriptedModelServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    # -- protocol --------------------------------------------------------------------------

    def models_payload(self) -> dict[str, Any]:
        """The ``GET /v1/models`` body: one model, the script's."""
        return {
            "object": "list",
            "data": [{"id": self.script.model, "object": "model", "created": 0, "owned_by": "agentfast-scripted"}],
        }

    def handle_chat(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one chat-completions request body: ``(HTTP status, JSON payload)``."""
        try:
            body: Any = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            with self._lock:
                self.requests.append(raw.decode("utf-8", "replace"))
            return 400, _error_body(f"request body is not JSON: {err}", "invalid_request_error")
        with self._lock:
            self.requests.append(body)

        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return 400, _error_body("'messages' is required and must be a list", "invalid_request_error")
        if body.get("stream"):
            return 400, _error_body("the scripted model does not stream; send stream: false", "invalid_request_error")
        messages = body["messages"]
        if self.strict:
            problem = strict_violation(messages)
            if problem:
                return 400, _error_body(problem, "invalid_request_error", "invalid_value")
        turn_index = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        turns = self.script.turns
        if turn_index >= len(turns):
            return 400, _error_body(
                f"script {self.script.label!r} has {len(turns)} turns; the request asked for turn {turn_index + 1}"
                f" (it carries {turn_index} assistant messages)",
                "invalid_request_error",
            )
        turn = turns[turn_index]
        if turn.expect is not None:
            last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
            content = last.get("content")
            said: str = content if isinstance(content, str) else ""
            if turn.expect not in said:
                return 400, _error_body(
                    f"script {self.script.label!r} turn {turn_index + 1} expects the last message to contain"
                    f" {turn.expect!r}; it says {said[:200]!r}",
                    "invalid_request_error",
                )

        with self._lock:
            served = self._failures_served.get(turn_index, 0)
            if served < len(turn.fail):
                self._failures_served[turn_index] = served + 1
                status = turn.fail[served]
            else:
                status = 0
            self._seq += 1
            seq = self._seq
        if status:
            type_, code = _FAIL_BODIES.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
            try:
                phrase = HTTPStatus(status).phrase
            except ValueError:
                phrase = "error"
            return status, _error_body(
                f"scripted failure {served + 1} of {len(turn.fail)} for turn {turn_index + 1}: {status} {phrase}", type_, code
            )

        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.refusal is not None:
            message["refusal"] = turn.refusal
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.wire_arguments()}}
                for c in turn.tool_calls
            ]
        if turn.usage is not None:
            prompt, completion = turn.usage.prompt_tokens, turn.usage.completion_tokens
            total = turn.usage.total_tokens if turn.usage.total_tokens is not None else prompt + completion
        else:
            prompt = _estimate_tokens({"messages": messages, "tools": body.get("tools") or []})
            completion = _estimate_tokens(message)
            total = prompt + completion
        return 200, {
            "id": f"chatcmpl-scripted-{turn_index}-{seq}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.script.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if turn.tool_calls else "stop",
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total},
        }


def strict_violation(messages: list[Any]) -> str | None:
    """Why OpenAI would reject a request with these ``messages`` (HTTP 400), or None.

    Checked: a tool-call id used twice among the assistant messages' ``tool_calls`` (anywhere in
    the request); a ``tool`` message whose ``tool_call_id`` answers no call of the assistant
    message before it; an assistant message with calls not all answered by the ``tool`` messages
    that follow it.
    """
    seen: dict[str, int] = {}
    open_calls: set[str] | None = None  # ids of the last assistant message's calls not answered yet
    open_at = -1
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"Invalid value for 'messages[{i}]': expected an object"
        role = m.get("role")
        if role == "tool":
            tcid = m.get("tool_call_id")
            if open_calls is None or tcid not in open_calls:
                return (
                    f"Invalid parameter: messages with role 'tool' must be a response to a preceding message with"
                    f" 'tool_calls' (messages[{i}].tool_call_id {tcid!r})"
                )
            open_calls.discard(tcid)
            continue
        if open_calls:
            return (
                f"An assistant message with 'tool_calls' must be followed by tool messages responding to each"
                f" 'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(sorted(open_calls))}"
                f" (messages[{open_at}])"
            )
        open_calls = None
        if role == "assistant" and m.get("tool_calls"):
            open_calls, open_at = set(), i
            for j, call in enumerate(m["tool_calls"]):
                cid = call.get("id") if isinstance(call, dict) else None
                if not cid:
                    return f"Missing required parameter: 'messages[{i}].tool_calls[{j}].id'"
                if cid in seen:
                    return (
                        f"Invalid parameter: duplicate tool_call id {cid!r} in messages[{i}].tool_calls[{j}]"
                        f" (already used in messages[{seen[cid]}])"
                    )
                seen[cid] = i
                open_calls.add(cid)
    if open_calls:
        return (
            f"An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'."
            f" The following tool_call_ids did not have response messages: {', '.join(sorted(open_calls))} (messages[{open_at}])"
        )
    return None


# --------------------------------------------------------------------------------------------
# python -m agentfast.testing.scripted
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Serve a script in the foreground until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m agentfast.testing.scripted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", required=True, help="bundled script name (e.g. refund) or path to a script YAML")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a cluster); default 127.0.0.1")
    parser.add_argument("--port", type=int, default=8089, help="port to bind (0 picks a free one); default 8089")
    parser.add_argument(
        "--strict",
        action="store_true",
        default=None,
        help="reject requests OpenAI would reject (duplicate tool-call ids, unanswered calls); default: the script's strict",
    )
    parser.add_argument(
        "--require-key-env",
        metavar="VAR",
        default=None,
        help="answer 401 unless a request carries 'Authorization: Bearer' and the value of environment variable VAR"
        " (read from the environment, so the key is never on the command line)",
    )
    args = parser.parse_args(argv)
    api_key = None
    if args.require_key_env is not None:
        api_key = os.environ.get(args.require_key_env) or None
        if api_key is None:
            print(
                f"error: --require-key-env {args.require_key_env}: that environment variable is not set or empty",
                file=sys.stderr,
                flush=True,
            )
            return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        script = load_script(args.script)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = ScriptedModelServer(script, host=args.host, port=args.port, strict=args.strict, api_key=api_key)
    try:
        url = server.start()
    except OSError as err:
        print(f"error: cannot bind {args.host}:{args.port}: {err.strerror}", file=sys.stderr, flush=True)
        return 1
    keyed = ", key required" if api_key else ""
    print(
        f"scripted model {script.label!r} ({len(script.turns)} turns, model {script.model!r}{keyed}) serving at {url}", flush=True
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
