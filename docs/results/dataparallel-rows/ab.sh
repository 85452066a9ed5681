#!/usr/bin/env bash
# DataParallel "auto" against DDP with sparse embeddings, 4 workers at 1 Gbit/s (root), 40 steps, each
# COMMIT from a worktree of its own (no instrument), rounds alternating the commits' order.
#   docs/results/dataparallel-rows/ab.sh OUT ROUNDS "deeplight ncf" COMMIT...
#   then python3 docs/results/dataparallel-rows/summary.py OUT/WORKLOAD for each workload
set -euo pipefail
repo=$(cd "$(dirname "$0")/../../.." && pwd)
out=$(realpath -m "$1") rounds=$2 workloads=$3; shift 3
commits=("$@")
for c in "${commits[@]}"; do
  [ -d "/tmp/sparcoll-ab-$c" ] || git -C "$repo" worktree add -f "/tmp/sparcoll-ab-$c" "$c" --detach -q
done
for workload in $workloads; do
  mkdir -p "$out/$workload"
  for round in $(seq 1 "$rounds"); do
    order=("${commits[@]}")
    [ $((round % 2)) = 0 ] && order=($(printf '%s\n' "${commits[@]}" | tac))
    for c in "${order[@]}"; do
      OMP_NUM_THREADS=1 PYTHONPATH=/tmp/sparcoll-ab-$c/src timeout 900 "$repo/.venv/bin/python" -m sparcoll train \
        --workload "$workload" --workload-option sparse_embeddings=true --workers 4 --network 1gbit --steps 40 \
        --warmup 2 --compare poseidon,ddp --json "$out/$workload/$c-r$round.json" > "$out/$workload/$c-r$round.txt" 2>&1
      echo "$(date +%T) $workload $c round $round done"
    done
  done
done
for c in "${commits[@]}"; do git -C "$repo" worktree remove --force "/tmp/sparcoll-ab-$c"; done
