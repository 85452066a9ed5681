#!/usr/bin/env bash
# narrowrec with dense embedding gradients (tables of 100K rows), 4 workers on loopback, 200 steps:
# the default block size against a fixed 32, with the MLP at 64-32 (6,273 elements before a table in
# its DDP bucket: every 32-element row straddles two 32-element blocks) and at 63-32 (6,176: aligned).
# Alternated, 3 rounds.   docs/results/narrowrec-alignment/run.sh OUT_DIR
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
out=$1; mkdir -p "$out"
for round in 1 2 3; do
  for hidden in "64,32" "63,32"; do
    for mode in default fixed32; do
      extra=(); [ $mode = fixed32 ] && extra=(--block-size 32)
      timeout 600 ./dev sparcoll train --workload narrowrec --workers 4 --network none --steps 200 \
        --workload-option table_rows=100000,100000 --workload-option hidden=$hidden --comm sparcoll "${extra[@]}" \
        --json $out/h${hidden/,/-}-$mode-r$round.json > $out/h${hidden/,/-}-$mode-r$round.txt 2>&1 || echo FAILED $hidden $mode $round
    done
  done
done
