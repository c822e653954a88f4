"""The tool host: a child process that imports and runs a run's tools, without the runner's credentials.

Why a process of its own (G11: no tool receives the store's credential). A tool is code a model
drives with arguments it chose; a shell tool, a SQL tool or a prompt-injected customer message
could make it print its environment or read its process's memory. In the runner's process that
would hand over the runner's Postgres credential (``AGENTFAST_DSN``) and the model key
(``AGENTFAST_MODEL_API_KEY``): with them a tool could rewrite its own run's journal. So:

- the runner never imports a tool module; the host does (``python -m agentfast.runner.toolhost``)
  and tells the runner each tool's name, description, JSON schema and declarations;
- the host's environment is the runner's minus its credentials (:func:`tool_environment`), plus
  the tools' own settings: the files of ``AGENTFAST_TOOL_ENV_DIR`` (in a runner pod the Secret
  ``agentfast-tools`` of the run's namespace, mounted by the operator), one variable per file;
- the runner makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``, Linux): its
  ``/proc/PID/environ`` and ``/proc/PID/mem`` then belong to root, and a non-root process of the
  same user (the host, in a runner pod: uid 10001 without CAP_SYS_PTRACE) cannot read them (proc(5),
  "/proc/pid"; ptrace(2), "Ptrace access mode checking"). As root, on a developer's machine, the
  separation is the environment's only;
- the host dies with the runner (``PR_SET_PDEATHSIG``): a SIGKILLed runner takes its in-flight tool
  call with it, as when tools ran in-process, and G4 settles that call on resume.

Protocol: frames of a 4-byte big-endian length and a JSON object, over a socketpair. The runner
sends ``{"id", "op", ...}``; the host answers ``{"id", ...}``, one thread per ``invoke`` or
``recover`` (the LangGraph adapter runs sibling calls in parallel). Ops: ``load`` (the AgentRun:
answers ``tools`` or ``error``), ``parse`` (validate a call's arguments), ``invoke``, ``recover``.

A host that dies or stops answering mid-call raises :class:`ToolHostLost`: the runner exits
"retry me" (75) without recording a result, because the call's effect may have happened; the resume
treats the call as in flight (G4).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import boundedjson
from .errors import AgentfastError, CallOutcomeUnknown
from .spec import MODEL_API_KEY_ENV, AgentRun, SpecError
from .tools import Recovery, ToolArgumentsError, ToolContext, ToolRegistry

log = logging.getLogger("agentfast.toolhost")

#: Where a runner pod finds its tools' own settings, one variable per file (the operator mounts the
#: namespace's Secret ``agentfast-tools`` there); unset or missing: none.
TOOL_ENV_DIR_ENV = "AGENTFAST_TOOL_ENV_DIR"
#: Variables the host never receives: the runner's credentials, and where the local store keeps
#: its password (``AGENTFAST_HOME``: runner/embedded.py). Nor any of libpq's (:data:`LIBPQ_ENV_PREFIX`).
CREDENTIAL_ENV = frozenset(
    {
        "AGENTFAST_DSN",
        MODEL_API_KEY_ENV,
        "AGENTFAST_TEST_DSN",
        "AGENTFAST_HOME",
        "DATABASE_URL",
        "PGPASSWORD",
        "PGPASSFILE",
        "PGSERVICEFILE",
        "PGSERVICE",
    }
)
#: libpq reads its defaults from ``PG*`` variables (PGHOST names a server or a socket directory,
#: PGPASSWORD/PGPASSFILE a credential, PGSERVICEFILE a file of both): none reaches a tool, so a
#: tool's connection without settings of its own goes to no server of ours.
LIBPQ_ENV_PREFIX = "PG"
#: Names a tool setting may not take: they would change how the host's Python itself starts.
_RESERVED_PREFIXES = ("AGENTFAST_", "PYTHON", "LD_")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FRAME = struct.Struct(">I")
#: The largest frame: what its length header can say (a tool's result may be up to the payload limit).
_FRAME_MAX_BYTES = 2**32 - 1
#: The deepest frame: a value already held to 64 levels (a spec, a tool's result), inside the frame's own few.
_FRAME_MAX_DEPTH = 2 * boundedjson.MAX_DEPTH
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4


class ToolHostLost(AgentfastError):
    """The tool host died or its connection broke: a call in flight may or may not have taken
    effect. Never recorded as the call's result; the runner exits 75 and the resume settles it."""


