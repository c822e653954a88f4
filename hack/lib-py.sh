# Sourced by hack/*.sh: an isolated Python environment for agentfast, outside the repo.
# Idempotent: it reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AGENTFAST_CACHE="${AGENTFAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentfast}"
VENV="${AGENTFAST_VENV:-$AGENTFAST_CACHE/venv}"
PY_EXTRAS="${PY_EXTRAS:-test,langgraph,operator,bench}"

ensure_python_env() {
  local python="${PYTHON:-python3}"
  if ! "$python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    echo "agentfast needs Python >= 3.11 (found: $("$python" --version 2>&1))" >&2
    exit 1
  fi
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "==> creating $VENV"
    "$python" -m venv "$VENV"
  fi
  local stamp="$VENV/.agentfast-installed"
  local want
  want="$(cat "$REPO/pyproject.toml" | sha256sum | cut -c1-16) $REPO $PY_EXTRAS"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "==> installing agentfast and its pinned dependencies into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --upgrade "pip>=24"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$REPO[$PY_EXTRAS]"
    echo "$want" > "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}
