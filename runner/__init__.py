"""agentfast's durable runtime: snapshot model, Postgres store, journal, loop, adapters, CLI.

Start with ``docs/architecture.md``. The runner never imports the operator.
"""

__version__ = "0.1.0"
