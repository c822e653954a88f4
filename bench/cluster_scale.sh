#!/usr/bin/env bash
# The cluster benchmark in one command (issue 6): `bash bench/cluster_scale.sh [--runs N]`.
# Runs against the cluster of KUBECONFIG (default: the one hack/cluster/up.sh built) with the
# chart installed in agentfast-system; deletes every AgentRun it created before it exits.
set -euo pipefail
cd "$(dirname "$0")/.."
export KUBECONFIG="${KUBECONFIG:-$HOME/.cache/agentfast/cluster/kubeconfig}"
PY="${AGENTFAST_PYTHON:-$HOME/.cache/agentfast/venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
exec "$PY" bench/cluster_scale.py "$@"
