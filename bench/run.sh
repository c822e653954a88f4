#!/usr/bin/env bash
# The agentfast benchmark in one command: `bash bench/run.sh` (full, ~10 min, rewrites the
# generated block of docs/benchmarks.md) or `bash bench/run.sh --quick` (< 1 min, prints).
# It makes the Python environment it needs (hack/lib.sh, the same one hack/test.sh uses),
# starts its own embedded PostgreSQL under /tmp and deletes it afterwards.
source "$(dirname "$0")/../hack/lib.sh"
PY_EXTRAS="${PY_EXTRAS_BENCH:-langgraph,bench}" ensure_python_env
cd "$REPO"
exec python -m bench "$@"
