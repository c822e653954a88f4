#!/usr/bin/env bash
# Every test tier the project has, on a fresh machine: installs what it needs, idempotently,
# with caches outside the repo (~/.cache/agentfast; docs/testing.md has the timings).
#   lint     the checkers: ruff and the import-linter contracts (hack/lint.sh), seconds
#   local    unit, store, process-kill and chaos tiers: real Postgres, real SIGKILLs (pytest);
#            the chart tests need helm, built alone from the Go module proxy (no Kubernetes build)
#   cluster  a real single-node Kubernetes, the image built offline, the chart installed, the
#            e2e suite (hack/cluster/e2e.sh)
# Extra arguments go to the local tier's pytest (e.g. hack/test.sh -k flagship). AGENTFAST_TIERS
# narrows the run ("lint", "local", "cluster"); CI runs all three. Every selected tier runs even when an
# earlier one failed; the exit status is non-zero if any failed.
PY_EXTRAS="${PY_EXTRAS-test,langgraph,operator,bench,lint}"  # lint's too: one install, not two
source "$(dirname "$0")/lib.sh"
ensure_python_env
cd "$REPO"
tiers="${AGENTFAST_TIERS:-lint local cluster}"
for t in $tiers; do
  [[ "$t" == lint || "$t" == local || "$t" == cluster ]] || { echo "AGENTFAST_TIERS: unknown tier '$t' (lint, local, cluster)" >&2; exit 2; }
done

failed=()
run_tier() { # NAME COMMAND...
  local name="$1" start=$SECONDS rc=0; shift
  echo "==> tier $name: $*"
  "$@" || rc=$?
  echo "==> tier $name: $([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - start)) s"
  [ "$rc" = 0 ] || failed+=("$name")
}
local_tier() {
  bash hack/cluster/build.sh helm || return
  python -m pytest tests --ignore=tests/e2e "$@"
}

[[ " $tiers " != *" lint "* ]] || run_tier lint bash hack/lint.sh
[[ " $tiers " != *" local "* ]] || run_tier local local_tier "$@"
[[ " $tiers " != *" cluster "* ]] || run_tier cluster bash hack/cluster/e2e.sh -p no:cacheprovider
if [ "${#failed[@]}" -gt 0 ]; then
  echo "==> failed tiers: ${failed[*]}" >&2
  exit 1
fi
echo "==> all tiers passed: $tiers"
