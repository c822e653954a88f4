"""``agentfast``: run, resume, approve and inspect agent runs from a terminal.

Without ``--dsn`` (or ``AGENTFAST_DSN``) every command uses the embedded PostgreSQL server under
the user's data directory, so ``run`` in one terminal and ``approve`` in another see the same
state, and a later ``resume`` continues a run. Runs are named ``NAME`` or ``NAMESPACE/NAME``
(namespace ``default``), as in the AgentRun's metadata.

Exit codes: 0 done, cancelled or paused for approval, 1 the run failed (budget, deadline, model), 2 bad input or a
refused command, 3 Postgres unreachable at start, 75 interrupted, resume to continue (SIGTERM,
Postgres lost mid-run), 76 another runner owns the run.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, get_args

import click

from . import logs, output
from .errors import AgentfastError, SettingError, missing_extra
from .names import TERMINAL_PHASES, ExitCode, Phase, format_run_id, parse_run_id
from .output import err, one_line, out, styled

# Everything else is imported by the commands that use it, inside them, so that a command pays
# only for its own imports (issue 15; tests/test_cli_imports.py keeps it so): the runner loop
# (budget, journal, model, tool host) only run and resume need; the store (psycopg and the
# snapshot models) every command but --help; the spec models only run, resume and a status that
# shows a ModelConfig.
if TYPE_CHECKING:
    from .inbox import KubeInbox
    from .loop import Outcome, ProgressEvent
    from .model import ChatModel
    from .snapshot import AwaitedCall, PendingToolCall, RunContext, StateSnapshot
    from .spec import AgentRun, ModelConfig, ResolvedRun
    from .store import CheckpointInfo, JournalEntry, Store
    from .toolhost import ToolHost
    from .tools import ToolRegistry


class _Commands(click.Group):
    """The command group; ``--help`` lists the commands in the order they are defined here (as typer did), not sorted."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


@click.group(cls=_Commands, help="Durable execution for AI agent runs.")
@click.version_option(package_name="agentfast", prog_name="agentfast", message="%(prog)s %(version)s")
def app() -> None:
    """The ``agentfast`` command group (click: typer's own base, without typer's per-parameter
    pydantic coercion, which cost every command ~20 ms of start-up; issue 15)."""


# out, err: runner/output.py's consoles. Every str printed is data (no markup, no control
# characters) and a failed write never raises; style only through output.styled(...).

dsn_option = click.option(
    "--dsn", envvar="AGENTFAST_DSN", show_envvar=True, help="Postgres DSN; default: the embedded server under the user's data dir"
)
force_option = click.option(
    "--force",
    is_flag=True,
    help="take the run over even from a live runner (which is then fenced out: its next commit fails); without it a live owner makes this exit 76",
)
wait_option = click.option(
    "--wait/--no-wait", default=True, show_default=True, help="wait for approvals (default) or exit when the run pauses"
)


def _fail(message: str, code: int = ExitCode.BAD_INPUT) -> click.exceptions.Exit:
    err.print(styled(("error:", "bold red"), " ", message))
    return click.exceptions.Exit(code)


def _open_store(dsn: str | None, *, migrate: bool = True) -> Store:
    """The store of ``dsn`` (default: the embedded server), migrated unless ``migrate`` is False
    (a reader that leaves the schema to its owner). Raises click's Exit (2, or 3 without Postgres)."""
    from .store import InvalidDsn, Store, StoreUnavailable

    if not dsn:
        from .embedded import embedded_dsn, role_password
        from .examples import EXAMPLES_DSN_ENV, EXAMPLES_ROLE, provision

        try:
            dsn = embedded_dsn()
            if not os.environ.get(EXAMPLES_DSN_ENV):  # the trial server also gives the example tools their own role
                os.environ[EXAMPLES_DSN_ENV] = provision(dsn, password=role_password(dsn, EXAMPLES_ROLE))
        except Exception as e:  # initdb or pg_ctl failed: show why
            raise _fail(f"cannot start the embedded Postgres: {e}", ExitCode.NO_POSTGRES) from None
    try:
        store = Store(dsn)
        if migrate:
            store.migrate()
    except InvalidDsn as e:  # refused before any connection; the message quotes none of the DSN
        raise _fail(f"--dsn / AGENTFAST_DSN: {e}", ExitCode.BAD_INPUT) from None
    except StoreUnavailable as e:
        raise _fail(f"{e}. Check --dsn / AGENTFAST_DSN.", ExitCode.NO_POSTGRES) from None
    except ValueError as e:  # AGENTFAST_PAYLOAD_THRESHOLD_BYTES / _MAX_BYTES not a number of bytes
        raise _fail(str(e), ExitCode.BAD_INPUT) from None
    return store


def _run_key(name: str) -> str:
    return format_run_id(*parse_run_id(name))  # NAME is in namespace default


def _load_registered(store: Store, run: str) -> AgentRun:
    from .spec import SpecError, parse_agentrun

    record = store.get_run(_run_key(run))
    if record is None:
        raise _fail(f"no run named {run!r} (see `agentfast list`)")
    try:
        # Imports wait for _drive: after the admin's allow-list, and a failure there ends the run (InvalidSpec).
        return parse_agentrun(record.spec, check_imports=False)
    except SpecError as e:
        raise _fail(f"run {run} cannot run:\n{e}") from None


def _notify(store: Store, run_id: str, run_uid: str, pending: PendingToolCall) -> None:
    """Announce the awaited calls to the webhook of ``AGENTFAST_NOTIFY_URL``, if set
    (docs/notifications.md); imported only then. Malformed settings are said, never fatal."""
    if not os.environ.get("AGENTFAST_NOTIFY_URL"):
        return
    from .notify import NotificationConfigError, notify_local

    try:
        notify_local(store.dsn, run_id, run_uid, pending)
    except NotificationConfigError as e:
        err.print(styled(("warning:", "bold yellow"), " ", f"no notification: {e}"))


