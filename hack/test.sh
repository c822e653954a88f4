#!/usr/bin/env bash
# Every test tier the project has, on a fresh machine: installs what it needs, idempotently,
# with caches outside the repo (~/.cache/agentfast; docs/testing.md has the timings).
#   1. the cluster tier's tools (kubectl, helm, ...) from the Go module proxy: the chart tests need helm
#   2. unit, store, process-kill and chaos tiers: real Postgres, real SIGKILLs (pytest tests)
#   3. the cluster tier: a real single-node Kubernetes, the image built offline, the chart
#      installed, the e2e suite (hack/cluster/e2e.sh)
# Extra arguments go to pytest in step 2 (e.g. hack/test.sh -k flagship). AGENTFAST_TIERS
# narrows the run ("local", "cluster"); CI runs both.
source "$(dirname "$0")/lib-py.sh"
ensure_python_env
cd "$REPO"
tiers="${AGENTFAST_TIERS:-local cluster}"

bash hack/cluster/build.sh
if [[ " $tiers " == *" local "* ]]; then
  python -m pytest tests --ignore=tests/e2e "$@"
fi
if [[ " $tiers " == *" cluster "* ]]; then
  bash hack/cluster/e2e.sh -p no:cacheprovider
fi
