#!/usr/bin/env bash
# The stored plans of docs/results/plan-ringfuse (sparse embeddings) and the ring for every tensor,
# before (OLD: every collective waited for on the synchronization thread) and after (NEW), alternated,
# ROUNDS rounds, DDP in the same run as each.
#   docs/results/dataparallel-left-running/run_plans.sh OLD_SRC NEW_SRC OUT [ROUNDS=3]
set -uo pipefail
cd "$(dirname "$0")/../../.."
old=$1 new=$2 out=$3 rounds=${4:-3}
mkdir -p "$out"
export OMP_NUM_THREADS=1
for round in $(seq 1 "$rounds"); do
  for w in deeplight ncf; do
    dir=docs/results/plan-ringfuse/$w+sparse_embeddings_true
    for version in old new; do
      src=$old; [ $version = new ] && src=$new
      PYTHONPATH=$src timeout 600 ./dev sparcoll train --workload $w --workload-option sparse_embeddings=true \
          --workers 4 --network 1gbit --steps 30 \
          --compare ddp,poseidon:strategy=$dir-plan.json,poseidon:strategy=$dir-u-ring.json \
          --json "$out/$w-$version-r$round.json" > "$out/$w-$version-r$round.txt" 2>&1 \
          || echo "FAILED $w $version $round" >&2
    done
  done
done