class _Progress:
    """Prints one line per step; on a terminal, asks for the decision when the run pauses.

    Also ends start-up's time without garbage collection (see :func:`main`) at the first event
    after ``started`` that is not a ``model_call``: by then the model client's import (openai,
    ~0.5 s of allocation, on a background thread from the takeover on, which collection would
    slow by ~15%) is done, since a model reply came in, or the run pauses or ends. Every
    iteration ends with a ``checkpoint`` event, so a run collects from its first iteration on."""

    def __init__(self, store: Store, run_id: str, interactive: bool):
        self.store, self.run_id, self.interactive = store, run_id, interactive
        self._started = self._collecting = False

    def __call__(self, ev: ProgressEvent) -> None:
        if not self._collecting and self._started and ev.kind != "model_call":
            _collect_from_now_on()
            self._collecting = True
        self._started = self._started or ev.kind == "started"
        c, u = ev.context.counters, ev.context.usage
        head = (f"iter {c.iterations:>3} · tokens {u.total_tokens:>6}", "dim")
        if ev.kind == "started":
            cl = ev.context.classification
            extra = f" · resumed (#{c.resumes})" if c.resumes else ""
            if cl:
                b = cl.applied
                label = "" if cl.classifier == "none" else f" {cl.label} ({cl.classifier} classifier)"
                extra += f" · budget{label}: {b.max_iterations} iterations, {b.max_tokens} tokens, {b.max_duration_ms} ms"
            out.print(styled(head, f" started {self.run_id}{extra}"))
        elif ev.kind == "model_call":
            out.print(styled(head, f" asking the model ({ev.detail})"))
        elif ev.kind == "tool_result":
            out.print(styled(head, " tool done: ", one_line(ev.detail)))
        elif ev.kind == "tool_denied":
            out.print(styled(head, " denied, not run: ", one_line(ev.detail)))
        elif ev.kind == "tool_denied_rerun":  # never "not run": its interrupted attempt may have taken effect
            out.print(styled(head, " denied, not run again (an earlier attempt may have taken effect): ", one_line(ev.detail)))
        elif ev.kind == "user_replied":
            out.print(styled(head, " ", one_line(ev.detail)))
        elif ev.kind == "conversation_ended":
            out.print(styled(head, " the conversation ends: ", one_line(ev.detail)))
        elif ev.kind == "tool_completed":
            out.print(styled(head, " recorded as done, not run: ", one_line(ev.detail)))
        elif ev.kind == "waiting" and ev.pending is not None:
            _notify(self.store, self.run_id, ev.context.session.run_uid, ev.pending)
            self._waiting(ev.pending, ev.context)

    def _waiting(self, p: PendingToolCall, ctx: RunContext) -> None:
        name = self.run_id.removeprefix("default/")
        questions = [a for a in p.awaiting if a.reason == "awaiting_input"]
        calls = [a for a in p.awaiting if a.reason != "awaiting_input"]
        if questions:
            self._questions(name, questions)
        if calls:
            self._approvals(name, p, calls)
        # What the run has spent against its budget, before anyone decides (issue 31 item 3).
        out.print(styled("  spent so far: ", (self._spend(ctx), "bold")), highlight=False)
        if self.interactive:
            for a in questions:
                self._ask_reply(a)
            for a in calls:
                self._ask(a)

    def _spend(self, ctx: RunContext) -> str:
        """:func:`~.budget.spend_summary` of the run as the store counts it (replies lost to
        crashes included), else of ``ctx`` (the event's) when the store cannot be read."""
        from .snapshot import spend_summary

        try:
            loaded = self.store.load_context(self.run_id)
        except AgentfastError:
            loaded = None
        return spend_summary(loaded[0] if loaded is not None else ctx)

    def _questions(self, name: str, questions: list[AwaitedCall]) -> None:
        from .conversation import question_of

        for a in questions:
            out.print(
                styled(("the agent asks", "bold yellow"), " (", (a.call_id, "bold"), "): ", question_of(a.tool_call.arguments))
            )
        several = " --call CALL_ID" if len(questions) > 1 else ""
        hint = f"agentfast reply {name} 'your answer'{several}"
        out.print(styled("  reply: ", (hint, "bold"), "   end the conversation: ", (f"agentfast end {name}{several}", "bold")))

    def _ask_reply(self, a: AwaitedCall) -> None:
        """The reply prompt on a terminal; best effort, like :meth:`_ask` (empty input: wait)."""
        from .decisions import InvalidDecision
        from .store import DecisionConflict, UnknownCall

        try:
            with output.attached_writes():
                text = click.prompt(f"Your reply to {a.call_id} (empty: wait)", default="", show_default=False)
            if text.strip():
                self.store.decide(self.run_id, a.call_id, "reply", result=text, decided_by=_who())
        except (click.exceptions.Abort, EOFError, OSError):
            out.print("  no answer here; waiting for a reply (agentfast reply)")
        except (UnknownCall, DecisionConflict, InvalidDecision) as e:
            err.print(styled(("error:", "bold red"), " ", f"{a.call_id}: not recorded: {e}"))

    def _approvals(self, name: str, p: PendingToolCall, calls: list[AwaitedCall]) -> None:
        if len(calls) == 1:
            a = calls[0]
            out.print(
                styled(
                    ("waiting for approval", "bold yellow"),
                    " of ",
                    (a.call_id, "bold"),
                    ": ",
                    one_line(f"{a.tool_call.name}({a.tool_call.arguments})"),
                )
            )
        else:
            out.print(
                styled(
                    (f"waiting for decisions on {len(calls)} calls", "bold yellow"),
                    " (decide each, in any order; the run goes on when all are):",
                )
            )
            for a in calls:
                out.print(styled("  ", (a.call_id, "bold"), ": ", one_line(f"{a.tool_call.name}({a.tool_call.arguments})")))
        for a in calls:
            if a.reason == "in_flight_not_idempotent":
                out.print(f"  {a.call_id}: this non-idempotent call was in flight when a runner died: it may already have run")
        for r in p.executed_sibling_results:
            out.print(f"  sibling already done: {r.call_id} {r.tool_name} -> {one_line(r.content, 120)}")
        cid = calls[0].call_id if len(calls) == 1 else "CALL_ID"
        out.print(
            styled(
                "  approve: ",
                (f"agentfast approve {name} {cid}", "bold"),
                f"   deny: agentfast deny {name} {cid} --reason '...'"
                f"   already happened: agentfast complete {name} {cid} --result 'TEXT'",
            )
        )

    def _ask(self, a: AwaitedCall) -> None:
        """The decision prompt on a terminal, for one awaited call. Best effort: a prompt that
        cannot be shown or answered (closed terminal, end of input, Ctrl-C) leaves the run
        waiting for a decision made elsewhere (`agentfast approve/deny/complete`), never stops it."""
        from .arguments import arguments_digest
        from .decisions import InvalidDecision
        from .store import DecisionConflict, UnknownCall

        try:
            with output.attached_writes():  # each question in order, before input() reads the answer
                answer = (
                    click.prompt(f"Approve {a.call_id} ({a.tool_call.name}) now? [y]es / [n]o / [w]ait", default="w")
                    .strip()
                    .lower()
                )
                reason = (
                    click.prompt("Reason for the model", default="declined by the operator") if answer.startswith("n") else None
                )
            shown = arguments_digest(a.tool_call.arguments)  # G13: the decision binds to what was printed above
            if answer.startswith("y"):
                self.store.decide(self.run_id, a.call_id, "approve", decided_by=_who(), arguments_digest=shown)
            elif reason is not None:
                self.store.decide(self.run_id, a.call_id, "deny", reason=reason, decided_by=_who(), arguments_digest=shown)
        # click.prompt raises Abort on end of input or Ctrl-C
        except (click.exceptions.Abort, EOFError, OSError):
            out.print("  no answer here; waiting for a decision (agentfast approve / deny / complete)")
        except (UnknownCall, DecisionConflict, InvalidDecision) as e:  # decided meanwhile elsewhere, or a blank reason
            err.print(styled(("error:", "bold red"), " ", f"{a.call_id}: not recorded: {e}"))


def _interactive(wait: bool) -> bool:
    """Ask for decisions at a prompt only when a person is at both ends: stdin and stdout are a terminal."""
    return wait and sys.stdin is not None and sys.stdin.isatty() and sys.stdout is not None and sys.stdout.isatty()


def _who() -> str:
    """Who decides from this terminal, ``cli:NAME``: the OS account of this process (its uid's
    name in the password database, e.g. ``cli:alice``), or ``cli:uid-1000`` when the uid has no
    name (a container's arbitrary uid). Never ``$USER``: it is unset under containers, CI and su,
    and a decision's ``decided_by`` must name someone."""
    import pwd

    uid = os.getuid()
    try:
        return f"cli:{pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"cli:uid-{uid}"


def _check_admin_policy(run: AgentRun) -> None:
    """Where an admin set ``AGENTFAST_ALLOWED_MODULES`` (the operator does, in every runner pod):
    refs only from those module prefixes, and only bundled model scripts, checked before anything
    is imported (spec.check_cluster_policy). Unset (a local CLI): no list. Raises SpecError."""
    from .spec import (
        allowed_modules_from_env,
        bundled_scripts,
        check_cluster_policy,
        mcp_commands_from_env,
        mcp_env_from_env,
        mcp_servers_from_env,
    )

    allowed = allowed_modules_from_env()
    if allowed is not None:
        # The scripted model's module (HTTP server, YAML) only for a run that names one.
        check_cluster_policy(
            run,
            allowed,
            bundled_scripts() if run.spec.model.script is not None else [],
            mcp_servers=mcp_servers_from_env(),  # the admin's, as the operator passed them (docs/mcp.md)
            mcp_commands=mcp_commands_from_env(),
            mcp_env=mcp_env_from_env(),
        )


def _drive(
    store: Store,
    run: AgentRun,
    *,
    wait: bool,
    interactive: bool,
    force: bool = False,
    host: ToolHost | None = None,
    wait_for_holder_s: float | None = None,
    resolved: ResolvedRun | None = None,
) -> Outcome:
    """Run ``run`` to its end, a pause or a stop; its tools run in a tool host (``host``, or one
    started here) that never receives the store's credential or the model key (G11). ``resolved``:
    ``run`` as ``spec.resolve`` checked it (``agentfast run`` did, before registering it); else it is
    checked here, once (a registered run's classifier or script may have stopped resolving since).

    The host imports the tools while the runner takes the run over: the runner asks for them
    (``host.registry``) only once its takeover is committed, so a replacement fences its
    predecessor and shows its takeover without waiting for a second Python to start. A tool that
    no longer imports (a registered run's module changed) then ends the run ``InvalidSpec``, as
    before, from inside the runner (``RunnerBase``)."""
    from .loop import fail_invalid_spec, run_id_of
    from .model import ModelError, model_from_spec
    from .spec import SpecError, resolve
    from .toolhost import ToolHost

    try:
        try:
            if resolved is None:
                _check_admin_policy(run)  # before the host is told what to import
                resolved = resolve(run)
            host = host or ToolHost.spawn(run, secrets=_credentials(store.dsn))
            # called after the takeover: a registered run's tool may have stopped importing since it was created
            tools = host.registry
            # the endpoint the run was registered with
            model = model_from_spec(run.spec.model, run.modelConfig, script=resolved.script)
        except SpecError as e:
            # Recorded as the run's ending (Failed/InvalidSpec): the operator shows it and nothing retries it.
            ended = fail_invalid_spec(store, run, str(e), force=force, wait_for_holder_s=wait_for_holder_s)
            code = ExitCode.BAD_INPUT if ended.phase == Phase.FAILED else ended.exit_code
            raise _fail(f"run {run_id_of(run)} cannot run:\n{e}", code) from None
        except ModelError as e:
            raise _fail(str(e)) from None
        return _drive_with(
            store, run, model, tools, wait=wait, interactive=interactive, force=force, wait_for_holder_s=wait_for_holder_s
        )
    finally:
        if host is not None:
            host.close()


def _suspend_after_s() -> float | None:
    """``AGENTFAST_SUSPEND_AFTER_SECONDS`` (the operator sets it in runner pods from
    ``spec.suspendAfter``): wait at most this long for a decision, then exit 0; unset or 0: no limit."""
    try:
        return float(os.environ.get("AGENTFAST_SUSPEND_AFTER_SECONDS", "0")) or None
    except ValueError:
        return None


def _credentials(dsn: str) -> tuple[str, str, str]:
    """What no tool may see: the password of ``dsn`` (the store's), the model key (either may be
    empty), and the path of the local store's password file (a variable naming it points a tool at it)."""
    from .embedded import default_password_file
    from .spec import MODEL_API_KEY_ENV
    from .store import parse_dsn

    return (
        parse_dsn(dsn).get("password", ""),
        os.environ.get(MODEL_API_KEY_ENV, ""),
        str(default_password_file()),
    )


def _collect_from_now_on() -> None:
    """Turn the garbage collector on again (main() starts with it off). Called once a driven run's
    start-up is over (:class:`_Progress`) and at the end of main. What start-up made is not
    frozen (``gc.freeze``): with it frozen at exit the runner died of SIGSEGV during the
    interpreter's shutdown in about 1 of 10 runs of tests/chaos/test_postgres.py (exit -11 for 75),
    never without."""
    gc.enable()


