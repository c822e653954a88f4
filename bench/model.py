"""Part ``model``: the client-side cost of one model call as the transcript grows (issue 15, item 4).

The scripted model server runs in its own process (``python -m agentfast.testing.scripted``), so
``time.process_time()`` in this process is the client's CPU alone: building the request body,
the openai client's request handling and HTTP, parsing the reply. Two paths on the same client,
the same transcripts and the same server, interleaved round by round:

- ``new``: :meth:`OpenAIChatModel.complete` as the runner calls it, in a growing run: each
  measured call at ``n`` messages follows an unmeasured one at ``n - 3`` (one iteration earlier:
  an assistant message and two tool results), so the body cache holds what a real run's would.
- ``old``: what complete() did before: ``client.chat.completions.create(**request_params)``
  (the SDK's per-call transform and dump of the whole transcript), then the same reply parsing.
- ``post``: the SDK's transport alone: the same body bytes, built beforehand, through the
  client's ``post`` as complete() sends them (what is left once serialising costs nothing).
- ``floor``: the least any client pays for the same call: the same body bytes, built beforehand,
  POSTed with ``http.client`` on a kept-alive connection, the reply read and ``json.loads``-ed.
  Its growth is what the bytes on the wire (a kernel copy, loopback TCP) and the longer wait for
  the server (colder CPU caches after it) cost by themselves.

Per round and length, a sample is the median of ``calls`` calls; the growth is, per round, the
sample at the longest transcript over the one at the shortest (median and range over rounds).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .stats import Spread

REPO = Path(__file__).resolve().parent.parent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look an order up by id.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "refund",
            "description": "Refund an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "amount_cents": {"type": "integer"}},
                "required": ["order_id", "amount_cents"],
            },
        },
    },
]


@dataclass
class ModelCallConfig:
    """``lengths``: transcript lengths in messages (the first and last give the growth);
    ``rounds``: interleaved repetitions; ``calls``: calls per sample (its median is the sample)."""

    lengths: list[int]
    rounds: int
    calls: int


@dataclass
class ModelCallResult:
    """Per path (``"new"``, ``"old"``, ``"post"``, ``"floor"``) and length: one CPU sample (ms) and one wall sample (ms) per
    round; ``body_bytes``: the request body's size by length."""

    config: ModelCallConfig
    cpu_ms: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    wall_ms: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    body_bytes: dict[int, int] = field(default_factory=dict)

    def growth(self, path: str) -> Spread:
        """Per round, client CPU at the longest length over that at the shortest: median and range."""
        lo, hi = min(self.config.lengths), max(self.config.lengths)
        c = self.cpu_ms[path]
        return Spread.of([b / a for a, b in zip(c[lo], c[hi])])


def transcript(n: int) -> list[Any]:
    """``n`` messages of a support run: system, user, then per iteration an assistant message with
    two tool calls and their two results (~300 bytes each)."""
    from agentfast.runner.snapshot import Message, ToolCall

    msgs = [
        Message(role="system", content="You are a support agent. Look every order up and refund duplicate charges."),
        Message(role="user", content="Please check all my recent orders for duplicate charges."),
    ]
    i = 0
    while len(msgs) < n:
        i += 1
        a, b = f"call_{i}_a", f"call_{i}_b"
        msgs.append(
            Message(
                role="assistant",
                content="Checking the order and its charges.",
                tool_calls=[
                    ToolCall(id=a, name="lookup", arguments=json.dumps({"order_id": f"A-{1000 + i}"})),
                    ToolCall(id=b, name="lookup", arguments=json.dumps({"order_id": f"B-{1000 + i}"})),
                ],
            )
        )
        for cid, order in ((a, f"A-{1000 + i}"), (b, f"B-{1000 + i}")):
            msgs.append(
                Message(
                    role="tool",
                    tool_call_id=cid,
                    name="lookup",
                    content=json.dumps(
                        {
                            "order_id": order,
                            "status": "charged",
                            "amount_cents": 4999,
                            "currency": "EUR",
                            "charges": [
                                {"id": f"ch_{i}_{k}", "at": "2026-11-30T12:00:00Z", "amount_cents": 4999} for k in range(2)
                            ],
                            "customer": {"name": "Zoë Example", "email": "zoe@example.com"},
                        }
                    ),
                )
            )
    return msgs[:n]


