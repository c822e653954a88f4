# Sourced by hack/*.sh: an isolated Python environment for agentfast, outside the repo.
# Idempotent: it reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AGENTFAST_CACHE="${AGENTFAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentfast}"
VENV="${AGENTFAST_VENV:-$AGENTFAST_CACHE/venv}"
# Extras this caller needs (pyproject.toml); hack/demo.sh asks for none.
PY_EXTRAS="${PY_EXTRAS-test,langgraph,operator,bench}"

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
  # The stamp holds "<pyproject hash> <repo> <extras installed>". A caller that wants a subset of
  # what is installed (the demo after the tests) installs nothing; otherwise the union is installed,
  # so the demo never takes away what the tests need, nor the reverse.
  local stamp="$VENV/.agentfast-installed" key have="" want extra missing=0
  # The editable install is strict (a tree of links under build/, the package-dir mapping made real
  # on disk) so that static tools (mypy, import-linter, an IDE) resolve agentfast.* as Python does;
  # the default mode maps runner/ through an import hook they do not follow. A strict tree sees edits
  # but not new or removed files, so the list of the package's files is part of the stamp.
  key="$( { cat "$REPO/pyproject.toml"; cd "$REPO" && find runner operator -type f ! -path '*/__pycache__/*' | LC_ALL=C sort; } \
          | sha256sum | cut -c1-16) $REPO"
  [[ -f "$stamp" ]] && have="$(cut -s -d' ' -f3 "$stamp")"
  [[ -f "$stamp" && "$(cut -d' ' -f1-2 "$stamp")" == "$key" ]] || missing=1
  want="$(echo "$have,$PY_EXTRAS" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
  for extra in ${PY_EXTRAS//,/ }; do
    [[ ",$have," == *",$extra,"* ]] || missing=1
  done
  if [[ "$missing" == 1 ]]; then
    echo "==> installing agentfast${want:+[$want]} and its pinned dependencies into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --upgrade "pip>=24"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --config-settings editable_mode=strict -e "$REPO${want:+[$want]}"
    echo "$key $want" > "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}
