#!/usr/bin/env bash
# The large chaos run: at least --kills SIGKILLs (default 1,000) of real runner processes at
# random points, on both adapters, each run resumed until done and compared with an
# uninterrupted one; plus zombies, Postgres restarts, read-only, revoked grants and a full disk
# at large sizes. Writes the results into docs/reliability.md (between its chaos-results markers).
#
#   hack/chaos.sh [--kills N] [--seed S] [--workers W] [--hours H]
#
# Same seed, same schedule of fault points, delays and decisions (external kills land where the
# timing of the machine puts them). The CI-size version of the same tests: pytest tests/chaos.
source "$(dirname "$0")/lib.sh"

kills=1000
seed=""
workers=2
hours=3
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kills) kills="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --hours) hours="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$seed" ]] || seed=$(( (RANDOM << 15 | RANDOM) + 1 ))

ensure_python_env
cd "$REPO"
results="$(mktemp -d /tmp/agentfast-chaos-XXXXXX)"
echo "==> chaos: $kills kills, seed $seed, $workers runs at a time (results in $results)"
export AGENTFAST_CHAOS_KILLS="$kills" AGENTFAST_CHAOS_SEED="$seed" AGENTFAST_CHAOS_WORKERS="$workers"
export AGENTFAST_CHAOS_BUDGET_S="$(( hours * 3600 ))" AGENTFAST_CHAOS_RESULTS="$results"
start=$(date +%s)
set +e
python -m pytest tests/chaos -q -s -p no:cacheprovider --timeout=0 -ra
rc=$?
set -e
command="hack/chaos.sh --kills $kills --seed $seed --workers $workers"
python -m tests.chaos.report --results "$results" --doc docs/reliability.md --command "$command" \
  --seed "$seed" --rc "$rc" --elapsed-s "$(( $(date +%s) - start ))"
echo "==> docs/reliability.md updated (pytest exit code $rc)"
exit "$rc"
