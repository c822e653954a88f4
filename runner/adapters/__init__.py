"""Adapters: each drives one agent framework under the runtime's guarantees, through the core's
public adapter contract (:class:`~agentfast.runner.loop.RunnerBase`) and nothing else of it.

:data:`ADAPTERS` maps a ``spec.adapter`` value to its adapter class, named rather than imported:
:func:`adapter_class` imports only the one a run asks for (LangGraph is an optional extra, and a
heavy import). The CLI, the composition root, is the only caller; the core never imports this
package (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..loop import RunnerBase
    from ..spec import AgentRun
    from ..store import RunRecord, Store

#: ``spec.adapter`` -> how the rows of its ``sdk_state`` are named (``Store.fork_run``'s
#: ``sdk_refs``), without importing the adapter (the operator registers forks too); None: no rows.
SdkRefs = Callable[[dict[str, Any]], tuple[Sequence[str], Sequence[tuple[str, str]]]]

#: ``spec.adapter`` -> ``module:class`` of its adapter, the module relative to this package.
ADAPTERS: dict[str, str] = {
    "vanilla": "vanilla:VanillaRunner",
    "langgraph": "langgraph:LangGraphRunner",
}


def adapter_class(name: str) -> type[RunnerBase]:
    """The adapter class for ``spec.adapter`` = ``name``, its module imported now.

    Raises KeyError for a name no adapter has (``spec.py`` admits only the keys of
    :data:`ADAPTERS`), ImportError when the adapter's extra is not installed."""
    module, _, attr = ADAPTERS[name].partition(":")
    cls: type[RunnerBase] = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    return cls


def sdk_row_refs(name: str) -> SdkRefs | None:
    """How a run of adapter ``name`` names the rows of its ``sdk_state`` (None: it has none)."""
    if name == "langgraph":
        from .langgraph_state import state_row_refs

        return state_row_refs
    return None


def register_fork(store: Store, run: AgentRun, run_id: str, uid: str | None, doc: dict[str, Any]) -> RunRecord:
    """Register ``run`` (its ``spec.forkFrom`` set; id ``run_id``, uid ``uid`` or a new one,
    document ``doc``) as a fork of its source: ``Store.fork_run`` at ``spec.forkFrom.iteration``.
    Idempotent: a run already registered under ``run_id`` is returned as it is (the caller
    compares uids). The source must have this run's adapter and graph (the copied state's
    shape) and declare its budget (a fork goes on with the source's, copied: a cost limit only
    this run declared would never be checked). Its prices are its own model's
    (``run.prices()``: its ModelConfig's, or the scripted model's), never the source's
    (``Store.fork_run``). Raises ForkRefused (also for those), RunExists, UidTaken,
    StoreUnavailable."""
    from ..store import ForkRefused

    existing = store.get_run(run_id)
    if existing is not None:
        return existing
    source = run.fork_source()
    fork = run.spec.forkFrom
    assert source is not None and fork is not None
    record = store.get_run(source)
    if record is None:
        raise ForkRefused(f"spec.forkFrom: no run {source} to fork")
    src = record.spec.get("spec") or {}
    for field in ("adapter", "graph"):
        mine = doc["spec"].get(field) or ({} if field == "graph" else "vanilla")
        theirs = src.get(field) or ({} if field == "graph" else "vanilla")
        if mine != theirs:
            raise ForkRefused(f"spec.{field} differs from the source's ({source}): a fork goes on with the state its source made")
    # Compared as parsed: a document registered by `agentfast run` holds the defaults, one from the API server the CRD's.
    if type(run.spec.budget).model_validate(src.get("budget") or {}) != run.spec.budget:
        raise ForkRefused(
            f"spec.budget differs from the source's ({source}): a fork goes on with the budget its source was given"
            " (its copied context); declare the source's"
        )
    return store.fork_run(
        source,
        fork.iteration,
        run_id,
        uid or str(uuid.uuid4()),
        doc,
        prices=run.prices(),
        sdk_refs=sdk_row_refs(run.spec.adapter),
    )
