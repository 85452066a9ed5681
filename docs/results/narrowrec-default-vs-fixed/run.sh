#!/usr/bin/env bash
# narrowrec with dense embedding gradients (tables of 100K rows), 4 workers on loopback, 200 steps:
# the default block size and the block size fixed at each of $FIXED (default "32 64"), each its own
# run, ROUNDS rounds, the order rotated every round. SRC is a worktree (its src on PYTHONPATH).
#   [FIXED="32 64"] docs/results/narrowrec-default-vs-fixed/run.sh SRC [ROUNDS=6] [OUT=this directory]
set -euo pipefail
src=$1 rounds=${2:-6}
out=$(mkdir -p "${3:-$(dirname "$0")}" && cd "${3:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
configs=(default ${FIXED:-32 64})
for r in $(seq 1 "$rounds"); do
  for i in "${!configs[@]}"; do
    c=${configs[$(( (i + r) % ${#configs[@]} ))]}
    extra=(); [ "$c" = default ] || extra=(--block-size "$c")
    PYTHONPATH=$src/src timeout 1200 ./dev sparcoll train --workload narrowrec --workers 4 --network none \
        --steps 200 --workload-option table_rows=100000,100000 --comm sparcoll "${extra[@]}" \
        --json "$out/$c-r$r.json" > "$out/$c-r$r.txt" 2>/dev/null || echo "FAILED: $c round $r" >&2
  done
done
