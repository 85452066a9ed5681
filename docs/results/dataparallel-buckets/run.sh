#!/bin/bash
# Rounds of DataParallel ("auto", no plan) against DDP, each commit's src from a worktree in turn:
#   docs/results/dataparallel-buckets/run.sh OUT ROUNDS WORKTREE...
# (worktrees made with `git worktree add /tmp/wt/C C`); needs root for the 1 Gbit/s links.
set -eu
out=$1; rounds=$2; shift 2
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for net in none 1gbit; do
    for w in deeplight ncf; do
      for tree in "$@"; do
        name=$(basename "$tree")
        PYTHONPATH="$tree/src" timeout 900 .venv/bin/python -m sparcoll train --workload $w --workers 4 \
          --network $net --steps 40 --workload-option sparse_embeddings=true --compare poseidon,ddp \
          --json "$out/$w-$net-$name-r$r.json" > "$out/$w-$net-$name-r$r.txt" 2>&1
        echo "$w $net $name r$r: $(grep 'as fast as ddp' "$out/$w-$net-$name-r$r.txt")"
      done
    done
  done
done
