"""Traces of runs (OpenTelemetry): one trace per run, across process deaths.

Off unless an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``, the standard variables; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turn it off again). Off, :func:`run_tracer` returns :class:`RunTracer`,
whose hooks do nothing, and no ``opentelemetry`` module is imported: a run pays nothing. On, it
returns :class:`OtelRunTracer` (the ``otel`` extra: opentelemetry-sdk and the OTLP/HTTP exporter).

**One trace per run.** The first traced runner of a run picks its trace id and the id of its root
span and keeps them in the checkpoint (``RunContext.trace``), so every later runner process, a
resume after SIGKILL included, continues the same trace. The tree (names follow the OpenTelemetry
GenAI semantic conventions v1.41.0, development status)::

    invoke_agent <run name>            root: the whole run; emitted when the run ends (see below)
      agentfast.run.attempt            one per runner process: first start (resume 0) and every resume
        agentfast.iteration            one per iteration the attempt worked on
          chat <model>                 a model call: gen_ai.* request, usage, finish reasons
          execute_tool <tool>          a tool body ran: gen_ai.tool.*, agentfast.call_id, agentfast.idempotency_key
          agentfast.await_decision     the attempt waited for a human (approve, deny, complete, reply)

**A fork is a run of its own** (``agentfast fork``, ``spec.forkFrom``): ``Store.fork_run`` does not
copy its source's trace ids, so the fork's first traced runner starts a trace of its own; its root
span and its attempt spans carry a span link (``agentfast.link: forked_from``, with the source's run
id and the iteration) to the source's root span (``RunContext.trace_link``). Never a child of it.

The root span is emitted with its stored id by the runner that ends the run (Succeeded, Failed,
Cancelled by that runner); until then, and for a run ended by the operator, it is implicit: every
attempt names it as its parent. An attempt span is emitted when its process exits; a process that
dies (SIGKILL, OOM, node loss) cannot, so the takeover commit records the attempt (its span id,
start, runner id: ``RunContext.trace.attempt``) and the runner that takes over after a death emits
it (and the iteration it was in) with status ERROR, ending when its next heartbeat was due (it died
before; ``HEARTBEAT_S`` after the last one it wrote) or when the successor started, if earlier.
It tells a death from an exit by the heartbeat row the dead runner left behind (a runner that exits
clears its key: ``RunnerClaim.left_behind``). Iteration span ids derive from the attempt's span id
and the iteration number, so the successor can name the same span.

Spans are exported by a BatchSpanProcessor, flushed at every checkpoint commit and after every model
and tool span, so a SIGKILL loses at most the spans open at the time (a killed tool's own span, the
attempt's, recorded by the successor as above). A flush that takes longer than ``SLOW_FLUSH_S``
(collector slow or down) stops the flushes on the run's path for ``FLUSH_BACKOFF_S``; the batch
worker still exports in the background. Nothing here ever raises into a run: a tracing failure is
logged and the run goes on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final

from .liveness import HEARTBEAT_S
from .names import TERMINAL_PHASES
from .snapshot import AttemptTrace, StateSnapshot, TraceContext, TraceLink

if TYPE_CHECKING:
    from .model import ModelReply
    from .snapshot import ToolResult
    from .store import JournalEntry

log = logging.getLogger(__name__)

#: Either one configures the OTLP/HTTP exporter, and turns tracing on.
ENDPOINT_ENVS: Final = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
#: The GenAI semantic conventions version the span names and attributes follow.
SEMCONV_VERSION: Final = "1.41.0"
#: The provider name of every model (gen_ai.provider.name): the runtime speaks the OpenAI Chat
#: Completions API (to OpenAI, vLLM, Ollama, a LiteLLM proxy, the scripted model).
PROVIDER: Final = "openai"
SLOW_FLUSH_S: Final = 0.5
FLUSH_BACKOFF_S: Final = 60.0
#: Seconds an export request may take when OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT does not say
#: (the exporter's own default, 10 s, would hold a checkpoint that long when the collector is down).
DEFAULT_EXPORT_TIMEOUT_S: Final = 2.0


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether runs are traced: an OTLP endpoint is set and the SDK is not disabled (``env``:
    the environment to read, by default ``os.environ``)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(env.get(k, "").strip() for k in ENDPOINT_ENVS)


def new_trace_context() -> TraceContext:
    """A fresh trace id (32 hex digits) and root span id (16), never all zeros (W3C)."""
    return TraceContext(trace_id=_nonzero_hex(16), root_span_id=_nonzero_hex(8))


def _nonzero_hex(nbytes: int) -> str:
    while True:
        h = secrets.token_hex(nbytes)
        if int(h, 16):
            return h


def iteration_span_id(attempt_span_id: str, iteration: int) -> str:
    """The span id of ``iteration``'s span in the attempt ``attempt_span_id`` (16 hex digits):
    derived, so the runner that records a dead attempt names the span its children point to."""
    h = hashlib.sha256(f"{attempt_span_id}:{iteration}".encode()).hexdigest()[:16]
    return h if int(h, 16) else "0000000000000001"


class RunTracer:
    """The tracing hooks of one runner process's attempt at a run; this base does nothing.

    The runner calls them in this order: :meth:`attempt_started` (before the takeover commit),
    then for each iteration :meth:`iteration`, :meth:`chat`, :meth:`tool`, :meth:`waiting`,
    :meth:`checkpoint`, and last :meth:`attempt_ended`. None raises.
    """

    def attempt_started(
        self,
        snap: StateSnapshot,
        *,
        run_name: str,
        epoch: int,
        runner_id: str = "",
        left_behind: tuple[str, float] | None = None,
    ) -> None:
        """This process took the run over; ``snap`` is the snapshot its takeover commit writes
        (its ``context.trace`` is set here). ``epoch``: the lease's fencing epoch;
        ``runner_id``: this claim's; ``left_behind``: (runner id, last heartbeat, s since the
        Unix epoch) of a runner that never released the run (``RunnerClaim.left_behind``)."""

    def iteration(self, it: int) -> None:
        """The attempt works on iteration ``it`` (1-based) now."""

    @contextmanager
    def chat(self, it: int, model: str) -> Iterator[ChatSpan]:
        """Around one model request of iteration ``it`` to ``model``; the body reports the reply
        with :meth:`ChatSpan.reply`. An exception raised in the body marks the span failed."""
        yield _NO_CHAT

    @contextmanager
    def tool(self, entry: JournalEntry) -> Iterator[ToolSpan]:
        """Around one run of a tool body (``entry``: its journal row); the body reports the
        result with :meth:`ToolSpan.result`."""
        yield _NO_TOOL

    def waiting(self, call_ids: Sequence[str]) -> None:
        """The attempt waits for a human decision on ``call_ids``, until its next hook."""

    def checkpoint(self, snap: StateSnapshot) -> None:
        """``snap`` is about to be committed: an iteration it completes ends, what ended is
        exported, and ``snap`` records the iteration still open (for a successor, should this
        process die)."""

    def attempt_ended(self, snap: StateSnapshot | None, phase: str | None, exit_code: int | None, message: str = "") -> None:
        """This process is done with the run: how it ended (``phase`` of its Outcome, the exit
        code), or all None when it raised. A terminal ``phase`` ends the run's root span."""