def _drive_with(
    store: Store,
    run: AgentRun,
    model: ChatModel,
    tools: ToolRegistry | Callable[[], ToolRegistry],
    *,
    wait: bool,
    interactive: bool,
    force: bool,
    wait_for_holder_s: float | None = None,
) -> Outcome:
    from .adapters import adapter_class
    from .loop import run_id_of

    stop = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        err.print(styled(("SIGTERM: no new tool call will start; committing and exiting (resume to continue)", "yellow")))
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    # A terminal that went away (ssh dropped, window closed) is a display failure: the run goes on
    # (its output to /dev/null, a prompt reads end of input) instead of dying on SIGHUP.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        runner = adapter_class(run.spec.adapter)(
            store,
            run,
            model,
            tools,
            wait_for_approval=wait,
            stop=stop,
            on_event=_Progress(store, run_id_of(run), interactive),
            force=force,
            suspend_after_s=_suspend_after_s(),
            wait_for_holder_s=wait_for_holder_s,
        )
        with output.detached_writes():  # a reader that stops reading must not hold up the run
            outcome = runner.run()
    finally:
        model.close()
    style = {
        Phase.SUCCEEDED.value: "green",
        Phase.WAITING_FOR_APPROVAL.value: "yellow",
        Phase.WAITING_FOR_INPUT.value: "yellow",
    }.get(outcome.phase, "red")
    out.print(styled((outcome.phase, f"bold {style}"), ": ", outcome.message))
    return outcome


@app.command()
@click.argument("file")
@dsn_option
@wait_option
@force_option
def run(file: str, dsn: str | None, wait: bool, force: bool) -> None:
    """Run an AgentRun locally; continues it if a run of that name exists and is unfinished.

    FILE: an AgentRun YAML file, the same one you would kubectl apply, and the ModelConfig it
    names (if any).

    A run on a real endpoint names a ModelConfig (``spec.model.config``) given as another
    document of the same file; its key, if it names one, is read from AGENTFAST_MODEL_API_KEY.
    """
    from .loop import run_id_of
    from .spec import SpecError, import_refs, load_agentrun, resolve
    from .store import UidTaken
    from .toolhost import ToolHost, ToolHostLost

    try:
        agentrun = load_agentrun(file, check_imports=False)
        _check_admin_policy(agentrun)  # before anything it names is imported
        if agentrun.spec.adapter != "vanilla":  # an extra's adapter: a missing extra is one line (main)
            from .adapters import adapter_class

            adapter_class(agentrun.spec.adapter)
        import_refs(agentrun, tools=False)  # the tools are imported by the tool host, never here (G11)
        resolved = resolve(agentrun)
    except SpecError as e:
        raise _fail(f"{file} is not a valid AgentRun:\n{e}") from None
    if agentrun.spec.approvals:  # no pre-approval (G10): a decision is made for a call that awaits one
        raise _fail(
            f"{file}: spec.approvals is never read from a file: a call is decided once it awaits a decision "
            "(agentfast approve RUN CALL_ID), not before it exists"
        )
    if agentrun.spec.replies:  # likewise a reply answers a question the model asked, never one to come
        raise _fail(
            f"{file}: spec.replies is never read from a file: a question is answered once the model asked it "
            "(agentfast reply RUN 'text')"
        )
    if agentrun.spec.cancel:
        raise _fail(f"{file}: spec.cancel is never read from a file: cancel a run that exists with `agentfast cancel RUN`")
    store = _open_store(dsn)
    host = ToolHost.spawn(agentrun, secrets=_credentials(store.dsn))
    try:
        try:
            host.registry()
        except SpecError as e:
            raise _fail(f"{file} is not a valid AgentRun:\n{e}") from None
        except ToolHostLost:  # an MCP server not reached yet (docs/mcp.md): registered all the same; it exits 75, resume goes on
            pass
        run_id = run_id_of(agentrun)
        # spec.cancel is a request, not the run's definition: `agentfast cancel` records it in the store.
        doc = agentrun.model_dump(mode="json", exclude_none=True, exclude={"status": True, "spec": {"cancel", "replies"}})
        try:
            if agentrun.spec.forkFrom is not None:  # registered as a fork of its source (docs/fork.md)
                from .adapters import register_fork
                from .store import ForkRefused, RunExists

                try:
                    record = register_fork(store, agentrun, run_id, agentrun.metadata.uid, doc)
                except (ForkRefused, RunExists) as e:
                    raise _fail(f"{file}: {e}") from None
            else:
                record = store.create_run(run_id, agentrun.metadata.uid or str(uuid.uuid4()), doc)
        except UidTaken as e:
            raise _fail(f"{file}: {e}; give metadata.uid another value or leave it out") from None
        if record.spec.get("spec") != doc.get("spec"):
            raise _fail(f"a run named {run_id} exists with a different spec; rename metadata.name or `agentfast delete {run_id}`")
        if record.spec.get("modelConfig") != doc.get("modelConfig"):  # a run keeps the endpoint it was registered with
            raise _fail(
                f"a run named {run_id} exists with a different ModelConfig ({_model_config_line(record.spec)});"
                f" rename metadata.name or `agentfast delete {run_id}`"
            )
        loaded = store.load_context(run_id)
    except BaseException:
        host.close()
        raise
    ended = loaded[0].status.phase if loaded is not None and loaded[0].status.phase in TERMINAL_PHASES else None
    outcome = _drive(store, agentrun, wait=wait, interactive=_interactive(wait), force=force, host=host, resolved=resolved)
    if ended is not None:  # nothing ran: the line above is the old ending; say so, and how to run it anew
        short = run_id.removeprefix("default/")
        out.print(
            f"this run already finished ({ended}): nothing ran now, the line above is its old ending."
            f" To run it again: `agentfast delete {short}` then `agentfast run {file}`,"
            f" or give metadata.name a new name; `agentfast history {short}` shows what it did",
            highlight=False,
            markup=False,
        )
    raise click.exceptions.Exit(outcome.exit_code)


wait_for_holder_option = click.option(
    "--wait-for-holder",
    type=click.FloatRange(min=0.0),
    envvar="AGENTFAST_WAIT_FOR_HOLDER_SECONDS",
    show_envvar=True,
    help="seconds to wait for a runner that holds the run to let go before refusing (exit 76); default 1."
    " A runner pod waits longer: the operator starts it while its predecessor is still stopping",
)


@app.command()
@click.argument("run")
@dsn_option
@wait_option
@force_option
@wait_for_holder_option
def resume(run: str, dsn: str | None, wait: bool, force: bool, wait_for_holder: float | None) -> None:
    """Continue the run RUN (its name) from its last checkpoint, at the exact step it stopped.

    Refuses (exit 76) while a live runner owns the run, naming it (after waiting --wait-for-holder
    seconds for it to let go); --force takes it over anyway.
    """
    store = _open_store(dsn)
    agentrun = _load_registered(store, run)
    outcome = _drive(store, agentrun, wait=wait, interactive=_interactive(wait), force=force, wait_for_holder_s=wait_for_holder)
    raise click.exceptions.Exit(outcome.exit_code)


#: What a fork may change of its source's spec (``agentfast fork -f``): how it goes on from the
#: fork point. Not what the copied state was made of: ``adapter``, ``graph`` (the state's shape),
#: ``input`` and ``systemPrompt`` (the first messages of the copied transcript), ``budget`` (the
#: copied context holds the budget the run was given), ``approvals`` and ``cancel`` (acts, not spec).
FORK_OVERRIDABLE = ("model", "tools", "ttlSecondsAfterFinished", "suspendAfter", "activeDeadlineSeconds", "runner")


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: ``patch``'s mappings merged into ``target``'s, ``null`` deletes."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge_patch(out.get(k), v)
    return out


def _fork_overrides(path: str) -> tuple[dict[str, Any], list[ModelConfig]]:
    """The ``spec`` fields of an overrides file (``spec: {model: ...}``), checked against
    :data:`FORK_OVERRIDABLE`, and the ModelConfig documents beside it (the fork's model's, as
    ``agentfast run FILE`` takes them). Raises click's Exit (2) with one line."""
    from .names import MODELCONFIG_KIND
    from .safeyaml import UnsafeYaml, load_all, read_text
    from .spec import SpecError, parse_modelconfig

    try:
        docs = load_all(read_text(path), path)
    except UnsafeYaml as e:
        raise _fail(str(e)) from None
    is_config = [isinstance(d, dict) and d.get("kind") == MODELCONFIG_KIND for d in docs]
    rest = [d for d, c in zip(docs, is_config) if not c]
    if len(rest) != 1 or not isinstance(rest[0], dict) or set(rest[0]) != {"spec"} or not isinstance(rest[0]["spec"], dict):
        raise _fail(
            f"{path}: expected one document holding only spec: {{...}} (the fields to change),"
            " and beside it only the ModelConfig the fork's model names"
        )
    try:
        configs = [parse_modelconfig(d) for d, c in zip(docs, is_config) if c]
    except SpecError as e:
        raise _fail(f"{path}: {e}") from None
    spec: dict[str, Any] = rest[0]["spec"]
    refused = sorted(set(spec) - set(FORK_OVERRIDABLE))
    if refused:
        raise _fail(
            f"{path}: a fork cannot change spec.{', spec.'.join(refused)} (the copied state was made with it);"
            f" it may change {', '.join(FORK_OVERRIDABLE)}"
        )
    return spec, configs


