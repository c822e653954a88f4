#!/usr/bin/env bash
# The e2e suite on the local cluster tier, from nothing: build the binaries, make the images, start
# the cluster, install the chart, run pytest tests/e2e. Every step is incremental (see each script).
# The same chart install and tests as hack/kind-e2e.sh. KEEP_CLUSTER=0 stops the cluster afterwards.
# shellcheck source=hack/cluster/lib.sh
. "$(dirname "$0")/lib.sh"

# The project's Python environment for pytest (hack/lib.sh, shared with hack/test.sh).
ensure_python_env
ensure_chromium  # tests/e2e/test_ui.py logs in to the deployed inbox in a real browser
PYTHON="$(command -v python)"
export PYTHON

"$HACK_CLUSTER_DIR/build.sh"
"$HACK_CLUSTER_DIR/images.sh"
KUBECONFIG="$("$HACK_CLUSTER_DIR/up.sh")"
export KUBECONFIG
if [ "${KEEP_CLUSTER:-1}" = 0 ]; then trap '"$HACK_CLUSTER_DIR/down.sh"' EXIT; fi
export PATH="$BIN_DIR:$PATH"
# The per-build tags images.sh made (agentfast-testing:dev-<id>), so an upgrade rolls the pods.
# The chart runs the testing image (the suite's runs use the scripted model and test tools); the
# suite checks the production image apart (tests/e2e/test_images.py).
IMAGE="$(cat "$AGENTFAST_CACHE/images/testing.ref" 2>/dev/null || echo "$TESTING_IMAGE")"
PRODUCTION="$(cat "$AGENTFAST_CACHE/images/project.ref" 2>/dev/null || echo "$PROJECT_IMAGE")"
export AGENTFAST_PRODUCTION_IMAGE="$PRODUCTION" AGENTFAST_TEAM_IMAGE="$TEAM_IMAGE"
HELM="$BIN_DIR/helm" e2e_helm_install "$REPO_ROOT" "$IMAGE"
AGENTFAST_IMAGE="$IMAGE" e2e_pytest "$REPO_ROOT" "$@"
