# shellcheck shell=bash disable=SC2034
# Sourced by every hack/ script (and bench/run.sh): the one place for the repository's root, the cache
# directory outside it, the project's Python environment, and the steps both e2e providers share.
#   ensure_python_env   an isolated virtualenv for agentfast (PY_EXTRAS picks the extras), idempotent:
#                       it reinstalls only when pyproject.toml or the package's file list changed
#   e2e_helm_install    the chart on a cluster, for hack/cluster/e2e.sh (a single-node cluster built from
#   e2e_pytest          upstream on this machine) and hack/kind-e2e.sh (kind), so both run the same thing
#   ensure_chromium     Debian's chromium and chromium-driver, for the inbox's browser test
#   find_helm           HELM: a helm of the pinned version already here ($HELM, or `helm` on PATH), or none
#   ensure_helm         HELM: a helm that runs (as found, else the pinned one hack/cluster/build.sh builds)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AGENTFAST_CACHE="${AGENTFAST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentfast}"
VENV="${AGENTFAST_VENV:-$AGENTFAST_CACHE/venv}"
# Extras this caller needs (pyproject.toml); hack/demo.sh asks for none.
PY_EXTRAS="${PY_EXTRAS-test,langgraph,operator,bench,otel}"

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
  key="$( { cat "$REPO/pyproject.toml"; cd "$REPO" && find runner operator testing -type f ! -path '*/__pycache__/*' | LC_ALL=C sort; } \
          | sha256sum | cut -c1-16) $REPO"
  [[ -f "$stamp" ]] && have="$(cut -s -d' ' -f3 "$stamp")"
  [[ -f "$stamp" && "$(cut -d' ' -f1-2 "$stamp")" == "$key" ]] || missing=1
  # The strict editable install's link tree lives in this checkout (build/): a checkout deleted and
  # cloned again at the same path matches the stamp but has no tree, so check that the venv's
  # agentfast is this checkout's.
  if [[ "$missing" == 0 ]] && ! (cd / && "$VENV/bin/python" -c '
import os, sys, agentfast.runner, agentfast.testing
sys.exit(0 if os.path.realpath(agentfast.runner.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)
' "$REPO") >/dev/null 2>&1; then
    missing=1
  fi
  want="$(echo "$have,$PY_EXTRAS" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
  for extra in ${PY_EXTRAS//,/ }; do
    [[ ",$have," == *",$extra,"* ]] || missing=1
  done
  if [[ "$missing" == 1 ]]; then
    echo "==> installing agentfast${want:+[$want]} and its pinned dependencies into $VENV (about a minute on an empty pip cache)"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --upgrade "pip>=24"
    local install=("$VENV/bin/pip" install --disable-pip-version-check --config-settings editable_mode=strict -e "$REPO${want:+[$want]}")
    if [[ "${AGENTFAST_PIP_PROGRESS:-}" == 1 ]]; then
      # hack/demo.sh: a count of the packages pip collects instead of a minute of silence, and
      # not pip's ~150 lines; its whole output is shown only if it fails.
      local log; log="$(mktemp)"
      "${install[@]}" --progress-bar off >"$log" 2>&1 &
      local pid=$! n=0 shown=-1
      while [ -t 1 ] && kill -0 "$pid" 2>/dev/null; do  # on a terminal: one line, rewritten
        n="$(grep -c '^Collecting ' "$log" || true)"
        [[ "$n" == "$shown" ]] || { printf '    %s packages collected\r' "$n"; shown="$n"; }
        sleep 1
      done
      wait "$pid" || { echo; cat "$log" >&2; rm -f "$log"; echo "==> pip install failed (its output is above)" >&2; return 1; }
      printf '    %s packages collected, installed\n' "$(grep -c '^Collecting ' "$log" || true)"
      rm -f "$log"
    else
      "${install[@]}" --quiet
    fi
    echo "$key $want" > "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}

# ensure_chromium: a real browser for the inbox's test (tests/test_ui.py): Debian's chromium and
# chromium-driver, installed with apt when missing, or the ones AGENTFAST_CHROMIUM and
# AGENTFAST_CHROMEDRIVER name. Fails, never skips, where neither is possible.
ensure_chromium() {
  if [[ -n "${AGENTFAST_CHROMIUM:-}" || -n "${AGENTFAST_CHROMEDRIVER:-}" ]]; then
    [[ -x "${AGENTFAST_CHROMIUM:-}" && -x "${AGENTFAST_CHROMEDRIVER:-}" ]] && return 0
    echo "AGENTFAST_CHROMIUM and AGENTFAST_CHROMEDRIVER must both name executables" >&2; return 1
  fi
  local missing=() p
  for p in chromium chromium-driver; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [[ "${#missing[@]}" == 0 ]] && return 0
  if ! command -v apt-get >/dev/null || [[ "$(id -u)" != 0 ]]; then
    echo "tests/test_ui.py needs a browser: apt-get install ${missing[*]} as root, or set AGENTFAST_CHROMIUM and AGENTFAST_CHROMEDRIVER" >&2
    return 1
  fi
  echo "==> apt: installing ${missing[*]} (the inbox's browser test)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

E2E_RELEASE="${AGENTFAST_RELEASE:-agentfast}"
E2E_NAMESPACE="${AGENTFAST_NAMESPACE:-agentfast-system}"

# e2e_image_parts IMAGE -> "REPOSITORY TAG"
e2e_image_parts() {
  local image="$1"
  echo "${image%:*} ${image##*:}"
}

# find_helm: export HELM as a helm already on this machine, building nothing: $HELM when the caller
# set it (it must run), else the `helm` on PATH when `helm version --short` names the pinned version
# (hack/cluster/versions.sh HELM_VERSION). Returns 1 when there is none (then build the pinned one).
find_helm() {
  local want found
  if [[ -n "${HELM:-}" ]]; then
    "$HELM" version --short >/dev/null 2>&1 || { echo "HELM=$HELM does not run" >&2; exit 1; }
    export HELM
    return 0
  fi
  want="$(. "$REPO/hack/cluster/versions.sh" && echo "$HELM_VERSION")"
  found="$(command -v helm || true)"
  if [[ -n "$found" && "$("$found" version --short 2>/dev/null)" == "$want"* ]]; then
    export HELM="$found"
    echo "==> helm $want on PATH ($found): not built" >&2
    return 0
  fi
  return 1
}

# ensure_helm: set HELM to a helm that runs: $HELM if the caller set it, else the version pinned in
# hack/cluster/versions.sh, built by hack/cluster/build.sh into the cache when missing. Exits if none runs.
ensure_helm() {
  if ! find_helm; then
    bash "$REPO/hack/cluster/build.sh" helm >/dev/null 2>&1 || bash "$REPO/hack/cluster/build.sh" helm >&2
    HELM="$AGENTFAST_CACHE/k8s-bin/$(. "$REPO/hack/cluster/versions.sh" && echo "$K8S_VERSION")/helm"
  fi
  "$HELM" version --short >/dev/null || { echo "helm does not run: $HELM" >&2; exit 1; }
}

# A team's own tools, as a team ships them (docs/tools.md, "Bring your own tools"): the package
# `agentfast init` writes, in an image built FROM the production image with the Dockerfile it
# writes. tests/e2e/test_own_tools.py runs it; the chart allows the image and the module.
TEAM_TOOLS_DIR=team-tools    # `agentfast init team-tools`: the package team_tools
TEAM_TOOLS_MODULE=team_tools

# build_team_tools_image BASE TAG WORKDIR: `agentfast init` run by BASE's own CLI into
# WORKDIR/team-tools (made anew), then `docker build` of that folder FROM BASE, offline.
build_team_tools_image() {
  local base="$1" tag="$2" work="$3"
  rm -rf "$work"; mkdir -p "$work"; chmod 0777 "$work"
  docker run --rm --network none --user 10001:10001 -v "$work:/out" --entrypoint agentfast "$base" \
    init "/out/$TEAM_TOOLS_DIR" >/dev/null
  docker build --network none --build-arg AGENTFAST_IMAGE="$base" -t "$tag" "$work/$TEAM_TOOLS_DIR"
}

# e2e_helm_install REPO_ROOT IMAGE: install the project's chart with the image already on the node
# (the Dockerfile's testing target: the suite's runs use the scripted model and, besides the
# examples, the test tools of agentfast.testing, which the chart is told to allow).
# The chart is optional while it does not exist yet; the smoke tests do not need it. An ended run's
# runner pods live 30 s (E2E_POD_TTL_SECONDS), not the chart's hour, so that
# tests/e2e/test_runner_pod_ttl.py sees them go; long enough for the tests that look at a pod just
# after its run ended. The admin's MCP server test-mcp is the test MCP server tests/e2e/test_mcp.py
# deploys in the release namespace, and python may start a stdio MCP server (docs/mcp.md). The
# approvals inbox runs too (ui.enabled; tests/e2e/test_ui.py).
e2e_helm_install() {
  local root="$1" image="$2" helm="${HELM:-helm}" repo tag extra=()
  read -r repo tag <<<"$(e2e_image_parts "$image")"
  # The production image (no test support) may run a run too (tests/e2e/test_images.py), and a
  # team's image of its own tools, with its module (tests/e2e/test_own_tools.py).
  local images="${AGENTFAST_PRODUCTION_IMAGE:+${AGENTFAST_PRODUCTION_IMAGE%:*}}"
  images="$images${AGENTFAST_TEAM_IMAGE:+${images:+,}${AGENTFAST_TEAM_IMAGE%:*}}"
  [ -z "$images" ] || extra+=(--set "runner.allowedImages={$images}")
  if [ ! -f "$root/charts/agentfast/Chart.yaml" ]; then
    echo "e2e: charts/agentfast/Chart.yaml not present; skipping helm install" >&2
    return 0
  fi
  # Helm installs a chart's crds/ once and never upgrades them (helm.sh/docs/chart_best_practices/custom_resource_definitions):
  # apply them first, so a cluster kept from an earlier run gets this checkout's schema and CEL rules.
  "${KUBECTL:-kubectl}" apply --server-side --force-conflicts -f "$root/charts/agentfast/crds/"
  "${KUBECTL:-kubectl}" wait --for condition=established --timeout=60s -f "$root/charts/agentfast/crds/"
  "$helm" upgrade --install "$E2E_RELEASE" "$root/charts/agentfast" \
    --namespace "$E2E_NAMESPACE" --create-namespace \
    --set image.repository="$repo" --set image.tag="$tag" --set image.pullPolicy=IfNotPresent \
    --set runner.podTTLSecondsAfterFinished="${E2E_POD_TTL_SECONDS:-30}" \
    --set "runner.allowedModules={agentfast.runner.examples,agentfast.testing,$TEAM_TOOLS_MODULE}" "${extra[@]}" \
    --set "mcp.servers.test-mcp.url=http://agentfast-test-mcp.$E2E_NAMESPACE.svc:8000/mcp" \
    --set "mcp.allowedCommands={python -m agentfast.testing.mcp_server}" \
    --set "mcp.allowedEnv={MCP_TEST_EFFECTS}" \
    --set ui.enabled=true \
    --wait --timeout 5m
  # An operator of the previous release keeps acting until its pod is gone (it holds the leader
  # Lease until then), and the runner pods it makes name the previous image, which images.sh has
  # replaced on the node: start the tests only once no operator pod of an older template is left.
  "${KUBECTL:-kubectl}" -n "$E2E_NAMESPACE" rollout status deploy/"$E2E_RELEASE"-operator --timeout=5m
  local hash
  hash="$("${KUBECTL:-kubectl}" -n "$E2E_NAMESPACE" get rs -l app.kubernetes.io/component=operator \
    -o jsonpath='{range .items[?(@.status.replicas>0)]}{.metadata.labels.pod-template-hash}{"\n"}{end}' | tail -1)"
  "${KUBECTL:-kubectl}" -n "$E2E_NAMESPACE" wait --for=delete pod \
    -l "app.kubernetes.io/component=operator,pod-template-hash!=$hash" --timeout=5m 2>/dev/null || true
}

# e2e_pytest REPO_ROOT [PYTEST ARGS...]: the e2e suite against $KUBECONFIG.
e2e_pytest() {
  local root="$1"; shift
  [ -n "${KUBECONFIG:-}" ] || { echo "e2e: KUBECONFIG is not set" >&2; return 1; }
  (cd "$root" && "${PYTHON:-python3}" -m pytest -m e2e tests/e2e "$@")
}