@app.command()
@click.argument("run")
@click.option("--at", "iteration", type=click.IntRange(min=0), required=True, help="the source's committed iteration to fork at")
@click.option("--name", "new_name", help="the new run's name (same namespace as RUN); default: RUN-fork-N")
@click.option("--model", "model_name", help="the fork's spec.model.name (the model it asks from iteration N+1 on)")
@click.option(
    "-f",
    "--overrides",
    "overrides",
    metavar="FILE",
    help=f"YAML 'spec: {{...}}' merged into the source's spec (JSON merge patch); may change {', '.join(FORK_OVERRIDABLE)};"
    " beside it, the ModelConfig the fork's model names (its endpoint and prices)",
)
@dsn_option
def fork(run: str, iteration: int, new_name: str | None, model_name: str | None, overrides: str | None, dsn: str | None) -> None:
    """Make a new run whose transcript, journal and budget state are RUN's at iteration N.

    Tool results up to N are reused, never re-executed; `agentfast resume NEW` continues it at
    iteration N+1, asking its own model (--model, or -f for other fields) and running its own
    tools with idempotency keys of the new run. Its cost is counted at its own model's prices:
    those of the ModelConfig it names (given in -f FILE, else the source's registered one when
    it names that) or of its scripted model. The source is unchanged.
    """
    from .loop import run_id_of
    from .spec import SpecError, parse_agentrun, resolve, resolve_from_file
    from .store import ForkRefused, RunExists, UidTaken

    patch, configs = _fork_overrides(overrides) if overrides else ({}, [])
    store = _open_store(dsn)
    source = _run_key(run)
    record = store.get_run(source)
    if record is None:
        raise _fail(f"no run named {run!r} (see `agentfast list`)")
    namespace, name = parse_run_id(source)
    if new_name is None:
        new_name = f"{name}-fork-{iteration}"
    if "/" in new_name:
        new_ns, new_name = parse_run_id(new_name)
        if new_ns != namespace:
            raise _fail(f"--name {new_ns}/{new_name}: a fork lives in its source's namespace ({namespace})")
    doc = copy.deepcopy(record.spec)
    doc["metadata"] = {**doc.get("metadata", {}), "name": new_name, "namespace": namespace}
    doc["metadata"].pop("uid", None)
    doc["spec"] = _merge_patch(doc.get("spec", {}), patch)
    if model_name:
        doc["spec"]["model"] = {**doc["spec"].get("model", {}), "name": model_name}
    wanted = (doc["spec"].get("model") or {}).get("config")
    theirs = (doc.get("modelConfig") or {}).get("name")
    if not wanted or configs:
        # No ModelConfig (the scripted model), or the one -f gives: the fork's own, never the source's.
        doc.pop("modelConfig", None)
    elif wanted != theirs:
        raise _fail(
            f"the fork names ModelConfig {wanted!r}, the source {theirs!r}: put the ModelConfig {wanted!r}"
            " document in the -f file, beside spec: (its endpoint and prices are the fork's)"
        )
    try:
        agentrun = parse_agentrun(doc, check_imports=False)
        if configs:
            agentrun = resolve_from_file(agentrun, configs, str(overrides))
        resolve(agentrun)  # a model script that does not load fails now, not at resume
    except SpecError as e:
        raise _fail(f"the fork's spec is not valid:\n{e}") from None
    from .adapters import sdk_row_refs

    refs = sdk_row_refs(agentrun.spec.adapter)
    doc = agentrun.model_dump(mode="json", exclude_none=True, exclude={"status": True, "spec": {"cancel", "replies"}})
    new_id = run_id_of(agentrun)
    try:
        # Its own model's prices (its ModelConfig's or the scripted model's), never the source's.
        made = store.fork_run(source, iteration, new_id, str(uuid.uuid4()), doc, prices=agentrun.prices(), sdk_refs=refs)
    except (ForkRefused, RunExists, UidTaken) as e:
        raise _fail(str(e)) from None
    out.print(
        styled(
            ("forked", "bold green"),
            f" {source} at iteration {iteration} as {made.run_id} (uid {made.run_uid});",
            f" continue it with `agentfast resume {made.run_id}`",
        )
    )
    if model_name and agentrun.spec.model.script:  # --model renames; it does not leave the scripted model
        out.print(
            styled(
                ("note:", "bold yellow"),
                f" {made.run_id} is still scripted (spec.model.script {agentrun.spec.model.script}): --model {model_name}"
                " only renames the model it asks; the scripted model plays the same script. To ask a real endpoint,"
                " fork with -f FILE setting spec.model.config (and script: null), with its ModelConfig document (docs/fork.md)",
            )
        )


kube_option = click.option(
    "--kube/--local",
    default=None,
    help="patch the AgentRun in the cluster (default when run as `kubectl agentfast`) or write to the local store",
)
namespace_option = click.option("-n", "--namespace", help="the AgentRun's namespace (--kube); default: the kubeconfig's")
uid_option = click.option("--uid", help="(--kube) decide only if the AgentRun still has this metadata.uid: the one you reviewed")
digest_option = click.option(
    "--digest",
    help="decide only if the call's arguments still have this digest (argumentsDigest in status, sha256:...): the ones you"
    " reviewed. Without it the decision binds to the arguments the call has now",
)


def _as_kubectl_plugin() -> bool:
    return os.path.basename(sys.argv[0]).startswith("kubectl-")


def _kube_inbox(namespace: str | None) -> KubeInbox:
    """The cluster as the kubeconfig's user (in a pod: its service account), in ``namespace``
    (default: the context's). Raises click's Exit (2) without the kubernetes client."""
    from .inbox import KubeInbox, Refused

    try:
        return KubeInbox.from_kubeconfig(namespace)
    except Refused as e:
        raise _fail(str(e)) from None


def _patch_decision(
    run: str,
    call_id: str,
    decision: str,
    reason: str | None,
    result: str | None,
    namespace: str | None,
    uid: str | None = None,
    digest: str | None = None,
) -> None:
    """The decision as a patch of the AgentRun ``run`` (KubeInbox.decide: ``spec.approvals``, or
    ``spec.replies`` for a reply; ``decidedBy`` the caller's user name; the AgentRun's uid as a
    precondition), printing what was patched; exit 2 with why when refused (by these checks or by
    the API server's admission policy)."""
    from .inbox import Refused

    try:
        said = _kube_inbox(namespace).decide(
            parse_run_id(run)[1], call_id, decision, reason=reason, result=result, uid=uid, digest=digest
        )
    except Refused as e:
        raise _fail(str(e)) from None
    out.print(said, highlight=False, markup=False)


def _only_awaited(awaited: list[tuple[str, str, str]], decision: str, where: str) -> str:
    """The call a decision given without CALL_ID is for: the one call of ``awaited`` (call id,
    tool, arguments), the calls of ``where`` awaiting a decision now (questions to the user are
    not among them: they are replied to). Raises click's Exit (2) when none or several await,
    naming each, so the person picks one."""
    if len(awaited) == 1:
        return awaited[0][0]
    if not awaited:
        raise _fail(
            f"no call of {where} awaits a decision now, so there is nothing to {decision} (agentfast status shows the run)"
        )
    listed = "; ".join(f"{c} {tool}({one_line(args, 60)})" for c, tool, args in awaited)
    raise _fail(
        f"{len(awaited)} calls of {where} await a decision; name one: agentfast {decision} RUN CALL_ID. Awaiting: {listed}"
    )


def _only_awaited_in_cluster(run: str, decision: str, namespace: str | None, uid: str | None) -> tuple[str, str]:
    """:func:`_only_awaited` for the AgentRun ``run`` (its status.pendingApprovals); returns the
    call id and the AgentRun's uid, which the patch then carries (the run the call was read from)."""
    from .inbox import Refused, closed_in_agentrun

    inbox = _kube_inbox(namespace)
    try:
        ns, name, body = inbox.agentrun(parse_run_id(run)[1], uid, nothing_done="nothing was decided")
    except Refused as e:
        raise _fail(str(e)) from None
    if (closed := closed_in_agentrun(body)) is not None:  # say why, not "no call awaits"
        raise _fail(f"agentrun {ns}/{name} cannot be decided: {closed.message}; nothing was decided")
    awaited = [(c.call_id, c.tool, c.arguments) for c in inbox.awaiting_decision(body)]
    return _only_awaited(awaited, decision, f"agentrun {ns}/{name}"), uid or body["metadata"]["uid"]


def _decide(
    run: str,
    call_id: str | None,
    decision: str,
    reason: str | None,
    dsn: str | None,
    kube: bool | None,
    namespace: str | None,
    result: str | None = None,
    uid: str | None = None,
    digest: str | None = None,
) -> None:
    """Record one decision (the store's rules: only for a call awaiting one now, once; with
    ``digest``, only while the call's arguments have that digest, G13); exit 2 when refused.
    ``call_id`` None: the run's only call awaiting a decision (:func:`_only_awaited`)."""
    from .decisions import InvalidDecision, check_decision
    from .store import DecisionConflict, UnknownCall

    try:
        reason, result = check_decision(decision, reason, result)
    except InvalidDecision as e:
        raise _fail(str(e)) from None
    if kube or (kube is None and _as_kubectl_plugin()):
        if call_id is None:
            call_id, uid = _only_awaited_in_cluster(run, decision, namespace, uid)
        _patch_decision(run, call_id, decision, reason, result, namespace, uid, digest)
        return
    store = _open_store(dsn)
    if call_id is None:
        if store.get_run(_run_key(run)) is None:
            raise _fail(f"no run named {run!r} (see `agentfast list`)")
        if (closed := store.decisions_closed(_run_key(run))) is not None:  # say why, not "no call awaits"
            raise _fail(f"run {_run_key(run)} cannot be decided: {closed.message}; nothing was decided")
        awaited = [
            (a.call_id, a.tool_call.name, a.tool_call.arguments)
            for a in store.awaiting(_run_key(run))
            if a.reason != "awaiting_input"
        ]
        call_id = _only_awaited(awaited, decision, _run_key(run))
    try:
        d = store.decide(
            _run_key(run),
            call_id,
            decision,  # type: ignore[arg-type]
            reason=reason,
            result=result,
            decided_by=_who(),
            arguments_digest=digest,
        )
    except (UnknownCall, DecisionConflict, InvalidDecision) as e:
        raise _fail(str(e)) from None
    said = f" ({d.reason})" if d.reason else ""
    said += f" with result {d.result}" if d.result is not None else ""
    out.print(f"{d.call_id}: {d.decision}{said} recorded for {_run_key(run)}", highlight=False, markup=False)


