#!/usr/bin/env bash
# The agentfast benchmark in one command: `bash bench/run.sh` (full, ~10 min, rewrites the
# generated block of docs/benchmarks.md) or `bash bench/run.sh --quick` (< 1 min, prints).
# It starts its own embedded PostgreSQL under /tmp and deletes it afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${AGENTFAST_PYTHON:-/root/.cache/agentfast/venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
exec "$PY" -m bench "$@"
