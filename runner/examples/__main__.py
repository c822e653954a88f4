"""``python -m agentfast.runner.examples``: give the example tools their role in the chart's trial
Postgres and print their DSN, as runner pods reach the server.

Run it in the trial server's pod, which has what it needs in its environment (the superuser's
password, ``POSTGRES_PASSWORD``, used over the pod's loopback only; the operator's DSN,
``AGENTFAST_DSN``, for the address runners use)::

    kubectl -n demo create secret generic agentfast-tools --from-literal=EXAMPLE_TOOLS_DSN="$(
      kubectl -n agentfast-system exec deploy/agentfast-postgresql -- python -m agentfast.runner.examples)"

The role's password is derived from the superuser's (HMAC-SHA256), so every call prints the same
DSN and a Secret made earlier stays valid. For your own Postgres, call :func:`provision` with an
admin DSN instead.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys

import psycopg

from . import EXAMPLES_ROLE, provision

#: The trial server's superuser (SUPERUSER in operator/devpostgres.py: the runner never imports the operator).
TRIAL_SUPERUSER = "postgres"


def main() -> int:
    superuser_password = os.environ.get("POSTGRES_PASSWORD", "")
    runners_dsn = os.environ.get("AGENTFAST_DSN", "")
    if not superuser_password or not runners_dsn:
        print(
            "run this in the chart's trial Postgres pod (kubectl exec deploy/agentfast-postgresql -- ...): "
            "it needs POSTGRES_PASSWORD and AGENTFAST_DSN",
            file=sys.stderr,
        )
        return 2
    password = hmac.new(superuser_password.encode(), EXAMPLES_ROLE.encode(), hashlib.sha256).hexdigest()[:32]
    where = psycopg.conninfo.conninfo_to_dict(runners_dsn)
    dbname = where.get("dbname") or "postgres"
    admin = psycopg.conninfo.make_conninfo(host="127.0.0.1", user=TRIAL_SUPERUSER, password=superuser_password, dbname=dbname)
    provision(admin, password=password)
    print(
        psycopg.conninfo.make_conninfo(
            host=where.get("host", ""),
            port=where.get("port") or "5432",
            dbname=dbname,
            user=EXAMPLES_ROLE,
            password=password,
            connect_timeout="5",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
