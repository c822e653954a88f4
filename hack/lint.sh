#!/usr/bin/env bash
# The checkers (docs/testing.md): ruff's lint rules and the import-linter architecture contracts,
# both configured in pyproject.toml. Any finding fails. The first tier of hack/test.sh.
PY_EXTRAS="${PY_EXTRAS-lint}"
source "$(dirname "$0")/lib.sh"
ensure_python_env
cd "$REPO"
rc=0
echo "==> ruff check"
ruff check --no-cache . || rc=1
echo "==> lint-imports"
# No cache dir: it would be written into the repository.
lint-imports --no-cache || rc=1
exit "$rc"