@app.command()
@click.argument("run")
@click.argument("call_id", required=False)
@dsn_option
@kube_option
@namespace_option
@uid_option
@digest_option
def approve(
    run: str, call_id: str | None, dsn: str | None, kube: bool | None, namespace: str | None, uid: str | None, digest: str | None
) -> None:
    """Approve a call awaiting a decision; it runs once every awaited call of its batch is decided,
    and only with the arguments the decision was made on (G13).

    CALL_ID: the call id status shows, e.g. call-2-0; may be left out when exactly one call of
    the run awaits a decision (with none or several, exit 2 listing them)."""
    _decide(run, call_id, "approve", None, dsn, kube, namespace, uid=uid, digest=digest)


@app.command()
@click.argument("run")
@click.argument("call_id", required=False)
@click.option("--reason", default="", help="required: told to the model as the tool's result")
@dsn_option
@kube_option
@namespace_option
@uid_option
@digest_option
def deny(
    run: str,
    call_id: str | None,
    reason: str,
    dsn: str | None,
    kube: bool | None,
    namespace: str | None,
    uid: str | None,
    digest: str | None,
) -> None:
    """Deny a call awaiting a decision; the model is told it was declined, and why (--reason is required).

    CALL_ID may be left out when exactly one call of the run awaits a decision."""
    _decide(run, call_id, "deny", reason or None, dsn, kube, namespace, uid=uid, digest=digest)


def _patch_cancel(run: str, namespace: str | None, uid: str | None) -> None:
    """``kubectl patch agentrun RUN --type merge -p '{"spec":{"cancel":true}}'``, made with the
    Kubernetes client (carrying the AgentRun's ``metadata.uid``, as a decision's patch does); the
    operator records the request in Postgres and the run stops at its next safe point. Refused
    (exit 2) when the AgentRun cannot be read, has another uid than ``uid``, has already ended,
    or the API server refuses the patch; exit 0 when spec.cancel was already true."""
    from .inbox import Refused

    inbox = _kube_inbox(namespace)
    nothing = "nothing was cancelled"
    try:
        ns, name, body = inbox.agentrun(parse_run_id(run)[1], uid, nothing_done=nothing)
        seen_uid = body["metadata"]["uid"]
        phase = (body.get("status") or {}).get("phase")
        if (body.get("spec") or {}).get("cancel") is True:
            out.print(
                f"agentrun.agentfast.dev/{name}: a cancel was already requested (spec.cancel is true; phase {phase or 'unknown'})",
                highlight=False,
                markup=False,
            )
            return
        if phase in TERMINAL_PHASES:
            raise Refused(f"agentrun {ns}/{name} has already ended ({phase}); there is nothing to cancel")
        # The field manager is what the operator can name as the canceller (metadata.managedFields).
        inbox.patch(
            ns,
            name,
            seen_uid,
            nothing,
            {"metadata": {"uid": seen_uid}, "spec": {"cancel": True}},
            field_manager="kubectl-agentfast",
        )
    except Refused as e:
        raise _fail(str(e)) from None
    out.print(
        f"agentrun.agentfast.dev/{name} (uid {seen_uid}) patched: spec.cancel true; it stops at its next safe point"
        " (a tool call in flight finishes) and ends Cancelled",
        highlight=False,
        markup=False,
    )


@app.command()
@click.argument("run")
@dsn_option
@kube_option
@namespace_option
@uid_option
def cancel(run: str, dsn: str | None, kube: bool | None, namespace: str | None, uid: str | None) -> None:
    """Cancel the run RUN (its name): it starts no new tool call, keeps everything done and ends Cancelled.

    A live runner stops at its next safe point (a tool call in flight finishes first; a runner
    waiting for a decision wakes at once); with none, the run is ended now. A call awaiting a
    decision is never run. --kube (the default as `kubectl agentfast cancel`) sets spec.cancel
    on the AgentRun instead. Exit 0 when cancelled or requested (also again), 2 when there is no
    such run or it has already ended.
    """
    if kube or (kube is None and _as_kubectl_plugin()):
        _patch_cancel(run, namespace, uid)
        return
    from .liveness import runner_state
    from .store import cancelled_message

    store = _open_store(dsn)
    key = _run_key(run)
    if store.get_run(key) is None:
        raise _fail(f"no run named {run!r} (see `agentfast list`)")
    loaded = store.load_context(key)
    if loaded is not None and loaded[0].status.phase in TERMINAL_PHASES:
        st = loaded[0].status
        raise _fail(f"run {key} has already ended ({st.phase}: {one_line(st.message)[:200]}); there is nothing to cancel")
    request, created = store.request_cancel(key, _who())
    said = "requested" if created else f"already requested by {request.requested_by}"
    runner = runner_state(store, key)
    if runner.alive:
        out.print(
            f"{key}: cancel {said}; its runner stops at its next safe point (a tool call in flight finishes first)"
            " and ends the run Cancelled",
            highlight=False,
            markup=False,
        )
        return
    store.cancel_run(key, cancelled_message(request), reason="Cancelled")
    out.print(f"{key}: Cancelled (no runner held it): {cancelled_message(request)}", highlight=False, markup=False)


def _budget_summary(ctx: RunContext) -> tuple[dict[str, Any], str]:
    """The budget applied next to the declared one and why: (JSON object, one text line)."""
    b, cl = ctx.budget, ctx.classification
    doc: dict[str, Any] = {"applied": b.model_dump(mode="json")}
    if cl is None:
        return doc, "as declared"
    doc.update(declared=cl.declared.model_dump(mode="json"), classifier=cl.classifier, label=cl.label, reason=cl.reason)
    lowered = [
        k for k in ("max_iterations", "max_tokens", "max_duration_ms", "max_cost") if getattr(b, k) != getattr(cl.declared, k)
    ]
    doc["lowered"] = lowered
    if not lowered:
        return doc, f"as declared ({cl.classifier} classifier: {cl.label}, {cl.reason})"
    parts = ", ".join(f"{k} {getattr(b, k)} (declared {getattr(cl.declared, k)})" for k in lowered)
    return doc, f"lowered by the {cl.classifier} classifier ({cl.label}: {cl.reason}): {parts}"


@app.command()
@click.argument("run")
@click.argument("call_id", required=False)
@click.option(
    "--result", required=True, help="the call's result, JSON or plain text; the model reads it verbatim, never re-quoted"
)
@dsn_option
@kube_option
@namespace_option
@uid_option
@digest_option
def complete(
    run: str,
    call_id: str | None,
    result: str,
    dsn: str | None,
    kube: bool | None,
    namespace: str | None,
    uid: str | None,
    digest: str | None,
) -> None:
    """Record that an awaited call's effect already happened, with this result; its tool never runs again.

    CALL_ID: the call id status shows, e.g. call-1-0-rerun1; may be left out when exactly one
    call of the run awaits a decision."""
    _decide(run, call_id, "complete", None, dsn, kube, namespace, result=result, uid=uid, digest=digest)


def _patch_reply(run: str, call_id: str | None, text: str | None, namespace: str | None, uid: str | None) -> None:
    """Answer the AgentRun's question ``call_id`` (or its only one) with ``text`` (None: end the
    conversation there): appended to ``spec.replies`` by :func:`_patch_decision`; exit 2 when no
    question, or several and no ``call_id``, await a reply."""
    from .inbox import Refused

    inbox = _kube_inbox(namespace)
    try:
        ns, name, body = inbox.agentrun(parse_run_id(run)[1], uid, nothing_done="no reply was sent")
    except Refused as e:
        raise _fail(str(e)) from None
    try:
        chosen = inbox.question_now(body, call_id)
    except Refused as e:
        raise _fail(str(e)) from None
    decision = "reply" if text is not None else "end"
    _patch_decision(run, chosen, decision, None, text, namespace, uid or body["metadata"]["uid"])


@app.command()
@click.argument("run")
@click.argument("text")
@click.option("--call", "call_id", help="the question's call id (status shows it); needed only when several await a reply")
@dsn_option
@kube_option
@namespace_option
@uid_option
def reply(
    run: str, text: str, call_id: str | None, dsn: str | None, kube: bool | None, namespace: str | None, uid: str | None
) -> None:
    """Answer the model's question to the user (a run WaitingForInput); the run goes on from there.

    TEXT: the reply, which the model reads verbatim (at most 4096 characters). Without --call it
    answers the one question that awaits a reply now, and only it: a second reply to a question
    already answered, or a reply while none awaits, is refused (exit 2), never kept for a question
    to come. A reply is write-once. As `kubectl agentfast reply` (or with --kube) it is appended
    to spec.replies."""
    from .decisions import InvalidDecision, check_decision

    try:
        _, text = check_decision("reply", None, text)  # type: ignore[assignment]
    except InvalidDecision as e:
        raise _fail(str(e)) from None
    if kube or (kube is None and _as_kubectl_plugin()):
        _patch_reply(run, call_id, text, namespace, uid)
        return
    from .store import DecisionConflict, UnknownCall

    store = _open_store(dsn)
    key = _run_key(run)
    try:
        # Without --call: the one question that awaits a reply now, and only it (Store.reply).
        d = store.reply(key, text, call_id=call_id, decided_by=_who())
    except (UnknownCall, DecisionConflict, InvalidDecision) as e:
        raise _fail(str(e)) from None
    out.print(f"{d.call_id}: reply recorded for {key}", highlight=False, markup=False)


