#!/usr/bin/env bash
# Training steps before and after 461a30c (rows of at most 8 words flagged word by word), each kept
# plan of plan-e7fd6da run alone, 4 workers at 1 Gbit/s, the two commits alternated, every other round
# in reversed order:  run.sh BASE_WORKTREE NEW_WORKTREE ROUNDS OUT
set -euo pipefail
cd "$(dirname "$0")/../../.."
base=$1 new=$2 rounds=$3 out=$4
mkdir -p "$out"
export OMP_NUM_THREADS=1
declare -A steps=([deeplight]=60 [ncf]=90)
for round in $(seq 1 "$rounds"); do
  order="base new"; [ $((round % 2)) -eq 0 ] && order="new base"
  for w in deeplight ncf; do
    for v in $order; do
      src=$base; [ "$v" = new ] && src=$new
      PYTHONPATH=$src/src timeout 900 ./dev sparcoll train --workload $w --workers 4 --network 1gbit \
        --steps ${steps[$w]} --comm planned --plan docs/results/plan-e7fd6da/$w-plan.json \
        --json "$out/$w-$v-r$round.json" > "$out/$w-$v-r$round.txt" 2> "$out/$w-$v-r$round.err"
    done
  done
done
