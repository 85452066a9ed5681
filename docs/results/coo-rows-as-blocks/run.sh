#!/bin/bash
# A/B: COO blocks as rows (new, 44932cb) against rows shared in blocks of 16 (old, 6978f16), DataParallel vs DDP;
# worktrees /tmp/wt/old and /tmp/wt/new (git worktree add); rounds 1-2 old first, 3-4 (ROUNDS="3 4" TREES="new old") new first
set -eu
out=${OUT:-docs/results/coo-rows-as-blocks}; mkdir -p $out
cd "$(dirname "$0")/../../.."
for r in ${ROUNDS:-1 2}; do
  for net in none 1gbit; do
    for w in deeplight ncf; do
      for tree in ${TREES:-old new}; do
        PYTHONPATH="/tmp/wt/$tree/src" OMP_NUM_THREADS=1 timeout 900 .venv/bin/python -m sparcoll train --workload $w --workers 4 \
          --network $net --steps 40 --workload-option sparse_embeddings=true --compare poseidon,ddp \
          --json "$out/$w-$net-$tree-r$r.json" > "$out/$w-$net-$tree-r$r.txt" 2>&1 || echo "FAILED $w $net $tree"
        echo "$w $net $tree r$r: $(grep 'as fast as ddp' "$out/$w-$net-$tree-r$r.txt")"
      done
    done
  done
done