class ChatSpan:
    """The span of one model call (this base: none)."""

    def reply(self, reply: ModelReply) -> None:
        """Record the reply's usage (tokens) and finish reason."""


class ToolSpan:
    """The span of one tool body's run (this base: none)."""

    def result(self, result: ToolResult) -> None:
        """Record how the call ended (an error kind marks the span failed)."""


_NO_CHAT: Final = ChatSpan()
_NO_TOOL: Final = ToolSpan()
_NOOP: Final = RunTracer()
_provider_lock = threading.Lock()
_provider: Any = None  # the process's TracerProvider, made on first use


def run_tracer(run_id: str, run_uid: str) -> RunTracer:
    """The tracer of one attempt at run ``run_id`` (uid ``run_uid``): :class:`OtelRunTracer`
    when :func:`enabled`, else the no-op :class:`RunTracer`. Never raises: a tracing setup that
    fails (the ``otel`` extra missing, say) is logged, and the run is not traced."""
    if not enabled():
        return _NOOP
    try:
        return OtelRunTracer(run_id, run_uid, _tracer_provider())
    except Exception:
        log.warning("tracing is configured but could not start; this run is not traced", exc_info=True)
        return _NOOP


def _tracer_provider() -> Any:
    """The process's TracerProvider: OTLP/HTTP from the standard variables, batched, with the
    fixed-id generator; made once (the SDK shuts it down, flushing, at interpreter exit)."""
    global _provider
    with _provider_lock:
        if _provider is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            timeout_set = any(os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"))
            exporter = OTLPSpanExporter(timeout=None if timeout_set else DEFAULT_EXPORT_TIMEOUT_S)
            attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "agentfast-runner"}
            provider = TracerProvider(resource=Resource.create(attrs), id_generator=_fixed_id_generator())
            provider.add_span_processor(BatchSpanProcessor(exporter))
            _provider = provider
        return _provider


