"""Example tools and graphs used by ``manifests/examples`` and the tests.

The example tools keep real records (a refund ledger, case notes, the chaos suite's outbox) so
tests count effects from rows. They keep them as any team's tools would (G11): in a database of
their own, named in their own environment, never with the runner's store credential, which no
tool receives. Their connection is ``EXAMPLE_TOOLS_DSN``: the role ``agentfast_examples``,
whose tables live in the schema of the same name (Postgres's default ``search_path`` starts with
``"$user"``), made by :func:`provision`, with one function, ``run_epoch(run_id)``, through which
the chaos suite's notification service checks fencing tokens:

- locally on the embedded default, ``agentfast`` provisions it in the trial server itself;
- in a cluster, an admin provisions it once and puts the DSN in the Secret ``agentfast-tools`` of
  each namespace that runs the examples (docs/tools.md); the operator mounts that Secret for the
  tool host only;
- the tests provision it in each test database.
"""

from __future__ import annotations

import os
import time

import psycopg
from psycopg import sql

from agentfast.runner.errors import AgentfastError

#: The variable the example tools read their connection from.
EXAMPLES_DSN_ENV = "EXAMPLE_TOOLS_DSN"
#: Their role, and the schema of their tables.
EXAMPLES_ROLE = "agentfast_examples"


class NoExamplesDatabase(AgentfastError, RuntimeError):
    """``EXAMPLE_TOOLS_DSN`` is not set: the example tools have nowhere to keep their records."""


def examples_dsn() -> str:
    """The example tools' own connection string. Raises NoExamplesDatabase when unset."""
    dsn = os.environ.get(EXAMPLES_DSN_ENV, "")
    if not dsn:
        raise NoExamplesDatabase(
            f"the example tools keep their records in a database of their own: set {EXAMPLES_DSN_ENV} "
            "(on a cluster: a key of the Secret agentfast-tools in the run's namespace; see docs/tools.md)"
        )
    return dsn


def provision(admin_dsn: str, *, password: str | None = None) -> str:
    """Make the examples' role (LOGIN, no other attribute) and its schema in ``admin_dsn``'s
    database, idempotently, and return the examples' DSN: ``admin_dsn``'s host, port and database
    with the role as user and ``password`` (None: none is set, for a server that trusts local
    sockets, as the tests' one does; a role made earlier keeps its password). ``admin_dsn`` must
    be able to create roles (a superuser, or a CREATEROLE owner of the database).

    Concurrent calls in one database are serialized by an advisory lock (CREATE ROLE has no IF NOT
    EXISTS); across databases they are retried.
    """
    for attempt in range(10):
        try:
            _provision(admin_dsn, password)
            break
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.InternalError_):
            # Roles are server-wide, advisory locks per database: a provision in another database
            # raced this one ("tuple concurrently updated", a duplicate role). Again, now it exists.
            if attempt == 9:
                raise
            time.sleep(0.05 * (attempt + 1))
    info = psycopg.conninfo.conninfo_to_dict(admin_dsn)
    info.pop("password", None)
    info.pop("passfile", None)
    info["user"] = EXAMPLES_ROLE
    if password is not None:
        info["password"] = password
    return psycopg.conninfo.make_conninfo("", **info)


def _provision(admin_dsn: str, password: str | None) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentfast_examples_provision'))")
            role = sql.Identifier(EXAMPLES_ROLE)
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (EXAMPLES_ROLE,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
            if password is not None:  # as a verifier libpq computes: the text never reaches the server or its log
                verifier = conn.pgconn.encrypt_password(password.encode(), EXAMPLES_ROLE.encode(), b"scram-sha-256").decode()
                conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(role, sql.Literal(verifier)))
            me = conn.execute("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
            if me is not None and not me[1]:
                conn.execute(sql.SQL("GRANT {} TO {}").format(role, sql.Identifier(me[0])))  # to give it a schema
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {} AUTHORIZATION {}").format(role, role))
            # The examples' notification service checks a fencing token against the run's current
            # epoch, as a real service checks it against the latest token it was given. It asks the
            # store through this one function, which returns an epoch and nothing else: the
            # examples' role reads no table of the store (G11).
            conn.execute(
                sql.SQL("""
                CREATE OR REPLACE FUNCTION {}.run_epoch(run text) RETURNS bigint
                LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$  -- pg_temp last: unlisted, it comes first
                BEGIN
                    RETURN (SELECT epoch FROM agentfast_runs WHERE run_id = run);
                EXCEPTION WHEN undefined_table THEN
                    RETURN NULL;
                END $$""").format(role)
            )
            conn.execute(sql.SQL("REVOKE ALL ON FUNCTION {}.run_epoch(text) FROM PUBLIC").format(role))
            conn.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {}.run_epoch(text) TO {}").format(role, role))
