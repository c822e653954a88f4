#!/usr/bin/env bash
# Every test tier the project has, on a fresh machine: installs what it needs, idempotently.
# Extra arguments go to pytest (e.g. hack/test.sh -k flagship).
source "$(dirname "$0")/lib-py.sh"
ensure_python_env
cd "$REPO"
exec python -m pytest tests --ignore=tests/e2e "$@"
