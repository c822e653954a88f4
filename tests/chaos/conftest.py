"""Fixtures of the chaos suite: the session's seed and its reference (uninterrupted) runs."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from agentfast.runner.store import Store

from .harness import Reference, Scenario, create_database, drop_database, reference_run, session_seed


class ReferenceBook:
    """One uninterrupted run per scenario, made once per session (each in a database of its own)."""

    def __init__(self, pg_server, directory: Path, seed: int):
        self.pg_server, self.directory, self.seed = pg_server, directory, seed
        self._refs: dict[str, Reference] = {}
        self._lock = threading.Lock()

    def _make(self, sc: Scenario) -> Reference:
        name = create_database(self.pg_server, "chaos_ref")
        try:
            with Store(self.pg_server.dsn_for(name), retry_for_s=60) as store:
                store.migrate()
                return reference_run(sc, dsn=self.pg_server.dsn_for(name), store=store, directory=self.directory, seed=self.seed)
        finally:
            drop_database(self.pg_server, name)

    def prefetch(self, scenarios: Iterable[Scenario], parallel: int = 2) -> None:
        """Make the missing references, ``parallel`` at a time."""
        todo = [sc for sc in scenarios if sc.name not in self._refs]
        errors: list[BaseException] = []

        def one(sc: Scenario) -> None:
            try:
                ref = self._make(sc)
                with self._lock:
                    self._refs[sc.name] = ref
                print(f"reference {sc.name}: {ref.state.iterations} iterations, active {ref.active_s:.2f}s")
            except BaseException as err:
                errors.append(err)

        while todo:
            batch, todo = todo[:parallel], todo[parallel:]
            threads = [threading.Thread(target=one, args=(sc,), daemon=True) for sc in batch]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]

    def __getitem__(self, name: str) -> Reference:
        return self._refs[name]

    def get(self, sc: Scenario) -> Reference:
        if sc.name not in self._refs:
            self.prefetch([sc])
        return self._refs[sc.name]

    def as_dict(self) -> dict[str, Reference]:
        return dict(self._refs)


@pytest.fixture(scope="session")
def chaos_seed() -> int:
    seed = session_seed()
    print(f"\nchaos seed {seed} (replay: AGENTFAST_CHAOS_SEED={seed})")
    return seed


@pytest.fixture(scope="session")
def references(pg_server, tmp_path_factory, chaos_seed: int) -> ReferenceBook:
    return ReferenceBook(pg_server, tmp_path_factory.mktemp("chaos-ref"), chaos_seed)
