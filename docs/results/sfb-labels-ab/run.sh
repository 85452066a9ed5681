#!/usr/bin/env bash
# DataParallel's hybrid on vgg's head, the code at 4613092 (before SFB's labelled gathers on a group of
# their own, the autograd.grad check and the repeated-layer rule) and at 8deed33, alternated, 3 rounds;
# then DDP once, for its communication share.
#   sudo docs/results/sfb-labels-ab/run.sh OUT   (git worktrees at /tmp/wt/before and /tmp/wt/now)
set -uo pipefail
out=$1; mkdir -p "$out"; export OMP_NUM_THREADS=1
cd "$(dirname "$0")/../../.."
for round in 1 2 3; do
  for tree in before now; do
    PYTHONPATH=/tmp/wt/$tree/src timeout 900 .venv/bin/sparcoll train --workload vgg --batch-size 32 --workers 4 \
      --network 1gbit --steps 8 --warmup 2 --comm poseidon --json "$out/$tree-r$round.json" > "$out/$tree-r$round.txt" 2>&1
  done
done
PYTHONPATH=/tmp/wt/now/src timeout 900 .venv/bin/sparcoll train --workload vgg --batch-size 32 --workers 4 \
  --network 1gbit --steps 8 --warmup 2 --comm ddp --json "$out/ddp-r1.json" > "$out/ddp-r1.txt" 2>&1