@app.command()
@click.argument("run")
@click.option("--call", "call_id", help="the question's call id (status shows it); needed only when several await a reply")
@dsn_option
@kube_option
@namespace_option
@uid_option
def end(run: str, call_id: str | None, dsn: str | None, kube: bool | None, namespace: str | None, uid: str | None) -> None:
    """End the conversation of a run that waits for your reply (WaitingForInput).

    The run ends Succeeded (reason EndedByUser) and the model is not asked again. It is the
    person's answer to the question that awaits them, instead of a reply: write-once,
    attributed, and only while the run waits for it (to stop a run that is working, cancel it).
    As `kubectl agentfast end` (or with --kube) an `end: true` entry is appended to spec.replies."""
    if kube or (kube is None and _as_kubectl_plugin()):
        _patch_reply(run, call_id, None, namespace, uid)
        return
    from .decisions import InvalidDecision
    from .store import DecisionConflict, UnknownCall

    store = _open_store(dsn)
    key = _run_key(run)
    try:
        d = store.decide(key, store.question_now(key, call_id), "end", decided_by=_who())
    except (UnknownCall, DecisionConflict, InvalidDecision) as e:
        raise _fail(str(e)) from None
    out.print(f"{d.call_id}: the conversation of {key} ends here (recorded)", highlight=False, markup=False)


def _awaiting_view(store: Store, key: str, pending: PendingToolCall | None) -> dict[str, Any]:
    """What ``status`` shows of a paused batch: every call awaiting a decision now, and the
    decisions already recorded for the others (applied when the run goes on)."""
    from .arguments import arguments_digest

    if pending is None:
        return {"awaiting": [], "decided": []}
    now = {a.call_id for a in store.awaiting(key)}
    decided = store.get_decisions(key, pending.call_ids)
    return {
        "awaiting": [
            {
                "call_id": a.call_id,
                "tool": a.tool_call.name,
                "arguments": a.tool_call.arguments,
                "arguments_digest": arguments_digest(a.tool_call.arguments),  # what --digest takes (G13)
                "reason": a.reason,
            }
            for a in pending.awaiting
            if a.call_id in now
        ],
        "decided": [
            {"call_id": c, "decision": d.decision, "reason": d.reason, "result": d.result, "decided_by": d.decided_by}
            for c in pending.call_ids
            if (d := decided.get(c)) is not None
        ],
    }


def _model_config_line(doc: dict[str, Any]) -> str:
    """One line on the model of a registered run document: its ModelConfig (name, version,
    endpoint), or the scripted model."""
    model = (doc.get("spec") or {}).get("model") or {}
    if not doc.get("modelConfig"):
        return (
            f"{model.get('name')} (scripted: {model.get('script')})"
            if model.get("script")
            else f"{model.get('name')} (no ModelConfig)"
        )
    from .spec import ResolvedModelConfig  # only here: a run without a ModelConfig needs none of the spec models

    mc = ResolvedModelConfig.model_validate(doc["modelConfig"])
    line = f"{model.get('name')} via ModelConfig {mc.name}" + (
        f" (resourceVersion {mc.resourceVersion})" if mc.resourceVersion else ""
    )
    return line + f" at {mc.baseURL}"


def _cost_summary(ctx: RunContext) -> tuple[dict[str, Any] | None, str]:
    """The run's cost so far (``RunContext.cost``: its tokens at the prices its checkpoint
    keeps) and its limit: (JSON object ``{amount, currency, max_cost, prices}`` or None when the
    model has no prices, one text line)."""
    from .snapshot import format_cost

    cost, prices, limit = ctx.cost(), ctx.prices, ctx.budget.max_cost
    if cost is None or prices is None:
        return None, "not counted: the run's model has no prices"
    doc = {"amount": round(cost, 9), "currency": prices.currency, "max_cost": limit, "prices": prices.model_dump(mode="json")}
    line = format_cost(cost, prices.currency) + (
        f" of max_cost {format_cost(limit, prices.currency)}" if limit is not None else " (no max_cost)"
    )
    rate = f"{prices.promptPerMillionTokens:g} prompt, {prices.completionPerMillionTokens:g} completion per million tokens"
    return doc, f"{line}; at {rate}"


@app.command()
@click.argument("run")
@dsn_option
@click.option("-o", "output", default="text", show_default=True, help="text or json")
@click.option(
    "-w",
    "--watch",
    is_flag=True,
    help="show it again whenever it changes, until the run ends or waits for a person (Ctrl-C stops)",
)
def status(run: str, dsn: str | None, output: str, watch: bool) -> None:
    """Phase, whether a runner is alive, iteration, tokens, budget and any pending approval of a run.

    ``-w``/``--watch``: shown again (the screen cleared first on a terminal) each time the run
    changes, and every few seconds for the runner's heartbeat; returns (exit 0) once the run
    has ended or waits for a decision or a reply, or on Ctrl-C.

    ``-o json``: ``context``, ``pending``, ``runner`` (``alive``, ``state``, ``heartbeat_age_s``,
    ``runner_id``, ``pid``, ``host``), ``next`` (``state`` and ``message``: what the run waits
    for), ``awaiting`` (every call awaiting a decision now), ``decided`` (decisions recorded for
    the paused batch, applied when the run goes on), ``budget`` (applied, declared,
    classifier, which limits it lowered), ``usage`` (``prompt_tokens``, ``completion_tokens``,
    ``total_tokens``, ``duration_ms``, ``lost_replies``: every reply the model endpoint answered
    counts, also one a crash lost before its turn was saved; ``lost_replies`` says how many of
    those the figures include), ``cost`` (``amount`` in ``currency``, ``max_cost``, the
    ``prices`` it is counted at; null when the run's model has no prices), ``spend``
    (``tokens`` / ``max_tokens``, ``cost`` / ``max_cost`` in ``currency``, null when not
    counted or not set, and ``summary``, the line the approval prompt and the inbox show) and ``modelConfig``
    (the ModelConfig the run was registered with: endpoint, limits, prices; null for the scripted
    model), ``deadline`` (``seconds``: spec.activeDeadlineSeconds, ``age_s``, ``passed``; null
    without one) and ``decisions_closed`` (``reason`` and ``message``: why the run, not ended
    yet, can use no decision any more, past its deadline or asked to cancel; ``awaiting`` is
    then empty; null when it can).
    """
    store = _open_store(dsn)
    key = _run_key(run)
    if watch:
        _watch_status(store, key, output)
    else:
        _show_status(store, key, output)


#: Phases in which ``status --watch`` stops: the run waits for a person.
_WAITING_PHASES = (Phase.WAITING_FOR_APPROVAL.value, Phase.WAITING_FOR_INPUT.value)


def _watch_status(store: Store, key: str, output: str, *, every_s: float = 0.5, refresh_s: float = 5.0) -> None:
    """``status --watch``: :func:`_show_status` now, then again when the store's mark of the run
    moves (checked every ``every_s`` seconds: a checkpoint, a decision, a takeover, a cancel
    request) or ``refresh_s`` seconds passed (the runner's heartbeat age); returns once the run
    has ended or waits for a person (:data:`_WAITING_PHASES` with a call not decided yet), or on
    Ctrl-C. Raises click's Exit (2) when the run has no checkpoint."""
    import time

    shown_mark: object = None
    shown_at = 0.0
    try:
        while True:
            mark = store.change_marks().get(key)
            if mark != shown_mark or time.monotonic() - shown_at >= refresh_s:
                if output == "text" and out.is_terminal:
                    out.clear()
                _show_status(store, key, output)
                shown_mark, shown_at = mark, time.monotonic()
                loaded = store.load_context(key)
                phase = loaded[0].status.phase if loaded is not None else None
                # Waits for a person: a call awaits a decision or a reply (once each is decided, a
                # runner or a resume goes on: still watched); or waits for nothing that can come.
                if phase in TERMINAL_PHASES or (
                    phase in _WAITING_PHASES and (store.awaiting(key) or store.decisions_closed(key) is not None)
                ):
                    return
                if output == "text":
                    out.print(styled(("watching: shown again when it changes; Ctrl-C stops", "dim")))
            time.sleep(every_s)
    except KeyboardInterrupt:
        return


