#!/usr/bin/env bash
# 4 ranks' small calls with gathered data in a ring allgather (5cb607b) and gathered at rank 0 and
# broadcast (d8e66d5), alternated, ROUNDS rounds of benchmarks/small_tensors.py each.
# OLD and NEW are worktrees of the two commits.
#   docs/results/small-rooted-gather/run.sh OLD NEW [ROUNDS=3]
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
out=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
run() { PYTHONPATH=$2/src timeout 600 .venv/bin/torchrun --standalone --nproc-per-node 4 \
          benchmarks/small_tensors.py 2>/dev/null > "$out/$1.txt"; }
for r in $(seq 1 "$rounds"); do run old-4w-r$r "$old" ; run new-4w-r$r "$new"; done
