#!/usr/bin/env bash
# The refund demo on the embedded default: no cluster, no Postgres to install.
# It pauses when the agent asks to issue a refund; approve it at the prompt, or from another
# terminal with the command it prints. Extra arguments go to `agentfast run`.
source "$(dirname "$0")/lib.sh"
PY_EXTRAS="" AGENTFAST_PIP_PROGRESS=1 ensure_python_env   # the demo needs no extras: no LangGraph, no operator, no test tools
# The commands the run prints (agentfast approve ..., resume ...) work as typed once this is on PATH.
echo "==> agentfast is $VENV/bin/agentfast; in another terminal: export PATH=\"$VENV/bin:\$PATH\"" >&2
exec agentfast run "$REPO/manifests/examples/refund.yaml" "$@"
