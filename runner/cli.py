"""``agentfast``: run, resume, approve and inspect agent runs from a terminal.

Without ``--dsn`` (or ``AGENTFAST_DSN``) every command uses the embedded PostgreSQL server under
the user's data directory, so ``run`` in one terminal and ``approve`` in another see the same
state, and a later ``resume`` continues a run. Runs are named ``NAME`` or ``NAMESPACE/NAME``
(namespace ``default``), as in the AgentRun's metadata.

Exit codes: 0 done or paused for approval, 1 the run failed (budget, model), 2 bad input or a
refused command, 3 Postgres unreachable at start, 75 interrupted, resume to continue (SIGTERM,
Postgres lost mid-run), 76 another runner owns the run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import uuid
from datetime import datetime, timezone
from typing import Any, Optional

import typer
from rich.table import Column, Table

from . import output
from .loop import EXIT_BAD_INPUT, Outcome, ProgressEvent, VanillaRunner, preflight, run_id_of
from .output import err, out, styled
from .snapshot import StateSnapshot
from .spec import AgentRun, SpecError, load_agentrun, parse_agentrun
from .store import CheckpointInfo, DecisionConflict, JournalEntry, Store, StoreUnavailable, UnknownCall

EXIT_NO_POSTGRES = 3

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Durable execution for AI agent runs.")
# out, err: runner/output.py's consoles. Every str printed is data (no markup, no control
# characters) and a failed write never raises; style only through output.styled(...).

DsnOption = typer.Option(None, "--dsn", envvar="AGENTFAST_DSN", help="Postgres DSN; default: the embedded server under the user's data dir")


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> "typer.Exit":
    err.print(styled(("error:", "bold red"), " ", message))
    return typer.Exit(code)


def _open_store(dsn: Optional[str]) -> Store:
    if not dsn:
        from .embedded import embedded_dsn

        try:
            dsn = embedded_dsn()
        except Exception as e:  # initdb or pg_ctl failed: show why
            raise _fail(f"cannot start the embedded Postgres: {e}", EXIT_NO_POSTGRES) from None
    try:
        store = Store(dsn)
        store.migrate()
    except StoreUnavailable as e:
        raise _fail(f"{e}. Check --dsn / AGENTFAST_DSN.", EXIT_NO_POSTGRES) from None
    return store


def _run_key(name: str) -> str:
    return name if "/" in name else f"default/{name}"


def _load_registered(store: Store, run: str) -> AgentRun:
    record = store.get_run(_run_key(run))
    if record is None:
        raise _fail(f"no run named {run!r} (see `agentfast list`)")
    return parse_agentrun(record.spec)


class _Progress:
    """Prints one line per step; on a terminal, asks for the decision when the run pauses."""

    def __init__(self, store: Store, run_id: str, interactive: bool):
        self.store, self.run_id, self.interactive = store, run_id, interactive

    def __call__(self, ev: ProgressEvent) -> None:
        c, u = ev.context.counters, ev.context.usage
        head = (f"iter {c.iterations:>3} · tokens {u.total_tokens:>6}", "dim")
        if ev.kind == "started":
            cl = ev.context.classification
            extra = f" · resumed (#{c.resumes})" if c.resumes else ""
            if cl:
                b = cl.applied
                extra += f" · budget {cl.label}: {b.max_iterations} iterations, {b.max_tokens} tokens, {b.max_duration_ms} ms"
            out.print(styled(head, f" started {self.run_id}{extra}"))
        elif ev.kind == "model_call":
            out.print(styled(head, f" asking the model ({ev.detail})"))
        elif ev.kind == "tool_result":
            out.print(styled(head, " tool done: ", output.one_line(ev.detail)))
        elif ev.kind == "waiting" and ev.pending is not None:
            self._waiting(ev)

    def _waiting(self, ev: ProgressEvent) -> None:
        p = ev.pending
        name = self.run_id.removeprefix("default/")
        out.print(styled(("waiting for approval", "bold yellow"), " of ", (p.call_id, "bold"), ": ",
                         output.one_line(f"{p.tool_call.name}({p.tool_call.arguments})")))
        if p.reason == "in_flight_not_idempotent":
            out.print("  this non-idempotent call was in flight when a runner died: it may already have run")
        for r in p.executed_sibling_results:
            out.print(f"  sibling already done: {r.call_id} {r.tool_name} -> {output.one_line(r.content, 120)}")
        out.print(styled("  approve: ", (f"agentfast approve {name} {p.call_id}", "bold"),
                         f"   deny: agentfast deny {name} {p.call_id} --reason '...'"))
        if self.interactive:
            self._ask(p.call_id)

    def _ask(self, call_id: str) -> None:
        """The decision prompt on a terminal. Best effort: a prompt that cannot be shown or
        answered (closed terminal, end of input, Ctrl-C) leaves the run waiting for a decision
        made elsewhere (`agentfast approve/deny`), never stops it."""
        import click

        try:
            answer = typer.prompt("Approve now? [y]es / [n]o / [w]ait", default="w").strip().lower()
            if answer.startswith("y"):
                self.store.decide(self.run_id, call_id, "approve", decided_by=_who())
            elif answer.startswith("n"):
                reason = typer.prompt("Reason for the model", default="declined by the operator")
                self.store.decide(self.run_id, call_id, "deny", reason=reason, decided_by=_who())
        except (click.exceptions.Abort, EOFError, OSError):
            out.print("  no answer here; waiting for a decision (agentfast approve / deny)")
        except (DecisionConflict, UnknownCall) as e:
            err.print(styled(("error:", "bold red"), " ", str(e)))


def _interactive(wait: bool) -> bool:
    """Ask for decisions at a prompt only when a person is at both ends: stdin and stdout are a terminal."""
    return wait and sys.stdin is not None and sys.stdin.isatty() and sys.stdout is not None and sys.stdout.isatty()


def _who() -> str:
    return f"cli:{os.environ.get('USER', 'unknown')}"


def _drive(store: Store, run: AgentRun, *, wait: bool, interactive: bool) -> Outcome:
    from .model import ModelError, model_from_spec
    from .tools import ToolRegistry

    try:
        preflight(run)  # a registered run's tool may have stopped importing since it was created
        tools = ToolRegistry.from_agentrun(run)
        model = model_from_spec(run.spec.model)
    except SpecError as e:
        raise _fail(f"run {run_id_of(run)} cannot run:\n{e}") from None
    except ModelError as e:
        raise _fail(str(e)) from None
    stop = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        err.print(styled(("SIGTERM: no new tool call will start; committing and exiting (resume to continue)", "yellow")))
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    try:
        runner_class = VanillaRunner
        if run.spec.adapter == "langgraph":
            from .adapters.langgraph import LangGraphRunner

            runner_class = LangGraphRunner
        runner = runner_class(
            store, run, model, tools, wait_for_approval=wait, stop=stop, on_event=_Progress(store, run_id_of(run), interactive)
        )
        with output.detached_writes():  # a reader that stops reading must not hold up the run
            outcome = runner.run()
    finally:
        model.close()
    style = {"Succeeded": "green", "WaitingForApproval": "yellow"}.get(outcome.phase, "red")
    out.print(styled((outcome.phase, f"bold {style}"), ": ", outcome.message))
    return outcome


@app.command()
def run(
    file: str = typer.Argument(..., help="an AgentRun YAML file, the same one you would kubectl apply"),
    dsn: Optional[str] = DsnOption,
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait for approvals (default) or exit when the run pauses"),
) -> None:
    """Run an AgentRun locally; continues it if a run of that name exists and is unfinished."""
    try:
        agentrun = load_agentrun(file)
        preflight(agentrun)
    except SpecError as e:
        raise _fail(f"{file} is not a valid AgentRun:\n{e}") from None
    store = _open_store(dsn)
    run_id = run_id_of(agentrun)
    doc = agentrun.model_dump(mode="json", exclude_none=True, exclude={"status"})
    record = store.create_run(run_id, agentrun.metadata.uid or str(uuid.uuid4()), doc)
    if record.spec.get("spec") != doc.get("spec"):
        raise _fail(f"a run named {run_id} exists with a different spec; rename metadata.name or `agentfast delete {run_id}`")
    outcome = _drive(store, agentrun, wait=wait, interactive=_interactive(wait))
    raise typer.Exit(outcome.exit_code)


@app.command()
def resume(run: str = typer.Argument(..., help="run name"), dsn: Optional[str] = DsnOption,
           wait: bool = typer.Option(True, "--wait/--no-wait")) -> None:
    """Continue a run from its last checkpoint, at the exact step it stopped."""
    store = _open_store(dsn)
    agentrun = _load_registered(store, run)
    outcome = _drive(store, agentrun, wait=wait, interactive=_interactive(wait))
    raise typer.Exit(outcome.exit_code)


KubeOption = typer.Option(
    None, "--kube/--local",
    help="patch the AgentRun in the cluster (default when run as `kubectl agentfast`) or write to the local store",
)
NamespaceOption = typer.Option(None, "-n", "--namespace", help="the AgentRun's namespace (--kube); default: the kubeconfig's")


def _as_kubectl_plugin() -> bool:
    return os.path.basename(sys.argv[0]).startswith("kubectl-")


def _patch_approval(run: str, call_id: str, decision: str, reason: Optional[str], namespace: Optional[str]) -> None:
    """``kubectl patch agentrun RUN --type merge -p '{"spec":{"approvals":{CALL_ID:{...}}}}'``, made
    with the Kubernetes client; the operator records it in Postgres and the runner resumes."""
    try:
        import kubernetes
        from kubernetes.client.rest import ApiException
    except ImportError:
        raise _fail("--kube needs the kubernetes client: pip install 'agentfast[operator]'") from None
    try:
        kubernetes.config.load_kube_config()
        ns = namespace or kubernetes.config.list_kube_config_contexts()[1]["context"].get("namespace", "default")
    except kubernetes.config.ConfigException:
        kubernetes.config.load_incluster_config()
        ns = namespace or "default"
    body = {"spec": {"approvals": {call_id: {"decision": decision, **({"reason": reason} if reason else {})}}}}
    api = kubernetes.client.CustomObjectsApi()
    try:
        api.patch_namespaced_custom_object("agentfast.dev", "v1alpha1", ns, "agentruns", run.rsplit("/", 1)[-1], body)
    except ApiException as e:
        detail = json.loads(e.body).get("message", e.reason) if e.body else e.reason
        raise _fail(f"the API server refused the patch: {detail}") from None
    out.print(f"agentrun.agentfast.dev/{run} patched: {call_id} {decision}" + (f" ({reason})" if reason else ""))


def _decide(run: str, call_id: str, decision: str, reason: Optional[str], dsn: Optional[str],
            kube: Optional[bool], namespace: Optional[str]) -> None:
    if kube or (kube is None and _as_kubectl_plugin()):
        _patch_approval(run, call_id, decision, reason, namespace)
        return
    store = _open_store(dsn)
    try:
        d = store.decide(_run_key(run), call_id, decision, reason=reason, decided_by=_who())  # type: ignore[arg-type]
    except (UnknownCall, DecisionConflict) as e:
        raise _fail(str(e)) from None
    out.print(f"{d.call_id}: {d.decision}" + (f" ({d.reason})" if d.reason else "") + f" recorded for {_run_key(run)}")


@app.command()
def approve(run: str, call_id: str = typer.Argument(..., help="the call id status shows, e.g. call-2-0"),
            dsn: Optional[str] = DsnOption, kube: Optional[bool] = KubeOption, namespace: Optional[str] = NamespaceOption) -> None:
    """Approve a gated tool call; a waiting runner continues at once."""
    _decide(run, call_id, "approve", None, dsn, kube, namespace)


@app.command()
def deny(run: str, call_id: str, reason: str = typer.Option("", "--reason", help="told to the model as the tool's result"),
         dsn: Optional[str] = DsnOption, kube: Optional[bool] = KubeOption, namespace: Optional[str] = NamespaceOption) -> None:
    """Deny a gated tool call; the model is told it was declined, and why."""
    _decide(run, call_id, "deny", reason or None, dsn, kube, namespace)


@app.command()
def status(run: str, dsn: Optional[str] = DsnOption, output: str = typer.Option("text", "-o", help="text or json")) -> None:
    """Phase, iteration, tokens, budget and any pending approval of a run."""
    store = _open_store(dsn)
    loaded = store.load_context(_run_key(run))
    if loaded is None:
        raise _fail(f"no run named {run!r} has a checkpoint")
    ctx, pending = loaded
    if output == "json":
        out.print_json(json.dumps({"context": ctx.model_dump(mode="json"), "pending": pending.model_dump(mode="json") if pending else None}))
        return
    c, u, b = ctx.counters, ctx.usage, ctx.budget
    t = Table(show_header=False, box=None)
    t.add_row("run", _run_key(run))
    t.add_row("phase", f"{ctx.status.phase} ({ctx.status.reason})" + (f": {ctx.status.message}" if ctx.status.message else ""))
    t.add_row("iteration", f"{c.iterations} of {b.max_iterations}")
    t.add_row("tokens", f"{u.total_tokens} of {b.max_tokens} (prompt {u.prompt_tokens}, completion {u.completion_tokens})")
    t.add_row("active time", f"{u.duration_ms} ms of {b.max_duration_ms} ms")
    t.add_row("tool calls", f"{c.tool_calls} ({c.tool_errors} raised, {c.malformed_tool_calls} malformed)")
    t.add_row("resumes", str(c.resumes))
    if ctx.classification:
        t.add_row("classifier", f"{ctx.classification.classifier}: {ctx.classification.label} ({ctx.classification.reason})")
    if pending:
        t.add_row("awaiting", f"{pending.call_id} {pending.tool_call.name}({pending.tool_call.arguments})")
    out.print(t)


@app.command()
def history(run: str, dsn: Optional[str] = DsnOption,
            output_format: str = typer.Option("text", "-o", "--output", help="text, or json: transcript, journal, decisions and checkpoints")) -> None:
    """The transcript (every part of every message), the tool-call journal, the decisions and the kept checkpoints of a run."""
    if output_format not in ("text", "json"):
        raise _fail(f"-o must be text or json, not {output_format!r}")
    store = _open_store(dsn)
    key = _run_key(run)
    snap = store.load_snapshot(key)
    if snap is None:
        raise _fail(f"no run named {run!r} has a checkpoint")
    journal = store.journal(key)
    decisions = store.decision_log(key)
    checkpoints = store.list_checkpoints(key)
    if output_format == "json":
        out.print_json(data=_history_json(key, snap, journal, decisions, checkpoints))
        return
    by_position = {(e.iteration, e.position): e for e in journal}
    out.rule(f"transcript of {key}")
    iteration = 0
    for i, m in enumerate(snap.messages):
        label = m.role + (f" {m.name}" if m.name else "") + (f" (tool-call id {m.tool_call_id})" if m.tool_call_id else "")
        parts: list = [(f"{i:>3}", "dim"), " ", (label, "bold")]
        if m.content is not None:
            parts += [": ", m.content]
        out.print(styled(*parts))
        if m.role == "assistant":
            iteration += 1  # iteration N appends the N-th assistant message
        if m.refusal is not None and m.refusal != m.content:
            out.print(styled("      ", ("refusal", "bold"), ": ", m.refusal))
        for pos, c in enumerate(m.tool_calls):
            e = by_position.get((iteration, pos))
            name = e.call_id if e is not None and e.tool_call.id == c.id else "call"
            ids = f"tool-call id {c.id}" + (f"; the provider sent {c.provider_id!r}" if c.provider_id is not None else "")
            out.print(styled("      ", (name, "bold"), f" {c.name}({c.arguments})  ", (f"({ids})", "dim")))
    out.rule("tool-call journal")
    for e in journal:
        flags = [f for f, on in (("gated", e.gated), ("not idempotent", not e.idempotent)) if on]
        state = e.state + (f" ({e.result.error_kind or 'error'})" if e.result and e.result.is_error else "")
        out.print(styled((e.call_id, "bold"), f"  {e.tool_call.name}  {state}  attempts {e.attempts}",
                         f"  {', '.join(flags)}" if flags else "", f"  idempotency key {e.idempotency_key}"))
    if not journal:
        out.print("(no tool calls)")
    if decisions:
        out.rule("decisions")
        for d in decisions:
            out.print(styled((d["call_id"], "bold"), f"  {d['decision']}  by {d.get('decided_by') or '?'}  at {_when(d.get('decided_at'))}",
                             f"  reason: {d['reason']}" if d.get("reason") else ""))
    out.rule("checkpoints (latest kept)")
    for c in checkpoints:
        out.print(styled((f"checkpoint {c.checkpoint_id}", "bold"), f"  iteration {c.iteration}  messages {c.message_count}"
                         f"  {c.phase}  epoch {c.epoch}  saved {_when(c.saved_at)}"))


def _history_json(key: str, snap: StateSnapshot, journal: list[JournalEntry], decisions: list[dict[str, Any]],
                  checkpoints: list[CheckpointInfo]) -> dict[str, Any]:
    """``history -o json``: the whole record of a run, machine-readable (times as ISO 8601 UTC)."""
    return {
        "run": key,
        "status": snap.context.status.model_dump(mode="json"),
        "transcript": [m.model_dump(mode="json") for m in snap.messages],
        "journal": [
            {
                "call_id": e.call_id, "iteration": e.iteration, "position": e.position, "tool": e.tool_call.name,
                "tool_call_id": e.tool_call.id, "arguments": e.tool_call.arguments, "gated": e.gated,
                "idempotent": e.idempotent, "state": e.state, "attempts": e.attempts,
                "idempotency_key": e.idempotency_key, "result": e.result.model_dump(mode="json") if e.result else None,
            }
            for e in journal
        ],
        "decisions": [{k: _iso(v) for k, v in d.items() if k != "run_id"} for d in decisions],
        "checkpoints": [
            {"checkpoint_id": c.checkpoint_id, "iteration": c.iteration, "messages": c.message_count, "phase": c.phase,
             "epoch": c.epoch, "saved_at": _iso(c.saved_at)}
            for c in checkpoints
        ],
    }


def _when(value: Any) -> str:
    """A time for people: ``2025-11-30 19:42:03 +0000`` in the local zone. ``value``: ms since the
    Unix epoch or a datetime; anything else as it is, ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value / 1000, tz=timezone.utc)
    if isinstance(value, datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
    return str(value)


def _iso(value: Any) -> Any:
    """A time for machines (ISO 8601, UTC, ms); other values unchanged. ``value``: ms since the Unix epoch or a datetime."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = datetime.fromtimestamp(value / 1000, tz=timezone.utc)
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return value


@app.command("list")
def list_runs(dsn: Optional[str] = DsnOption) -> None:
    """Every run in the store with its phase, iteration and the time of its latest checkpoint."""
    store = _open_store(dsn)
    t = Table(*(Column(h, overflow="fold") for h in ("run", "phase", "iteration", "latest checkpoint")))
    for rec, info in store.list_runs():
        t.add_row(rec.run_id, info.phase if info else "-", str(info.iteration) if info else "-", _when(info.saved_at) if info else "-")
    out.print(t)


@app.command()
def delete(run: str, dsn: Optional[str] = DsnOption) -> None:
    """Delete a run and all its data: transcript, journal, approvals, checkpoints."""
    store = _open_store(dsn)
    if not store.delete_run(_run_key(run)):
        raise _fail(f"no run named {run!r}")
    out.print(f"deleted {_run_key(run)}")


def main() -> None:
    """Console-script entry point.

    Output is best effort (runner/output.py): a closed or full stdout/stderr or a terminal that
    cannot encode a character never changes what a command does or its exit code.
    """
    output.install()
    logging.basicConfig(level=os.environ.get("AGENTFAST_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    finally:
        output.finish()