def _show_status(store: Store, key: str, output: str) -> None:
    """Print the status of the run ``key`` once (``output``: text or json; see ``status``).
    Raises click's Exit (2) when the run has no checkpoint."""
    from .liveness import batch_waits, runner_state, runner_story

    run = key.removeprefix("default/")
    loaded = store.load_context(key)
    if loaded is None:
        raise _fail(f"no run named {run!r} has a checkpoint")
    ctx, pending = loaded
    view = _awaiting_view(store, key, pending)
    info = runner_state(store, key)
    decided = {d["call_id"]: d["decision"] for d in view["decided"]}
    state, story = runner_story(info, ctx.status.phase, *batch_waits(pending.call_ids if pending else [], decided))
    short = key.removeprefix("default/")
    # Past its deadline, or asked to cancel, a run that still reads Waiting... can use no decision:
    # say so, never show its calls as awaiting one (issue 31 item 5).
    closed = store.decisions_closed(key) if ctx.status.phase not in TERMINAL_PHASES else None
    clock = store.run_clock(key)
    deadline_doc = (
        {"seconds": clock[1], "age_s": round(clock[0], 1), "passed": clock[0] >= clock[1]}
        if clock is not None and clock[1] is not None
        else None
    )
    undecided = [a for a in (pending.awaiting if pending is not None and closed is not None else []) if a.call_id not in decided]
    if closed is not None and not info.alive:
        state = "ending"
        story = f"no runner; the run waits for nothing any more ({closed.reason}): `agentfast resume {short}` ends it"
    elif closed is not None:
        story += f"; it ends at its next safe point ({closed.reason})"
    if state == "waiting_for_decision":
        story += (
            f"; decide with `agentfast approve {short} CALL_ID`, `deny ... --reason ...` or `complete ... --result ...`,"
            f" then `agentfast resume {short}`"
        )
    elif state in ("decided_resume_needed", "interrupted"):
        story += f"; resume to continue: `agentfast resume {short}`"
    budget_doc, budget_line = _budget_summary(ctx)
    cost_doc, cost_line = _cost_summary(ctx)
    from .snapshot import spend_summary

    spend_line = spend_summary(ctx)
    if output == "json":
        doc = {
            "context": ctx.model_dump(mode="json"),
            "pending": pending.model_dump(mode="json") if pending else None,
            **view,
            "runner": info.to_json(),
            "next": {"state": state, "message": story},
            "budget": budget_doc,
            "usage": {**ctx.usage.model_dump(mode="json"), "lost_replies": ctx.usage.lost_replies},
            "cost": cost_doc,
            "spend": {
                "tokens": ctx.usage.total_tokens,
                "max_tokens": ctx.budget.max_tokens,
                "cost": cost_doc["amount"] if cost_doc else None,
                "max_cost": ctx.budget.max_cost,
                "currency": cost_doc["currency"] if cost_doc else None,
                "summary": spend_line,
            },
            "modelConfig": (record.spec.get("modelConfig") if (record := store.get_run(key)) is not None else None),
            "deadline": deadline_doc,
            "decisions_closed": {"reason": closed.reason, "message": closed.message} if closed is not None else None,
        }
        out.print_json(json.dumps(doc))
        return
    from rich.table import Column, Table

    c, u, b = ctx.counters, ctx.usage, ctx.budget
    # fold: a long word (an arguments digest, an id) breaks across lines whole, never cut with "…"
    t = Table(Column(), Column(overflow="fold"), show_header=False, box=None)
    t.add_row("run", key)
    if closed is not None:  # what it waited for can no longer come: say why, not what it awaited
        t.add_row("phase", f"{ctx.status.phase} ({closed.reason}): {closed.message}")
    else:
        t.add_row(
            "phase", f"{ctx.status.phase} ({ctx.status.reason})" + (f": {ctx.status.message}" if ctx.status.message else "")
        )
    if deadline_doc is not None:
        ended = ctx.status.phase in TERMINAL_PHASES
        t.add_row(
            "deadline",
            f"{deadline_doc['seconds']:g} s (spec.activeDeadlineSeconds)"
            + ("" if ended else f"; the run is {deadline_doc['age_s']:.0f} s old")
            + ("; the deadline has passed" if deadline_doc["passed"] and not ended else ""),
        )
    t.add_row("runner", story)
    shown = _iteration_shown(ctx, pending.awaiting if pending is not None and ctx.status.phase not in TERMINAL_PHASES else [])
    paused = f" (paused in it: {c.iterations} committed)" if shown != c.iterations else ""
    t.add_row("iteration", f"{shown} of {b.max_iterations}{paused}")
    t.add_row("spent", spend_line)
    lost = f"; {u.lost_replies} model replies lost to crashes, paid for and counted" if u.lost_replies else ""
    t.add_row("tokens", f"{u.total_tokens} of {b.max_tokens} (prompt {u.prompt_tokens}, completion {u.completion_tokens}{lost})")
    t.add_row("active time", f"{u.duration_ms} ms of {b.max_duration_ms} ms (time waiting for a decision is not counted)")
    t.add_row("cost", cost_line)
    t.add_row("budget", budget_line)
    record = store.get_run(key)
    if record is not None:
        t.add_row("model", one_line(_model_config_line(record.spec)))
    t.add_row("tool calls", f"{c.tool_calls} ({c.tool_errors} raised, {c.malformed_tool_calls} malformed)")
    t.add_row("resumes", str(c.resumes))
    for a in view["awaiting"]:
        note = " (in flight when a runner died: may already have run)" if a["reason"] == "in_flight_not_idempotent" else ""
        t.add_row("awaiting", one_line(f"{a['call_id']} {a['tool']}({a['arguments']}){note}"))
        t.add_row("", f"arguments digest {a['arguments_digest']} (approve ... --digest binds to it)")
    why = closed.reason if closed is not None else ""
    for a in undecided:
        t.add_row("not decided", one_line(f"{a.call_id} {a.tool_call.name}({a.tool_call.arguments}): never runs ({why})"))
    for d in view["decided"]:
        t.add_row(
            "decided",
            one_line(
                f"{d['call_id']}: {d['decision']}"
                + (f" ({d['reason']})" if d["reason"] else "")
                + (f" by {d['decided_by']}" if d["decided_by"] else "")
                + (f"; recorded in time, never used ({why})" if closed is not None else "")
            ),
        )
    out.print(t, highlight=False)


@app.command()
@click.argument("run")
@dsn_option
@click.option(
    "-o",
    "--output",
    "output_format",
    default="text",
    show_default=True,
    help="text, or json: transcript, journal, decisions and checkpoints",
)
def history(run: str, dsn: str | None, output_format: str) -> None:
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
    origin = store.fork_origin(key)
    if output_format == "json":
        data = _history_json(key, snap, journal, decisions, checkpoints)
        data["forked_from"] = {"run": origin[0], "iteration": origin[1]} if origin else None
        out.print_json(data=data)
        return
    by_position = {(e.iteration, e.position): e for e in journal}
    if origin is not None:
        out.print(
            styled(
                ("forked from", "bold"),
                f" {origin[0]} at iteration {origin[1]}: its transcript and journal up to there are the source's"
                " (tool results reused, never re-run; idempotency keys of the source's uid)",
            )
        )
    out.rule(f"transcript of {key}")
    iteration = 0
    for i, m in enumerate(snap.messages):
        label = m.role + (f" {m.name}" if m.name else "") + (f" (tool-call id {m.tool_call_id})" if m.tool_call_id else "")
        parts: list[str | tuple[Any, str]] = [(f"{i:>3}", "dim"), " ", (label, "bold")]
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
        out.print(
            styled(
                (e.call_id, "bold"),
                f"  {e.tool_call.name}  {state}  attempts {e.attempts}",
                f"  {', '.join(flags)}" if flags else "",
                f"  idempotency key {e.idempotency_key}",
            )
        )
    if not journal:
        out.print("(no tool calls)")
    if decisions:
        out.rule("decisions")
        for d in decisions:
            out.print(
                styled(
                    (d["call_id"], "bold"),
                    f"  {d['decision']}  by {d.get('decided_by') or '?'}  at {_when(d.get('decided_at'))}",
                    f"  reason: {d['reason']}" if d.get("reason") else "",
                )
            )
    out.rule("checkpoints (latest kept)")
    for cp in checkpoints:
        out.print(
            styled(
                (f"checkpoint {cp.checkpoint_id}", "bold"),
                f"  iteration {cp.iteration}  messages {cp.message_count}"
                f"  {cp.phase}  epoch {cp.epoch}  saved {_when(cp.saved_at)}",
            )
        )
    earlier = store.earlier_runs(key)
    if earlier:
        out.rule("earlier runs of this name (kept for audit)")
        for r in earlier:
            out.print(styled((r.run_id, "bold"), f"  uid {r.run_uid}  (agentfast history {r.run_id})"))


def _history_json(
    key: str, snap: StateSnapshot, journal: list[JournalEntry], decisions: list[dict[str, Any]], checkpoints: list[CheckpointInfo]
) -> dict[str, Any]:
    """``history -o json``: the whole record of a run, machine-readable (times as ISO 8601 UTC)."""
    return {
        "run": key,
        "status": snap.context.status.model_dump(mode="json"),
        "transcript": [m.model_dump(mode="json") for m in snap.messages],
        "journal": [
            {
                "call_id": e.call_id,
                "iteration": e.iteration,
                "position": e.position,
                "tool": e.tool_call.name,
                "tool_call_id": e.tool_call.id,
                "arguments": e.tool_call.arguments,
                "gated": e.gated,
                "idempotent": e.idempotent,
                "state": e.state,
                "attempts": e.attempts,
                "idempotency_key": e.idempotency_key,
                "result": e.result.model_dump(mode="json") if e.result else None,
            }
            for e in journal
        ],
        "decisions": [{k: _iso(v) for k, v in d.items() if k != "run_id"} for d in decisions],
        "checkpoints": [
            {
                "checkpoint_id": c.checkpoint_id,
                "iteration": c.iteration,
                "messages": c.message_count,
                "phase": c.phase,
                "epoch": c.epoch,
                "saved_at": _iso(c.saved_at),
            }
            for c in checkpoints
        ],
    }


def _when(value: Any) -> str:
    """A time for people: ``2025-11-30 19:42:03 +0000`` in the local zone. ``value``: ms since the
    Unix epoch or a datetime; anything else as it is, ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value / 1000, tz=UTC)
    if isinstance(value, datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
    return str(value)


def _iso(value: Any) -> Any:
    """A time for machines (ISO 8601, UTC, ms); other values unchanged. ``value``: ms since the Unix epoch or a datetime."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = datetime.fromtimestamp(value / 1000, tz=UTC)
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return value


def _iteration_shown(ctx: RunContext, awaiting: list[AwaitedCall]) -> int:
    """The iteration a run is in, as status, list and the inbox show it: a run paused on calls
    awaiting a decision is in their iteration (the N of ``call-N-P``: not committed yet, so one
    more than ``counters.iterations``); any other run, its committed iterations."""
    return max([ctx.counters.iterations, *(a.iteration for a in awaiting)])


