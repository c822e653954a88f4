#!/usr/bin/env bash
# The operator under load in one command (issue 14 item 5): `bash bench/cluster_load.sh [--runs 100,300,1000]`.
# Runs against the cluster of KUBECONFIG (default: the one hack/cluster/up.sh built) with the chart
# installed in agentfast-system; each N gets its own namespace, deleted before the next.
set -euo pipefail
cd "$(dirname "$0")/.."
export KUBECONFIG="${KUBECONFIG:-$HOME/.cache/agentfast/cluster/kubeconfig}"
PY="${AGENTFAST_PYTHON:-$HOME/.cache/agentfast/venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
exec "$PY" -m bench.cluster_load "$@"