_forced = threading.local()  # .span_id / .trace_id: the ids the next span started on this thread gets


def _fixed_id_generator() -> Any:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class FixedIds(RandomIdGenerator):
        """Random ids, except for a span whose id the run already chose (the root, a dead
        attempt, an iteration): :func:`_with_ids` sets those for the one span it starts."""

        def generate_span_id(self) -> int:
            forced: int | None = getattr(_forced, "span_id", None)
            if forced is not None:
                _forced.span_id = None
                return forced
            return super().generate_span_id()

        def generate_trace_id(self) -> int:
            forced: int | None = getattr(_forced, "trace_id", None)
            if forced is not None:
                _forced.trace_id = None
                return forced
            return super().generate_trace_id()

    return FixedIds()


class OtelRunTracer(RunTracer):
    """The hooks of :class:`RunTracer`, recording spans with the OpenTelemetry SDK."""

    def __init__(self, run_id: str, run_uid: str, provider: Any):
        from opentelemetry import trace as otel_trace

        self._otel = otel_trace
        self._provider = provider
        self._tracer = provider.get_tracer("agentfast.runner", schema_url=f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}")
        self.run_id, self.run_uid = run_id, run_uid
        self.started_ns = time.time_ns()  # the runner made its tracer as it started: the attempt's start
        self._lock = threading.Lock()  # LangGraph runs tool nodes on its executor's threads
        self._trace: TraceContext | None = None
        self._attempt: Any = None  # the attempt's span
        self._iteration: tuple[int, Any] | None = None  # (number, span) of the open iteration
        self._iterations_started: set[int] = set()
        self._wait: Any = None
        self._flush_after = 0.0  # time.monotonic() before which flushes are skipped (slow collector)
        self._links: tuple[TraceLink, ...] = ()  # a fork's link to its source's trace, on its attempt spans
        self._run_name = ""

    # -- span plumbing ---------------------------------------------------------------------------

    def _context_of(self, span_id: str) -> Any:
        """A context whose current span is ``span_id`` of the run's trace (remote: it may live in
        another process, or not be exported yet)."""
        ot = self._otel
        assert self._trace is not None
        parent = ot.SpanContext(
            trace_id=int(self._trace.trace_id, 16),
            span_id=int(span_id, 16),
            is_remote=True,
            trace_flags=ot.TraceFlags(ot.TraceFlags.SAMPLED),
        )
        return ot.set_span_in_context(ot.NonRecordingSpan(parent))

    def _start(
        self,
        name: str,
        parent_span_id: str | None,
        attributes: dict[str, Any],
        *,
        span_id: str | None = None,
        start_ns: int | None = None,
        kind: Any = None,
        links: Sequence[TraceLink] = (),
    ) -> Any:
        """Start a span of the run's trace under ``parent_span_id`` (None: the root itself, a
        span with no parent), with ``span_id`` when the run chose it, linked to ``links``
        (spans of other traces: a fork's source)."""
        from opentelemetry.context import Context

        assert self._trace is not None
        if parent_span_id is None:
            _forced.trace_id = int(self._trace.trace_id, 16)
            ctx = Context()
        else:
            ctx = self._context_of(parent_span_id)
        _forced.span_id = int(span_id, 16) if span_id is not None else None
        try:
            return self._tracer.start_span(
                name,
                context=ctx,
                kind=kind if kind is not None else self._otel.SpanKind.INTERNAL,
                attributes=attributes,
                start_time=start_ns,
                links=[self._link(x) for x in links] or None,
            )
        finally:
            _forced.span_id = _forced.trace_id = None

    def _link(self, link: TraceLink) -> Any:
        """An OpenTelemetry Link to ``link``'s span, with attributes naming what it is."""
        ot = self._otel
        target = ot.SpanContext(
            trace_id=int(link.trace_id, 16),
            span_id=int(link.span_id, 16),
            is_remote=True,
            trace_flags=ot.TraceFlags(ot.TraceFlags.SAMPLED),
        )
        attrs: dict[str, Any] = {"agentfast.link": link.kind}
        if link.run_id:
            attrs.update({"agentfast.forked_from.run_id": link.run_id, "agentfast.forked_from.iteration": link.iteration})
        return ot.Link(target, attrs)

    def _span_id(self, span: Any) -> str:
        return format(span.get_span_context().span_id, "016x")

    def _error(self, span: Any, description: str, error_type: str) -> None:
        span.set_attribute("error.type", error_type)
        span.set_status(self._otel.Status(self._otel.StatusCode.ERROR, description[:500]))

    def _flush(self) -> None:
        """Export what has ended, now (see the module doc: skipped while the collector is slow)."""
        now = time.monotonic()
        if now < self._flush_after:
            return
        try:
            self._provider.force_flush(timeout_millis=int(DEFAULT_EXPORT_TIMEOUT_S * 1000))
        except Exception:
            log.warning("exporting spans failed", exc_info=True)
        took = time.monotonic() - now
        if took > SLOW_FLUSH_S:
            log.warning("exporting spans took %.1f s; not flushing at checkpoints for %.0f s", took, FLUSH_BACKOFF_S)
            self._flush_after = time.monotonic() + FLUSH_BACKOFF_S

    def _end_wait(self) -> None:
        if self._wait is not None:
            self._wait.end()
            self._wait = None

    def _run_attrs(self) -> dict[str, Any]:
        return {"agentfast.run_id": self.run_id, "agentfast.run_uid": self.run_uid}

    # -- the hooks -------------------------------------------------------------------------------

    def attempt_started(
        self,
        snap: StateSnapshot,
        *,
        run_name: str,
        epoch: int,
        runner_id: str = "",
        left_behind: tuple[str, float] | None = None,
    ) -> None:
        try:
            self._attempt_started(snap, run_name, epoch, runner_id, left_behind)
        except Exception:
            log.warning("tracing: could not start the attempt's span", exc_info=True)

    def _attempt_started(
        self, snap: StateSnapshot, run_name: str, epoch: int, runner_id: str, left_behind: tuple[str, float] | None
    ) -> None:
        ctx = snap.context
        if ctx.trace is None:
            ctx.trace = new_trace_context()
            ctx.trace.started_at_ns = self.started_ns
        self._trace, self._run_name = ctx.trace, run_name
        self._links = (ctx.trace_link,) if ctx.trace_link is not None else ()
        dead = ctx.trace.attempt
        if dead is not None and left_behind is not None and dead.runner_id and left_behind[0] == dead.runner_id:
            self._record_dead_attempt(snap, dead, left_behind[1], runner_id)
        resume = ctx.counters.resumes
        attrs = {
            **self._run_attrs(),
            "agentfast.attempt.resume": resume,
            "agentfast.epoch": epoch,
            "agentfast.runner_id": runner_id,
            "process.pid": os.getpid(),
        }
        self._attempt = self._start(
            "agentfast.run.attempt", ctx.trace.root_span_id, attrs, start_ns=self.started_ns, links=self._links
        )
        ctx.trace.attempt = AttemptTrace(
            span_id=self._span_id(self._attempt), started_at_ns=self.started_ns, resume=resume, epoch=epoch, runner_id=runner_id
        )

    def _record_dead_attempt(self, snap: StateSnapshot, dead: AttemptTrace, last_beat_s: float, by: str) -> None:
        """Emit the span of an attempt whose process died, and of the iteration it was in."""
        assert self._trace is not None
        # It died after its last heartbeat and before the next one was due, and before this one started.
        end_ns = max(min(int((last_beat_s + HEARTBEAT_S) * 1e9), self.started_ns), snap.saved_at * 1_000_000, dead.started_at_ns)
        why = "the runner process died (SIGKILL, OOM or a lost node); span recorded by the runner that took over"
        attempt = self._start(
            "agentfast.run.attempt",
            self._trace.root_span_id,
            {
                **self._run_attrs(),
                "agentfast.attempt.resume": dead.resume,
                "agentfast.epoch": dead.epoch,
                "agentfast.runner_id": dead.runner_id,
                "agentfast.attempt.recorded_by": by,
            },
            span_id=dead.span_id,
            start_ns=dead.started_at_ns,
            links=self._links,
        )
        # The iteration open at its last checkpoint (a pause inside it), else the next one, which it
        # may have started since (an empty span if it had not).
        if dead.iteration:
            it, start_ns = dead.iteration, dead.iteration_started_at_ns
        else:
            it, start_ns = snap.context.counters.iterations + 1, max(snap.saved_at * 1_000_000, dead.started_at_ns)
        iteration = self._start(
            "agentfast.iteration",
            dead.span_id,
            {**self._run_attrs(), "agentfast.iteration": it},
            span_id=iteration_span_id(dead.span_id, it),
            start_ns=min(start_ns, end_ns),
        )
        self._error(iteration, why, "ProcessDied")
        iteration.end(end_time=end_ns)
        self._error(attempt, why, "ProcessDied")
        attempt.end(end_time=end_ns)

    def iteration(self, it: int) -> None:
        try:
            with self._lock:
                self._open_iteration(it)
        except Exception:
            log.warning("tracing: could not start an iteration's span", exc_info=True)

    def _open_iteration(self, it: int) -> str | None:
        """The span id of iteration ``it`` in this attempt, its span started if it is new."""
        if self._attempt is None:
            return None
        self._end_wait()
        attempt_id = self._span_id(self._attempt)
        if it in self._iterations_started:
            return iteration_span_id(attempt_id, it)
        if self._iteration is not None:
            self._iteration[1].end()
        span = self._start(
            "agentfast.iteration",
            attempt_id,
            {**self._run_attrs(), "agentfast.iteration": it},
            span_id=iteration_span_id(attempt_id, it),
        )
        self._iteration = (it, span)
        self._iterations_started.add(it)
        return iteration_span_id(attempt_id, it)

    @contextmanager
    def chat(self, it: int, model: str) -> Iterator[ChatSpan]:
        span = None
        try:
            with self._lock:
                parent = self._open_iteration(it)
            if parent is not None:
                span = self._start(
                    f"chat {model}",
                    parent,
                    {
                        "gen_ai.operation.name": "chat",
                        "gen_ai.provider.name": PROVIDER,
                        "gen_ai.request.model": model,
                        "agentfast.iteration": it,
                        **self._run_attrs(),
                    },
                    kind=self._otel.SpanKind.CLIENT,
                )
        except Exception:
            log.warning("tracing: could not start a chat span", exc_info=True)
        if span is None:
            yield _NO_CHAT
            return
        try:
            yield _OtelChat(span)
        except BaseException as err:
            self._error(span, str(err), type(err).__name__)
            raise
        finally:
            span.end()
            self._flush()

    @contextmanager
    def tool(self, entry: JournalEntry) -> Iterator[ToolSpan]:
        span = None
        try:
            with self._lock:
                parent = self._open_iteration(entry.iteration)
            if parent is not None:
                span = self._start(
                    f"execute_tool {entry.tool_call.name}",
                    parent,
                    {
                        "gen_ai.operation.name": "execute_tool",
                        "gen_ai.tool.name": entry.tool_call.name,
                        "gen_ai.tool.type": "function",
                        "gen_ai.tool.call.id": entry.tool_call.id,
                        "agentfast.call_id": entry.call_id,
                        "agentfast.idempotency_key": entry.idempotency_key,
                        "agentfast.iteration": entry.iteration,
                        "agentfast.position": entry.position,
                        "agentfast.tool.attempt": entry.attempts + 1,
                        **self._run_attrs(),
                    },
                )
        except Exception:
            log.warning("tracing: could not start an execute_tool span", exc_info=True)
        if span is None:
            yield _NO_TOOL
            return
        try:
            yield _OtelTool(self, span)
        except BaseException as err:
            self._error(span, str(err), type(err).__name__)
            raise
        finally:
            span.end()
            self._flush()

    def waiting(self, call_ids: Sequence[str]) -> None:
        try:
            with self._lock:
                if self._attempt is None or self._wait is not None:
                    return
                parent = self._span_id(self._iteration[1] if self._iteration is not None else self._attempt)
                self._wait = self._start(
                    "agentfast.await_decision", parent, {**self._run_attrs(), "agentfast.call_ids": list(call_ids)}
                )
            self._flush()  # the wait may be long: what led to it is exported now
        except Exception:
            log.warning("tracing: could not start a wait's span", exc_info=True)

    def checkpoint(self, snap: StateSnapshot) -> None:
        try:
            with self._lock:
                self._checkpoint(snap)
        except Exception:
            log.warning("tracing: could not record a checkpoint", exc_info=True)
        self._flush()

    def _checkpoint(self, snap: StateSnapshot) -> None:
        attempt = snap.context.trace.attempt if snap.context.trace is not None else None
        if self._iteration is None or attempt is None:
            return
        it, span = self._iteration
        last = snap.messages[-1] if snap.messages else None
        # An iteration is a model call and the tool calls it asked for (G1): complete once counted
        # and its calls' results are in (LangGraph commits the model's step before its tools run).
        if it <= snap.context.counters.iterations and not (last is not None and last.role == "assistant" and last.tool_calls):
            self._end_wait()
            span.end()
            self._iteration = None
            attempt.iteration, attempt.iteration_started_at_ns = 0, 0
        else:
            attempt.iteration, attempt.iteration_started_at_ns = it, span.start_time

    def attempt_ended(self, snap: StateSnapshot | None, phase: str | None, exit_code: int | None, message: str = "") -> None:
        try:
            self._attempt_ended(snap, phase, exit_code, message)
        except Exception:
            log.warning("tracing: could not end the attempt's span", exc_info=True)
        finally:
            self._flush_after = 0.0
            self._flush()

    def _attempt_ended(self, snap: StateSnapshot | None, phase: str | None, exit_code: int | None, message: str) -> None:
        if self._attempt is None:
            return
        with self._lock:
            self._end_wait()
            if self._iteration is not None:
                self._iteration[1].end()
                self._iteration = None
        attempt, self._attempt = self._attempt, None
        if phase is None:
            self._error(attempt, "the runner raised", "RunnerError")
        else:
            attempt.set_attribute("agentfast.outcome.phase", phase)
            attempt.set_attribute("agentfast.exit_code", int(exit_code or 0))
            if phase == "Failed":
                self._error(attempt, message, "RunFailed")
        end_ns = time.time_ns()
        attempt.end(end_time=end_ns)
        if phase in TERMINAL_PHASES and snap is not None:
            self._end_root(snap, phase, message, end_ns)

    def _end_root(self, snap: StateSnapshot, phase: str, message: str, end_ns: int) -> None:
        """The run ended in this attempt: emit its root span, with the id its attempts name."""
        assert self._trace is not None
        ctx = snap.context
        root = self._start(
            f"invoke_agent {self._run_name}",
            None,
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.agent.name": self._run_name,
                "gen_ai.agent.id": self.run_uid,
                "gen_ai.conversation.id": self.run_uid,
                "gen_ai.request.model": ctx.session.model,
                "gen_ai.usage.input_tokens": ctx.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": ctx.usage.completion_tokens,
                **self._run_attrs(),
                "agentfast.adapter": ctx.session.adapter,
                "agentfast.phase": phase,
                "agentfast.reason": ctx.status.reason,
                "agentfast.iterations": ctx.counters.iterations,
                "agentfast.resumes": ctx.counters.resumes,
            },
            span_id=self._trace.root_span_id,
            start_ns=min(self._trace.started_at_ns or ctx.session.started_at * 1_000_000, end_ns),
            links=(ctx.trace_link,) if ctx.trace_link is not None else (),
        )
        if phase == "Failed":
            self._error(root, message, ctx.status.reason or "RunFailed")
        root.end(end_time=end_ns)


class _OtelChat(ChatSpan):
    def __init__(self, span: Any):
        self._span = span

    def reply(self, reply: ModelReply) -> None:
        try:
            s = self._span
            s.set_attribute("gen_ai.usage.input_tokens", reply.prompt_tokens)
            s.set_attribute("gen_ai.usage.output_tokens", reply.completion_tokens)
            if reply.finish_reason:
                s.set_attribute("gen_ai.response.finish_reasons", [reply.finish_reason])
            s.set_attribute("agentfast.tool_calls", len(reply.message.tool_calls))
        except Exception:
            log.warning("tracing: could not record a reply", exc_info=True)


class _OtelTool(ToolSpan):
    def __init__(self, tracer: OtelRunTracer, span: Any):
        self._tracer, self._span = tracer, span

    def result(self, result: ToolResult) -> None:
        try:
            if result.error_kind is not None:
                self._tracer._error(self._span, result.content, result.error_kind)
        except Exception:
            log.warning("tracing: could not record a tool's result", exc_info=True)