class ToolRaised(AgentfastError):
    """A tool (or its recovery check) raised in the host; ``type_name`` is the original type's."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def tool_environment(env: dict[str, str], *, secrets: tuple[str, ...] = (), tool_env_dir: str | None = None) -> dict[str, str]:
    """The host's environment: ``env`` without :data:`CREDENTIAL_ENV`, without libpq's
    variables (names starting :data:`LIBPQ_ENV_PREFIX`) and without any variable whose value
    contains one of ``secrets`` (non-empty strings: the store password, the model key, the local
    store's password file), plus one variable per regular file of ``tool_env_dir`` (default:
    ``env[AGENTFAST_TOOL_ENV_DIR]``). MCP servers the host starts inherit it.

    A file is skipped, with a warning, when its name is not an environment variable name, starts
    with AGENTFAST_, PYTHON or LD_, or its content holds one of ``secrets``.
    """
    secrets = tuple(s for s in secrets if s)

    def leaks(value: str) -> bool:
        return any(s in value for s in secrets)

    out = {k: v for k, v in env.items() if k not in CREDENTIAL_ENV and not k.startswith(LIBPQ_ENV_PREFIX) and not leaks(v)}
    directory = tool_env_dir if tool_env_dir is not None else env.get(TOOL_ENV_DIR_ENV, "")
    if directory and os.path.isdir(directory):
        for path in sorted(Path(directory).iterdir()):
            name = path.name
            if name.startswith(".") or not path.is_file():
                continue  # a mounted Secret's ..data links and timestamped dirs
            if not _ENV_NAME.match(name) or name.startswith(_RESERVED_PREFIXES):
                log.warning("tool setting %s skipped: not a variable name a tool may have", name)
                continue
            value = path.read_text(errors="replace")
            if leaks(value):
                log.warning("tool setting %s skipped: it holds the runner's credential", name)
                continue
            out[name] = value
    return out


def make_undumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)`` on this process (Linux; a no-op elsewhere): its /proc files
    become root's, so a non-root process of the same user cannot read its environment or memory."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    try:
        data = json.dumps(msg, default=str).encode()
    except (ValueError, RecursionError) as err:  # a value a tool returned, nested past the encoder's recursion
        answer = {"raised": {"type": type(err).__name__, "message": f"the tool's answer cannot be sent: {err}"}}
        data = json.dumps({"id": msg.get("id", -1), **answer}).encode()
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv(sock: socket.socket) -> dict[str, Any] | None:
    """One frame, or None at end of stream."""
    head = _read_exact(sock, _FRAME.size)
    if head is None:
        return None
    body = _read_exact(sock, _FRAME.unpack(head)[0])
    if body is None:
        return None
    # Bounded (runner/boundedjson.py): a frame from a hostile tool host cannot recurse the runner
    # away; a refused one is a ValueError, which ToolHost._read takes as a broken connection.
    frame: dict[str, Any] = boundedjson.loads(
        body, what="a tool host frame", max_bytes=_FRAME_MAX_BYTES, max_depth=_FRAME_MAX_DEPTH
    )
    return frame


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class RemoteTool:
    """A tool as the runner sees it: its declarations, and calls that run in the host.

    Same surface as :class:`agentfast.runner.tools.Tool` for the journal: ``name``,
    ``description``, ``idempotent``, ``requires_approval``, ``schema``, ``recovery`` (a callable or
    None), :meth:`parse_arguments` and :meth:`invoke`.
    """

    def __init__(self, host: ToolHost, info: dict[str, Any]):
        self._host = host
        self.name: str = info["name"]
        self.description: str = info["description"]
        self.idempotent: bool = info["idempotent"]
        self.requires_approval: bool = info["requires_approval"]
        self.schema: dict[str, Any] = info["schema"]
        self.recovery = self._recover if info["has_recovery"] else None

    def parse_arguments(self, raw: str) -> str:
        """Check the model's raw JSON arguments against the tool's signature (in the host).
        Returns ``raw``, to hand to :meth:`invoke`, which parses it there. Raises
        ToolArgumentsError, ToolHostLost."""
        answer = self._host.request("parse", tool=self.name, arguments=raw)
        if "bad_arguments" in answer:
            raise ToolArgumentsError(answer["bad_arguments"])
        return raw

    def invoke(self, ctx: ToolContext, arguments: str) -> str:
        """Run the tool in the host; returns its result as text. Raises ToolRaised (the tool's
        own exception, by type name and message) or ToolHostLost."""
        answer = self._host.request("invoke", tool=self.name, arguments=arguments, ctx=asdict(ctx))
        if "lost" in answer:  # an MCP call got no answer: its effect may have happened (runner/mcp.py)
            raise ToolHostLost(answer["lost"])
        if "raised" in answer:
            raise ToolRaised(answer["raised"]["type"], answer["raised"]["message"])
        content: str = answer["content"]
        return content

    def _recover(self, ctx: ToolContext) -> Recovery:
        answer = self._host.request("recover", tool=self.name, ctx=asdict(ctx))
        if "raised" in answer:
            raise ToolRaised(answer["raised"]["type"], answer["raised"]["message"])
        return Recovery(answer["status"], answer.get("result"))


class ToolHost:
    """The runner's side of one tool host process. Thread-safe: calls from several threads are
    multiplexed by request id. Use :meth:`spawn`, then :meth:`registry`; :meth:`close` at the end."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket):
        self._proc = proc
        self._sock = sock
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[int, list[Any]] = {}  # id -> [Event, answer]
        self._next_id = 1
        self._lost: str | None = None
        with self._lock:
            self._load = self._register(0)
        self._reader = threading.Thread(target=self._read, name="toolhost-reader", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(cls, run: AgentRun, *, secrets: tuple[str, ...] = ()) -> ToolHost:
        """Start a host for ``run``'s tools (it imports them at once, while the runner goes on).

        Call it from the thread that outlives the run (the main thread): the host is killed when
        that thread ends (``PR_SET_PDEATHSIG`` follows the thread that forked it). ``secrets``: the
        values no variable of the host may contain (:func:`tool_environment`). Makes this process
        non-dumpable (:func:`make_undumpable`).
        """
        make_undumpable()
        ours, theirs = socket.socketpair()
        env = tool_environment(dict(os.environ), secrets=secrets)
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentfast.runner.toolhost", str(theirs.fileno()), str(os.getpid())],
            env=env,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else subprocess.DEVNULL,  # a tool's prints are log lines
        )
        theirs.close()
        host = cls(proc, ours)
        try:
            with host._send_lock:
                _send(ours, {"id": 0, "op": "load", "run": run.model_dump(mode="json", exclude_none=True)})
        except OSError as err:
            host._lose(f"the tool host did not start: {err}")
        return host

    def registry(self) -> ToolRegistry:
        """The run's tools, once the host has imported them. Raises SpecError naming the field (a
        ref that does not import, a gate removed, a module that raised on import), ToolHostLost."""
        answer = self._wait(0, self._load)
        if "error" in answer:
            raise SpecError(answer["error"])
        if "unavailable" in answer:  # an MCP server not reached: nothing ran; the run waits for a resume (exit 75)
            raise ToolHostLost(answer["unavailable"])
        return ToolRegistry([RemoteTool(self, info) for info in answer["tools"]])  # type: ignore[misc]

    def request(self, op: str, **payload: Any) -> dict[str, Any]:
        """Send one request and wait for its answer. Raises ToolHostLost."""
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            slot = self._register(rid)
        try:
            with self._send_lock:
                _send(self._sock, {"id": rid, "op": op, **payload})
        except OSError as err:
            self._lose(f"the tool host is gone: {err}")
        return self._wait(rid, slot)

    def close(self) -> None:
        """Stop the host (it exits at end of input; killed after 5 s)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    # -- internals ---------------------------------------------------------------------------

    def _register(self, rid: int) -> list[Any]:
        """A slot ``[Event, answer]`` for request ``rid``; the caller holds ``self._lock``."""
        slot: list[Any] = [threading.Event(), None]
        self._waiting[rid] = slot
        if self._lost is not None:  # the host is gone already: nothing will answer
            slot[0].set()
        return slot

    def _wait(self, rid: int, slot: list[Any]) -> dict[str, Any]:
        slot[0].wait()
        with self._lock:
            self._waiting.pop(rid, None)
        if slot[1] is None:
            raise ToolHostLost(self._lost or "the tool host is gone")
        answer: dict[str, Any] = slot[1]
        return answer

    def _read(self) -> None:
        try:
            while True:
                msg = _recv(self._sock)
                if msg is None:
                    break
                with self._lock:
                    slot = self._waiting.get(msg.get("id", -1))
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
        except (OSError, ValueError) as err:
            self._lose(f"the tool host's connection broke: {err}")
            return
        code = self._proc.wait()
        self._lose(f"the tool host exited (status {code})")

    def _lose(self, why: str) -> None:
        with self._lock:
            self._lost = self._lost or why
            for slot in self._waiting.values():
                slot[0].set()


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


# -- the host's side ---------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the runner died before the line above
        os._exit(1)


def _describe(registry: ToolRegistry) -> list[dict[str, Any]]:
    return [
        {
            "name": t.name,
            "description": t.description,
            "idempotent": t.idempotent,
            "requires_approval": t.requires_approval,
            "schema": t.schema,
            "has_recovery": t.recovery is not None,
        }
        for t in (registry.get(n) for n in registry.names)
        if t is not None
    ]


def _answer(registry: ToolRegistry, msg: dict[str, Any]) -> dict[str, Any]:
    tool = registry.get(msg["tool"])
    if tool is None:  # the runner only names tools the host listed
        return {"raised": {"type": "KeyError", "message": f"no tool {msg['tool']!r}"}}
    if msg["op"] == "parse":
        try:
            tool.parse_arguments(msg["arguments"])
            return {}
        except ToolArgumentsError as err:
            return {"bad_arguments": str(err)}
        except (Exception, SystemExit) as err:  # never the host's death: the model reads why (issue 30 item 4)
            return {"bad_arguments": f"arguments refused: {type(err).__name__}: {err}"}
    ctx = ToolContext(**msg["ctx"])
    try:
        if msg["op"] == "invoke":
            return {"content": tool.invoke(ctx, tool.parse_arguments(msg["arguments"]))}
        assert tool.recovery is not None
        found = tool.recovery(ctx)
        return {"status": found.status, "result": found.result}
    except CallOutcomeUnknown as err:  # an MCP call that got no answer (runner/mcp.py): it stays in flight (G4), never a result
        return {"lost": str(err)}
    except (Exception, SystemExit) as err:  # a tool that raises (or calls sys.exit) is a result the model can read
        return {"raised": {"type": type(err).__name__, "message": str(err)}}


def main(argv: list[str]) -> int:
    """``python -m agentfast.runner.toolhost FD PARENT_PID``: serve the runner on socket FD."""
    _die_with_parent(int(argv[1]))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the runner decides when a call stops: it finishes, then the runner exits
    sock = socket.socket(fileno=int(argv[0]))
    send_lock = threading.Lock()

    def reply(msg: dict[str, Any]) -> None:
        try:
            with send_lock:
                _send(sock, msg)
        except OSError:
            os._exit(0)  # the runner is gone

    load = _recv(sock)
    if load is None:
        return 0
    connections: Any = None  # the MCP servers' (runner/mcp.py), closed at the end
    try:
        run = AgentRun.model_validate(load["run"])
        registry = ToolRegistry.from_agentrun(run)
        if run.spec.mcpServers:  # only then is the SDK imported (runner/mcp.py)
            from .mcp import mcp_tools

            try:
                found, connections = mcp_tools(run, set(registry.names))
            except CallOutcomeUnknown as err:  # a server not reached (McpUnavailable): nothing ran
                reply({"id": 0, "unavailable": str(err)})
                return 0
            registry = ToolRegistry([*(t for t in (registry.get(n) for n in registry.names) if t is not None), *found])
        reply({"id": 0, "tools": _describe(registry)})
    except SpecError as err:
        reply({"id": 0, "error": str(err)})
        return 0
    except BaseException as err:  # a tool module that raises on import ends the run, never the runner (G12)
        reply({"id": 0, "error": f"spec.tools: importing the tools raised {type(err).__name__}: {err}"})
        return 0
    while True:
        msg = _recv(sock)
        if msg is None:
            if connections is not None:
                connections.close()  # each stdio server gets end of input and stops
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)  # not the interpreter's shutdown: it waits ~0.6 s for the SDK's threads
            return 0

        def serve(m: dict[str, Any] = msg) -> None:
            reply({"id": m["id"], **_answer(registry, m)})

        if msg["op"] == "parse":
            serve()
        else:
            threading.Thread(target=serve, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
