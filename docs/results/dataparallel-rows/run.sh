#!/usr/bin/env bash
# DataParallel "auto" against DDP on deeplight with sparse embeddings, 4 workers at 1 Gbit/s (root),
# each COMMIT in a worktree of its own with instrument.patch applied (it logs, per rank, when each
# synchronization started after the step's first gradient and how long the synchronization thread
# spent on it), rounds alternating the commits' order.
#   docs/results/dataparallel-rows/run.sh OUT ROUNDS COMMIT...      then summary.py OUT
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd)
out=$(realpath -m "$1") rounds=$2; shift 2
commits=("$@")
mkdir -p "$out"
for c in "${commits[@]}"; do
  wt=/tmp/sparcoll-rows-$c
  [ -d "$wt" ] || { git -C "$repo" worktree add -f "$wt" "$c" --detach -q && patch -s -d "$wt" -p1 -F3 < "$here/instrument.patch"; }
done
for round in $(seq 1 "$rounds"); do
  order=("${commits[@]}")
  [ $((round % 2)) = 0 ] && order=($(printf '%s\n' "${commits[@]}" | tac))
  for c in "${order[@]}"; do
    SYNC_LOG="$out/$c-r$round-sync" OMP_NUM_THREADS=1 PYTHONPATH=/tmp/sparcoll-rows-$c/src timeout 900 \
      "$repo/.venv/bin/python" -m sparcoll train --workload deeplight --workload-option sparse_embeddings=true \
      --workers 4 --network 1gbit --steps 40 --warmup 2 --compare poseidon,ddp --json "$out/$c-r$round.json" \
      > "$out/$c-r$round.txt" 2>&1
    echo "$(date +%T) $c round $round done"
  done
done
for c in "${commits[@]}"; do git -C "$repo" worktree remove --force "/tmp/sparcoll-rows-$c"; done