class _Server:
    """The scripted model server in its own process, on a free local port."""

    def __init__(self, workdir: Path, turns: int):
        script = workdir / "model-bench-script.json"  # JSON is YAML
        script.write_text(
            json.dumps(
                {
                    "model": "scripted-bench",
                    "turns": [{"content": "ok", "usage": {"prompt_tokens": 900, "completion_tokens": 2}} for _ in range(turns)],
                }
            )
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentfast.testing.scripted", "--script", str(script), "--port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if "serving at" not in line:
            self.stop()
            raise RuntimeError(f"scripted model server did not start: {line!r}")
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run(workdir: Path, config: ModelCallConfig, log: Callable[[str], None]) -> ModelCallResult:
    """Measure both paths at every length; see the module docstring. Raises RuntimeError when the
    server does not start, ModelError when a call fails."""
    from agentfast.runner.model import OpenAIChatModel

    longest = max(config.lengths)
    server = _Server(workdir, longest // 3 + 5)
    paths = ("new", "old", "post", "floor")
    res = ModelCallResult(
        config, {p: {n: [] for n in config.lengths} for p in paths}, {p: {n: [] for n in config.lengths} for p in paths}
    )
    transcripts = {n: transcript(n) for n in config.lengths}
    try:
        with OpenAIChatModel(base_url=server.base_url, api_key="bench", model="scripted-bench", max_retries=0) as model:
            client = model.client()

            def new(msgs: list[Any]) -> None:
                model.complete(msgs, TOOLS)

            def old(msgs: list[Any]) -> None:
                model._reply(client.chat.completions.create(**model.request_params(msgs, TOOLS)))

            host, port = server.base_url.split("//", 1)[1].split("/", 1)[0].split(":")
            raw = http.client.HTTPConnection(host, int(port), timeout=60)
            bodies: dict[int, bytes] = {}
            headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}

            def post(msgs: list[Any]) -> None:
                from openai._base_client import make_request_options
                from openai.types.chat import ChatCompletion

                model._reply(
                    client.post(
                        "/chat/completions",
                        cast_to=ChatCompletion,
                        content=bodies[len(msgs)],
                        options=make_request_options(security={"bearer_auth": True}),
                    )
                )

            def floor(msgs: list[Any]) -> None:
                raw.request("POST", "/v1/chat/completions", body=bodies[len(msgs)], headers=headers)
                reply = raw.getresponse()
                if reply.status != 200:
                    raise RuntimeError(f"floor request: HTTP {reply.status}")
                json.loads(reply.read())

            for n, msgs in transcripts.items():  # warm every path (connection, lazy imports, caches)
                new(msgs)
                old(msgs)
                bodies[n] = model._wire.body(model.model, msgs, model._fields(TOOLS))
                res.body_bytes[n] = len(bodies[n])
                floor(msgs)
            for _round in range(config.rounds):
                for n, msgs in transcripts.items():
                    for path, call in (("new", new), ("old", old), ("post", post), ("floor", floor)):
                        cpu, wall = [], []
                        for _ in range(config.calls if path != "old" else 1):  # old: ~1 s a call at 3,000
                            if path == "new":
                                new(msgs[:-3])  # the iteration before: the cache holds all but the last three
                            c0, w0 = time.process_time(), time.perf_counter()
                            call(msgs)
                            cpu.append((time.process_time() - c0) * 1000)
                            wall.append((time.perf_counter() - w0) * 1000)
                        res.cpu_ms[path][n].append(statistics.median(cpu))
                        res.wall_ms[path][n].append(statistics.median(wall))
            lo, hi = min(config.lengths), max(config.lengths)
            raw.close()
            log(
                f"  model: client CPU growth {lo:,} -> {hi:,} messages: new {res.growth('new').fmt(2, 'x')}, "
                f"old {res.growth('old').fmt(1, 'x')}, post {res.growth('post').fmt(2, 'x')}, floor {res.growth('floor').fmt(2, 'x')}"
            )
    finally:
        server.stop()
    return res
