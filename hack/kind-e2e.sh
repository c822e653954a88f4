#!/usr/bin/env bash
# The e2e suite on kind, for machines with a container registry (a laptop, hosted CI):
#   kind create cluster -> docker build -> kind load docker-image -> helm install -> pytest tests/e2e
# The same Dockerfile, chart install and tests as the local tier (hack/cluster/e2e.sh); only the
# cluster provider differs. Needs docker, kind, kubectl, helm, a Python with the project's test
# dependencies, and chromium with chromedriver (installed with apt where it can). KEEP_CLUSTER=1 leaves the cluster up afterwards.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"

CLUSTER="${KIND_CLUSTER_NAME:-agentfast}"
# kind v0.30's node image for the Kubernetes minor the local tier pins (hack/cluster/versions.sh).
NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.34.0}"
IMAGE="${AGENTFAST_IMAGE:-agentfast-testing:dev}"  # the Dockerfile's testing target, which the chart runs
PRODUCTION="${AGENTFAST_PRODUCTION_IMAGE:-agentfast:dev}"

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "kind-e2e: $tool is required" >&2; exit 1; }
done
ensure_chromium  # tests/e2e/test_ui.py logs in to the deployed inbox in a real browser

if ! kind get clusters 2>/dev/null | grep -x >/dev/null "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --wait 180s
fi
KUBECONFIG="$(mktemp)"
export KUBECONFIG
kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG"
cleanup() {
  rm -f "$KUBECONFIG"
  if [ "${KEEP_CLUSTER:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER"; fi
}
trap cleanup EXIT

TEAM="${AGENTFAST_TEAM_IMAGE:-agentfast-team-tools:dev}"  # a team's own tools, FROM the production image
docker build -t "$PRODUCTION" "$ROOT"
docker build --target testing -t "$IMAGE" "$ROOT"
TEAM_WORK="$(mktemp -d)"
build_team_tools_image "$PRODUCTION" "$TEAM" "$TEAM_WORK"
kind load docker-image "$PRODUCTION" "$IMAGE" "$TEAM" --name "$CLUSTER"
export AGENTFAST_PRODUCTION_IMAGE="$PRODUCTION" AGENTFAST_TEAM_IMAGE="$TEAM"
e2e_helm_install "$ROOT" "$IMAGE"
AGENTFAST_IMAGE="$IMAGE" e2e_pytest "$ROOT" "$@"
