#!/usr/bin/env bash
# DataParallel "auto" against DDP on the tiny gpt and vgg, 2 workers on loopback, 30 steps of one
# sequence (gpt) or 8 samples (vgg): each COMMIT from a worktree of its own, rounds alternating the
# commits' order.
#   docs/results/hybrid-collective-charge/run.sh OUT ROUNDS COMMIT...    then summary.py OUT
set -euo pipefail
repo=$(cd "$(dirname "$0")/../../.." && pwd)
out=$(realpath -m "$1") rounds=$2; shift 2
commits=("$@")
mkdir -p "$out"
for c in "${commits[@]}"; do
  [ -d "/tmp/sparcoll-charge-$c" ] || git -C "$repo" worktree add -f "/tmp/sparcoll-charge-$c" "$c" --detach -q
done
for round in $(seq 1 "$rounds"); do
  order=("${commits[@]}")
  [ $((round % 2)) = 0 ] && order=($(printf '%s\n' "${commits[@]}" | tac))
  for workload in gpt:1 vgg:8; do
    for c in "${order[@]}"; do
      OMP_NUM_THREADS=1 PYTHONPATH=/tmp/sparcoll-charge-$c/src timeout 600 "$repo/.venv/bin/python" -m sparcoll train \
        --workload "${workload%:*}" --workload-option tiny=true --workers 2 --network none --steps 30 \
        --batch-size "${workload#*:}" --compare ddp,poseidon --json "$out/${workload%:*}-$c-r$round.json" \
        > "$out/${workload%:*}-$c-r$round.txt" 2>&1
      echo "$(date +%T) ${workload%:*} $c round $round done"
    done
  done
done
for c in "${commits[@]}"; do git -C "$repo" worktree remove --force "/tmp/sparcoll-charge-$c"; done
