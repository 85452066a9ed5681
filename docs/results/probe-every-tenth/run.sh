#!/usr/bin/env bash
# The density probe inside backward on every step (OLD) against one step in ten, left out of the
# times (NEW): the same training runs, alternated, ROUNDS rounds (4 workers, 1 Gbit/s emulated; root).
#   docs/results/probe-every-tenth/run.sh OLD_SRC NEW_SRC OUT [ROUNDS=3]
# OLD_SRC/NEW_SRC: each commit's src directory (a worktree's); plans from docs/results/plan-left-running.
set -euo pipefail
cd "$(dirname "$0")/../../.."
old=$1 new=$2 out=$(realpath -m "$3") rounds=${4:-3}
plans=$PWD/docs/results/plan-left-running
mkdir -p "$out"
export OMP_NUM_THREADS=1
run() {   # version src name round workload modes plan|- workload-option-args...
  local version=$1 src=$2 name=$3 round=$4 workload=$5 modes=$6 plan=$7; shift 7
  [ "$plan" != - ] && set -- "$@" --plan "$plan"
  PYTHONPATH=$src timeout 1200 .venv/bin/python -m sparcoll train --workload "$workload" "$@" --workers 4 \
    --network 1gbit --steps 30 --warmup 2 --compare "$modes" \
    --json "$out/$name-$version-r$round.json" 2>&1 | grep -v '━' > "$out/$name-$version-r$round.txt" \
    || echo "$(date +%T) FAILED: $name $version round $round" >&2
}
for round in $(seq 1 "$rounds"); do
  for version in old new; do
    src=$old; [ "$version" = new ] && src=$new
    w=ncf+sparse_embeddings_true
    run $version "$src" ncf-sparse "$round" ncf "ddp,planned,poseidon:strategy=$plans/$w-u-ring.json" \
      "$plans/$w-plan.json" --workload-option sparse_embeddings=true
    w=deeplight+sparse_embeddings_true
    run $version "$src" deeplight-sparse "$round" deeplight \
      "ddp,poseidon:strategy=$plans/$w-without-compression.json,poseidon:strategy=$plans/$w-u-efsignsgd.json" \
      - --workload-option sparse_embeddings=true
    run $version "$src" ncf "$round" ncf "ddp,planned,poseidon:strategy=$plans/ncf-u-efsignsgd.json" \
      "$plans/ncf-plan.json"
  done
done
