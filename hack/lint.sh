#!/usr/bin/env bash
# The checkers (docs/testing.md): ruff's lint rules and its formatter (ruff format --check), the
# import-linter architecture contracts and mypy, all configured in pyproject.toml. Any finding fails. The first tier of hack/test.sh.
# mypy reads the operator's, the LangGraph adapter's and the tracing (otel) libraries, so their extras are installed too.
PY_EXTRAS="${PY_EXTRAS-lint,operator,langgraph,otel}"
source "$(dirname "$0")/lib.sh"
ensure_python_env
cd "$REPO"
rc=0
echo "==> ruff check"
ruff check --no-cache . || rc=1
echo "==> ruff format --check"
ruff format --check --no-cache . || rc=1
echo "==> lint-imports"
# No cache dir: it would be written into the repository.
lint-imports --no-cache || rc=1
echo "==> mypy"
# Its cache in the venv, not the repository; strict for the runner, checked for the operator.
mypy --cache-dir "$VENV/mypy-cache" -p agentfast.runner -p agentfast.operator -p agentfast.testing || rc=1
exit "$rc"