@app.command("list")
@dsn_option
def list_runs(dsn: str | None) -> None:
    """Every run in the store: its phase, iteration, the calls awaiting a decision (or a reply),
    its age (since it started) and its cost so far (``-``: its model has no prices)."""
    from rich.table import Column, Table

    from .snapshot import Phase, format_cost
    from .store import UnreadableState

    store = _open_store(dsn)
    # As `kubectl get`: no column rules, ages for times; the run, its phase and figures never
    # break, the awaited calls fold (an 80-column terminal holds a paused run's row).
    t = Table(
        Column("run", no_wrap=True),
        Column("phase", no_wrap=True),
        Column("iter", no_wrap=True, justify="right"),
        Column("awaiting", overflow="fold", min_width=14),
        Column("age", no_wrap=True, justify="right"),
        Column("cost", no_wrap=True, justify="right"),
        box=None,
        pad_edge=False,
        header_style="bold",
    )
    unreadable = []
    now = output.now_ms()
    for rec, info in store.list_runs():
        problem = None
        if info is not None and not info.readable:  # a newer release's row: its phase may not mean what ours does
            problem = UnreadableState(
                rec.run_id,
                "agentfast_checkpoints",
                f"checkpoint {info.checkpoint_id} (iteration {info.iteration})",
                "written by a newer or unknown release" + ("" if info.phase in get_args(Phase) else f" (phase {info.phase!r})"),
                found_version=info.schema_version,
            )
            loaded = None
        else:
            try:
                loaded = store.load_context_and_awaiting(rec.run_id) if info is not None else None
            except UnreadableState as unread:  # one run this release cannot read never hides the others
                problem, loaded = unread, None
        if problem is not None:
            unreadable.append(problem)
            version = f"schema_version {info.schema_version}, " if info is not None else ""
            t.add_row(rec.run_id, f"unreadable ({version}phase {info.phase if info else '-'})", "-", "-", "-", "-")
            continue
        if loaded is None or info is None:  # registered, no checkpoint yet
            t.add_row(rec.run_id, "-", "-", "-", "-", "-")
            continue
        ctx, awaiting = loaded
        cost, prices = ctx.cost(), ctx.prices
        t.add_row(
            rec.run_id,
            ctx.status.phase,
            str(_iteration_shown(ctx, awaiting)),
            ", ".join(f"{a.call_id} {a.tool_call.name}" for a in awaiting) or "-",
            output.age(ctx.session.started_at, now),
            format_cost(cost, prices.currency) if cost is not None and prices is not None else "-",
        )
    out.print(t)
    if unreadable:
        for e in unreadable:
            err.print(f"error: {e}")
        raise click.exceptions.Exit(ExitCode.BAD_INPUT)


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@app.command()
@dsn_option
@click.option(
    "--kube", is_flag=True, help="the cluster's AgentRuns, read and decided as you (your kubeconfig), not a local store"
)
@namespace_option
@click.option(
    "--auth",
    type=click.Choice(["kubeconfig", "token"]),
    default="kubeconfig",
    show_default=True,
    help="(--kube) whose identity acts: the kubeconfig's user, or each browser's own bearer token (a login page; how the chart deploys it)",
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="the address to listen on (a loopback address unless --auth token)"
)
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="a Host header to serve (repeat it); default: localhost and the loopback addresses, any with --auth token",
)
def ui(
    dsn: str | None, kube: bool, namespace: str | None, auth: str, host: str, port: int, allowed_hosts: tuple[str, ...]
) -> None:
    """Serve the approvals inbox: runs, calls awaiting a decision, transcripts, and approve / deny /
    complete / reply in a browser, updated live (docs/ui.md).

    Locally it shows the store's runs (the embedded server, or --dsn) and decides as you. With
    --kube it shows a namespace's AgentRuns and patches decisions into them as the kubeconfig's
    user, so RBAC and the approval policy apply and status records you; a --dsn store then adds
    transcripts. Deciding as you, it listens only on a loopback address and serves only the
    address it prints, which carries a secret (AGENTFAST_UI_TOKEN fixes it): other accounts of
    the machine reach loopback too. With --auth token (the chart's deployment) each browser logs
    in with its own Kubernetes token instead."""
    import base64
    import hashlib
    import secrets

    from cryptography.fernet import Fernet

    from .inbox import KubeInbox, LocalInbox, Refused, api_server_configuration, token_client
    from .ui import Access, create_app

    if auth == "token" and not kube:
        raise _fail("--auth token is for the cluster: add --kube")
    if auth != "token" and host not in _LOOPBACK_HOSTS:
        raise _fail(
            f"--host {host}: this inbox decides as you, so it listens only on a loopback address"
            f" ({', '.join(_LOOPBACK_HOSTS)}); to serve others, deploy it with --kube --auth token (each person logs in as themselves)"
        )
    # A cluster inbox only reads the store (transcripts); the operator migrates it.
    store = _open_store(dsn, migrate=not kube) if dsn or not kube else None
    # Whoever has the address decides as you: it carries a secret (loopback is not per user).
    secret = os.environ.get("AGENTFAST_UI_TOKEN") or secrets.token_urlsafe(24)
    if len(secret) < 16:
        raise _fail(
            "AGENTFAST_UI_TOKEN: at least 16 characters (it is all that stands between another account and your decisions)"
        )
    # The login cookie's key (--auth token): replicas share it, so each gets it from a Secret.
    configured = os.environ.get("AGENTFAST_UI_COOKIE_KEY", "").encode()
    cookie_key = base64.urlsafe_b64encode(hashlib.sha256(configured).digest()) if configured else Fernet.generate_key()
    try:
        if not kube:
            assert store is not None
            access, where = Access(shared=LocalInbox(store, _who()), secret=secret), f"the local store, deciding as {_who()}"
        elif auth == "kubeconfig":
            shared = KubeInbox.from_kubeconfig(namespace, store)
            access = Access(shared=shared, secret=secret)
            where = f"namespace {shared.namespace} of the cluster, deciding as {shared.user}"
        else:
            base = api_server_configuration()
            default_ns = namespace or "default"
            access = Access(
                token_inbox=lambda token: KubeInbox(token_client(token, base), default_ns, store), cookie_key=cookie_key
            )
            where = f"the cluster at {base.host}, each person as themselves (namespace {default_ns} first)"
    except Refused as e:
        raise _fail(str(e)) from None
    hosts = list(allowed_hosts) or (["*"] if auth == "token" else [*_LOOPBACK_HOSTS, "[::1]"])
    app_ = create_app(access, allowed_hosts=hosts)
    import uvicorn

    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{port}/" + (f"?token={secret}" if auth != "token" else "")
    err.print(f"agentfast ui: {address} shows {where}", highlight=False, markup=False)
    uvicorn.run(app_, host=host, port=port, log_level=os.environ.get("AGENTFAST_UI_LOG_LEVEL", "warning"), access_log=False)


@app.command()
@click.argument("run")
@dsn_option
def delete(run: str, dsn: str | None) -> None:
    """Delete a run and all its data: transcript, journal, approvals, checkpoints."""
    store = _open_store(dsn)
    if not store.delete_run(_run_key(run)):
        raise _fail(f"no run named {run!r}")
    out.print(f"deleted {_run_key(run)}")


@app.command()
@click.argument("directory", metavar="DIR")
@click.option(
    "--name",
    "package",
    metavar="PACKAGE",
    help="the Python package's name; default: DIR's name, lower-cased, with - and . made _",
)
def init(directory: str, package: str | None) -> None:
    """Start a package of your own tools in the new folder DIR.

    It holds the package (two tools: one gated, one not idempotent with a recovery check), an
    AgentRun naming them, the scripted model's script for it, a test that runs it for real, a
    Dockerfile building a runner image FROM agentfast's, and a README. Exit 2, writing nothing,
    when DIR exists and is not empty, or PACKAGE is not a Python identifier.
    """
    from .scaffold import ScaffoldError, check_package, default_package, write

    name = package or default_package(directory)
    try:
        check_package(name)
    except ScaffoldError as e:
        raise _fail(f"{e}" + ("" if package else f" (it comes from the name of {directory})")) from None
    try:
        written = write(directory, name)
    except ScaffoldError as e:
        raise _fail(str(e)) from None
    except OSError as e:
        raise _fail(f"cannot write {directory}: {e.strerror or e}") from None
    from pathlib import Path

    root = Path(directory).expanduser()
    out.print(f"wrote {root}/ (package {name}):", highlight=False, markup=False)
    for path in written:
        out.print(f"  {path.relative_to(root).as_posix()}", highlight=False, markup=False)
    out.print(
        f"next, in {root}: pip install -e '.[test]' (in agentfast's venv), then `agentfast run agentrun.yaml`"
        " and `pytest`; README.md says how to build and ship the image",
        highlight=False,
        markup=False,
    )


def main() -> None:
    """Console-script entry point.

    Output is best effort (runner/output.py): a closed or full stdout/stderr or a terminal that
    cannot encode a character never changes what a command does or its exit code.

    No garbage collection during start-up (:func:`_collect_from_now_on`, called when a driven run's
    start-up is over, :class:`_Progress`, and here at the end): start-up (imports, classes,
    pydantic schemas, the connection) makes ~50,000 objects that live as long as the process and
    next to no cyclic garbage, and collecting while they are made costs a short command ~25 ms of
    its ~0.3 s, a resume ~15% of its model client's import (issue 15).
    """
    gc.disable()
    output.install()
    try:
        # Logs go to stderr as JSON lines (pods) or readable lines (a terminal): runner/logs.py.
        logs.configure(os.environ.get("AGENTFAST_LOG_LEVEL", "WARNING"))
        app()
    except ModuleNotFoundError as e:
        # An adapter or command whose extra is not installed (a LangGraph run without
        # agentfast[langgraph]): one line saying what to install, not a traceback.
        hint = missing_extra(e)
        if hint is None:
            raise
        err.print(f"error: {hint}")
        sys.exit(ExitCode.BAD_INPUT)
    except Exception as e:
        # A setting of the environment this install cannot honour (AGENTFAST_FAULT without test
        # support, a malformed size), or state this release cannot interpret. Only the store
        # raises UnreadableState, so a command that has not imported it cannot have raised it.
        store = sys.modules.get(f"{__package__}.store")
        if not isinstance(e, SettingError) and (store is None or not isinstance(e, store.UnreadableState)):
            raise
        err.print(f"error: {e}")
        sys.exit(ExitCode.BAD_INPUT)
    finally:
        output.finish()
        _collect_from_now_on()
