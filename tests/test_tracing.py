"""Traces (issue 18 item 2): one trace per run across process deaths, off unless an OTLP endpoint is set.

The process test runs the refund example in real runner processes, SIGKILLs it twice and resumes
it each time, with the real OTLP/HTTP exporter sending to a collector in this test (an
``http.server`` decoding ``ExportTraceServiceRequest`` with opentelemetry-proto): the spans of
all three processes form one trace, one tree, whose tool spans are the journal's rows.

    pytest tests/test_tracing.py -q
"""

from __future__ import annotations

import gzip
import http.server
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentfast.runner import tracing
from agentfast.runner.snapshot import RunContext, Session, StateSnapshot, TraceContext
from agentfast.runner.store import Store

from .conformance import LANGGRAPH, VANILLA, Adapter
from .helpers import agentrun_file, phase_of, run_cli, spawn_cli, wait_until

RUN_ID = "default/refund-demo"
OTEL_ENVS = (*tracing.ENDPOINT_ENVS, "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER")


# -- a collector: the OTLP/HTTP receiving end ---------------------------------------------------


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a span with no parent
    name: str
    attrs: dict[str, Any]
    error: bool
    start_ns: int
    end_ns: int
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (trace id, span id, attributes)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Collector:
    """Receives OTLP/HTTP protobuf trace exports on ``endpoint``; ``spans`` in arrival order."""

    endpoint: str = ""
    spans: list[Span] = field(default_factory=list)
    requests: int = 0

    def receive(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.proto.trace.v1.trace_pb2 import Status

        req = ExportTraceServiceRequest.FromString(body)
        self.requests += 1
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        Span(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            attrs={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == Status.STATUS_CODE_ERROR,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            links=[
                                (x.trace_id.hex(), x.span_id.hex(), {a.key: _value(a.value) for a in x.attributes})
                                for x in s.links
                            ],
                        )
                    )


@pytest.fixture
def collector() -> Iterator[Collector]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    got = Collector()
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            status = 404
            if self.path == "/v1/traces":
                with lock:
                    got.receive(body)
                status = 200
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    got.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield got
    server.shutdown()
    server.server_close()


# -- the process test -----------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [VANILLA, LANGGRAPH], ids=lambda a: a.name)
@pytest.mark.process
def test_a_run_killed_twice_is_one_trace_with_its_resumes_as_spans(
    tmp_path: Path, dsn: str, store: Store, collector: Collector, adapter: Adapter
) -> None:
    """The same refund run on both adapters: they reach the model and the tools through the core
    (RunnerBase.model_turn, CallExecutor.execute), so their traces agree but for one span."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_SERVICE_NAME": "agentfast-test"}
    run_id, run_name = adapter.run_id, adapter.run_name
    path = agentrun_file(tmp_path, adapter.example)

    # Attempt 0 (resume 0): lookup_order runs, then the process dies before its result is persisted.
    first = run_cli("run", str(path), dsn=dsn, fault="tool.after_call:lookup_order", env=env)
    assert first.returncode == -signal.SIGKILL, first.stdout
    # Attempt 1 (resume 1): re-runs lookup_order with its key, runs add_case_note, waits for the
    # refund's approval, runs the refund and dies before its result is persisted.
    second = spawn_cli("resume", run_name, dsn=dsn, fault="tool.after_call:issue_refund", env=env)
    wait_until(lambda: phase_of(store, run_id) == "WaitingForApproval", what="the refund to await approval")
    store.decide(run_id, "call-2-0", "approve", decided_by="test")
    out, _ = second.communicate(timeout=60)
    assert second.returncode == -signal.SIGKILL, out
    # Attempt 2 (resume 2): the refund's recovery check finds it done; the model answers; the run ends.
    third = run_cli("resume", run_name, dsn=dsn, env=env)
    assert third.returncode == 0, third.stdout

    snap = store.load_snapshot(run_id)
    assert snap is not None and snap.context.status.phase == "Succeeded" and snap.context.counters.resumes == 2
    stored = snap.context.trace
    assert stored is not None
    spans = collector.spans

    # One trace: every span of the three processes, and the id the checkpoint keeps.
    assert {s.trace_id for s in spans} == {stored.trace_id}
    # One tree: a single root, the stored one; every other span's parent was exported too.
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans), "a span was exported twice"
    [root] = [s for s in spans if not s.parent_id]
    assert root.span_id == stored.root_span_id and root.name == f"invoke_agent {run_name}"
    assert root.attrs["gen_ai.operation.name"] == "invoke_agent" and root.attrs["agentfast.phase"] == "Succeeded"
    assert root.attrs["gen_ai.usage.input_tokens"] == 182 + 291 + 402
    assert root.attrs["gen_ai.usage.output_tokens"] == 21 + 68 + 63
    assert [s for s in spans if s.parent_id and s.parent_id not in by_id] == []
    # ... and a span lies within its parent's time, a killed attempt's too (ended when its next heartbeat was due).
    outside = [
        (s.name, by_id[s.parent_id].name)
        for s in spans
        if s.parent_id and not by_id[s.parent_id].start_ns <= s.start_ns <= s.end_ns <= by_id[s.parent_id].end_ns
    ]
    assert outside == []

    def attempt_of(s: Span) -> Span:
        while s.name != "agentfast.run.attempt":
            s = by_id[s.parent_id]
        return s

    # Three attempts under the root, resumes 0, 1, 2; the two killed ones recorded by their successors.
    attempts = sorted((s for s in spans if s.name == "agentfast.run.attempt"), key=lambda s: s.attrs["agentfast.attempt.resume"])
    assert [a.attrs["agentfast.attempt.resume"] for a in attempts] == [0, 1, 2]
    assert all(a.parent_id == root.span_id for a in attempts)
    assert [a.error for a in attempts] == [True, True, False]
    assert [
        a.attrs.get("agentfast.attempt.recorded_by") == attempts[i + 1].attrs["agentfast.runner_id"]
        for i, a in enumerate(attempts[:2])
    ] == [True, True]
    assert attempts[2].attrs["agentfast.outcome.phase"] == "Succeeded" and attempts[2].attrs["agentfast.exit_code"] == 0
    assert [a.attrs["agentfast.epoch"] for a in attempts] == sorted({a.attrs["agentfast.epoch"] for a in attempts})
    assert attempts[0].start_ns <= attempts[0].end_ns <= attempts[1].start_ns <= attempts[1].end_ns <= attempts[2].start_ns
    resume_of = {a.span_id: a.attrs["agentfast.attempt.resume"] for a in attempts}

    # Model calls: one chat span per call the model really got, under the attempt that made it,
    # with the script's token counts (testing/scripts/refund.yaml); iteration 1's reply was
    # persisted before the first kill, so no attempt asked for it again.
    chats = sorted((s for s in spans if s.attrs.get("gen_ai.operation.name") == "chat"), key=lambda s: s.start_ns)
    assert [(s.name, s.attrs["agentfast.iteration"], resume_of[attempt_of(s).span_id]) for s in chats] == [
        ("chat scripted-refund", 1, 0),
        ("chat scripted-refund", 2, 1),
        ("chat scripted-refund", 3, 2),
    ]
    assert [(s.attrs["gen_ai.usage.input_tokens"], s.attrs["gen_ai.usage.output_tokens"]) for s in chats] == [
        (182, 21),
        (291, 68),
        (402, 63),
    ]
    assert all(
        s.attrs["gen_ai.request.model"] == "scripted-refund" and s.attrs["gen_ai.provider.name"] == "openai" for s in chats
    )
    assert [s.attrs["gen_ai.response.finish_reasons"] for s in chats] == [["tool_calls"], ["tool_calls"], ["stop"]]
    assert all(by_id[s.parent_id].name == "agentfast.iteration" for s in chats)

    # Tool calls: each execute_tool span is a tool body that ran, under the attempt that ran it,
    # carrying its journal row's ids. lookup_order ran in attempt 0 (killed before its result
    # was kept) and again, with the same key, in attempt 1; the refund ran once, in attempt 1:
    # attempt 2's recovery check found it done and did not run it.
    journal = {e.call_id: e for e in store.journal(run_id)}
    tools = sorted((s for s in spans if s.attrs.get("gen_ai.operation.name") == "execute_tool"), key=lambda s: s.start_ns)
    assert [(s.name, s.attrs["agentfast.call_id"], resume_of[attempt_of(s).span_id]) for s in tools] == [
        ("execute_tool lookup_order", "call-1-0", 0),
        ("execute_tool lookup_order", "call-1-0", 1),
        ("execute_tool add_case_note", "call-2-1", 1),
        ("execute_tool issue_refund", "call-2-0", 1),
    ]
    for s in tools:
        row = journal[s.attrs["agentfast.call_id"]]
        assert s.attrs["agentfast.idempotency_key"] == row.idempotency_key
        assert s.attrs["gen_ai.tool.call.id"] == row.tool_call.id and s.attrs["gen_ai.tool.name"] == row.tool_call.name
        assert by_id[s.parent_id].attrs["agentfast.iteration"] == row.iteration
    assert [s.attrs["agentfast.tool.attempt"] for s in tools] == [1, 2, 1, 1]
    assert journal["call-2-0"].result.recorded_by == "recovery_check" and journal["call-1-0"].attempts == 2

    # The wait for the human: a span of attempt 1, in iteration 2, naming the awaited call, that
    # ended when the approved refund started.
    [wait] = [s for s in spans if s.name == "agentfast.await_decision"]
    assert wait.attrs["agentfast.call_ids"] == ["call-2-0"] and resume_of[attempt_of(wait).span_id] == 1
    assert by_id[wait.parent_id].attrs["agentfast.iteration"] == 2
    assert wait.end_ns <= tools[3].start_ns

    # Each iteration an attempt worked on is one span; the killed attempts' open ones were recorded
    # for them. Attempt 2 of the vanilla loop re-enters iteration 2 (it reads back the persisted
    # reply to settle the refund); LangGraph resumes inside the tool node, whose recovery check opens none.
    resumed_iteration_2 = [(2, 2, False)] if adapter is VANILLA else []
    iterations = sorted(
        (resume_of[attempt_of(s).span_id], s.attrs["agentfast.iteration"], s.error)
        for s in spans
        if s.name == "agentfast.iteration"
    )
    assert iterations == [(0, 1, True), (1, 1, False), (1, 2, True), *resumed_iteration_2, (2, 3, False)]


@pytest.mark.process
def test_a_runner_that_exits_exports_its_own_attempt_once(tmp_path: Path, dsn: str, store: Store, collector: Collector) -> None:
    """A pause (exit 0, no wait) and a resume: the first runner deleted its heartbeat row on its
    way out, so the second does not record its attempt again (no span twice, nothing marked dead)."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint}
    paused = run_cli("run", str(agentrun_file(tmp_path)), "--no-wait", dsn=dsn, env=env)
    assert paused.returncode == 0 and "call-2-0" in paused.stdout, paused.stdout
    store.decide(RUN_ID, "call-2-0", "approve", decided_by="test")
    done = run_cli("resume", "refund-demo", dsn=dsn, env=env)
    assert done.returncode == 0, done.stdout

    spans = collector.spans
    assert len({s.span_id for s in spans}) == len(spans) and len({s.trace_id for s in spans}) == 1
    attempts = sorted((s for s in spans if s.name == "agentfast.run.attempt"), key=lambda s: s.start_ns)
    assert [(a.attrs["agentfast.attempt.resume"], a.attrs["agentfast.outcome.phase"], a.error) for a in attempts] == [
        (0, "WaitingForApproval", False),
        (1, "Succeeded", False),
    ]
    assert not any("agentfast.attempt.recorded_by" in a.attrs for a in attempts)
    assert [s for s in spans if s.error] == []
    assert [s.name for s in spans if not s.parent_id] == ["invoke_agent refund-demo"]
    # No wait span: the first runner did not wait (--no-wait), the second found the decision made.
    assert [s for s in spans if s.name == "agentfast.await_decision"] == []


def _run_with_importtime(tmp_path: Path, dsn: str, **otel: str) -> str:
    """``agentfast run`` of the refund example to its pause, under ``-X importtime``, with only
    the OTEL_* variables given: its output, stderr (the importtime lines) merged in."""
    env = {**{k: "" for k in OTEL_ENVS}, **otel, "PYTHONPROFILEIMPORTTIME": "1"}
    done = run_cli("run", str(agentrun_file(tmp_path)), "--no-wait", dsn=dsn, env=env)
    assert done.returncode == 0 and "call-2-0" in done.stdout, done.stdout[-3000:]
    assert "agentfast.runner.tracing" in done.stdout  # the importtime lines are there
    return done.stdout


@pytest.mark.process
def test_without_an_endpoint_a_run_imports_no_opentelemetry(tmp_path: Path, dsn: str, store: Store) -> None:
    """Off by default: the whole run, in the real CLI process, never imports an opentelemetry
    module and keeps no trace in its checkpoint."""
    out = _run_with_importtime(tmp_path, dsn)
    assert "opentelemetry" not in out
    assert store.load_snapshot(RUN_ID).context.trace is None


@pytest.mark.process
def test_with_an_endpoint_the_same_run_is_traced(tmp_path: Path, dsn: str, store: Store) -> None:
    """The control of the test above: with an endpoint (where nothing listens: exports fail
    quietly, the run is unaffected) the SDK is imported and the checkpoint keeps the trace."""
    out = _run_with_importtime(tmp_path, dsn, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9/v1/traces")
    assert "opentelemetry.sdk.trace" in out
    trace = store.load_snapshot(RUN_ID).context.trace
    assert trace is not None and trace.attempt is not None and trace.attempt.resume == 0


# -- units --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_tracing_is_on_only_with_an_endpoint_and_not_disabled(env: dict[str, str], on: bool) -> None:
    assert tracing.enabled(env) is on


def test_the_no_op_tracer_imports_nothing_of_opentelemetry() -> None:
    env = {k: v for k, v in os.environ.items() if k not in OTEL_ENVS and k != "AGENTFAST_FAULT"}
    code = (
        "import sys\n"
        "from agentfast.runner import loop, journal, tracing\n"
        "t = tracing.run_tracer('default/r', 'u')\n"
        "with t.chat(1, 'm') as c: pass\n"
        "print(type(t).__name__, sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["RunTracer", "[]"]


def test_trace_ids_are_w3c_hex_and_iteration_span_ids_are_derived() -> None:
    t = tracing.new_trace_context()
    assert len(t.trace_id) == 32 and len(t.root_span_id) == 16 and int(t.trace_id, 16) and int(t.root_span_id, 16)
    assert tracing.iteration_span_id("00f067aa0ba902b7", 3) == tracing.iteration_span_id("00f067aa0ba902b7", 3)
    assert tracing.iteration_span_id("00f067aa0ba902b7", 3) != tracing.iteration_span_id("00f067aa0ba902b7", 4)
    assert len(tracing.iteration_span_id("00f067aa0ba902b7", 3)) == 16


def test_a_snapshot_keeps_its_trace_and_one_without_loads_as_untraced() -> None:
    ctx = RunContext(session=Session(run_uid="u"), trace=TraceContext(trace_id="a" * 32, root_span_id="b" * 16))
    snap = StateSnapshot(run_id="default/r", context=ctx)
    again = StateSnapshot.model_validate_json(snap.model_dump_json())
    assert again.context.trace == ctx.trace
    old = snap.model_dump(mode="json")
    del old["context"]["trace"]
    assert StateSnapshot.model_validate(old).context.trace is None


@pytest.mark.process
def test_a_fork_is_a_trace_of_its_own_linked_to_its_sources(tmp_path: Path, dsn: str, store: Store, collector: Collector) -> None:
    """Issue 31 item 6: the fork's spans are never in its source's trace (nor children of its
    spans): a trace of its own whose root and attempt spans link to the source's root span."""
    from .test_fork import overrides_file

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint}
    paused = run_cli("run", str(agentrun_file(tmp_path)), "--no-wait", dsn=dsn, env=env)
    assert paused.returncode == 0, paused.stdout
    store.decide(RUN_ID, "call-2-0", "approve", decided_by="test")
    assert run_cli("resume", "refund-demo", dsn=dsn, env=env).returncode == 0
    source_spans = list(collector.spans)
    [src_trace] = {s.trace_id for s in source_spans}
    [src_root] = [s.span_id for s in source_spans if not s.parent_id]
    src_ids = {s.span_id for s in source_spans}

    got = run_cli("fork", "refund-demo", "--at", "2", "--name", "refund-fork", "-f", str(overrides_file(tmp_path)), dsn=dsn)
    assert got.returncode == 0, got.stdout
    link = store.load_context("default/refund-fork")[0].trace_link
    assert link is not None and (link.trace_id, link.span_id) == (src_trace, src_root)
    assert store.load_context("default/refund-fork")[0].trace is None  # not the source's trace
    done = run_cli("resume", "refund-fork", dsn=dsn, env=env)
    assert done.returncode == 0, done.stdout

    fork_spans = collector.spans[len(source_spans) :]
    assert fork_spans and all(s.attrs.get("agentfast.run_id") in (None, "default/refund-fork") for s in fork_spans)
    [fork_trace] = {s.trace_id for s in fork_spans}
    assert fork_trace != src_trace
    assert not any(s.parent_id in src_ids for s in fork_spans)  # never a child of a source span
    [root] = [s for s in fork_spans if not s.parent_id]
    attempts = [s for s in fork_spans if s.name == "agentfast.run.attempt"]
    assert root.name == "invoke_agent refund-fork" and len(attempts) == 1
    for s in (root, *attempts):
        assert [(t, i) for t, i, _ in s.links] == [(src_trace, src_root)], s
        attrs = s.links[0][2]
        assert attrs["agentfast.link"] == "forked_from" and attrs["agentfast.forked_from.run_id"] == RUN_ID
        assert attrs["agentfast.forked_from.iteration"] == 2
    # Its first start is not a resume.
    assert attempts[0].attrs["agentfast.attempt.resume"] == 0 and root.attrs["agentfast.resumes"] == 0
    # The source's own spans link nowhere.
    assert not any(s.links for s in source_spans)
