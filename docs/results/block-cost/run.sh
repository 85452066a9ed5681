#!/usr/bin/env bash
# narrowrec with dense embedding gradients (tables of 100K rows), 4 workers on loopback, 200 steps:
# OLD's default block size, NEW's default (against DDP in the same run) and NEW with the block size
# fixed at each of $FIXED (default 32), alternated, ROUNDS rounds. OLD and NEW are worktrees.
# COMPARE=sparcoll runs NEW's default alone (no DDP run after it).
#   [FIXED="16 64"] [COMPARE=sparcoll] docs/results/block-cost/run.sh OLD NEW [ROUNDS=3] [OUT=this directory]
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
out=$(mkdir -p "${4:-$(dirname "$0")}" && cd "${4:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
train() { local name=$1 src=$2; shift 2; PYTHONPATH=$src/src timeout 1200 ./dev sparcoll train \
            --workload narrowrec --workers 4 --network none --steps 200 \
            --workload-option table_rows=100000,100000 "$@" --json "$out/$name-r$r.json" \
            > "$out/$name-r$r.txt" 2>/dev/null || echo "FAILED: $name round $r" >&2; }
for r in $(seq 1 "$rounds"); do
  train old-default "$old" --comm sparcoll
  train new-default "$new" --compare "${COMPARE:-sparcoll,ddp}"
  for b in ${FIXED:-32}; do train "new-fixed$b" "$new" --comm sparcoll --block-size "$b"; done
done
