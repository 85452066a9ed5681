#!/usr/bin/env bash
# old = 6c744d5, new = 6c744d5 + this change (no polling while more than 1 MB is in flight; a kind
# settled on gloo looks at its density every 8th collective), both with the bench's interleaved
# timed repetitions (sparcoll/bench/worker.py of this change copied into the old tree), each tree's
# src on PYTHONPATH in turn, alternated, 3 rounds, loopback at 100% density:
#   git worktree add /tmp/wt/old 6c744d5; git worktree add /tmp/wt/new <this change>
#   run.sh OUT 3
out=$1; rounds=$2; mkdir -p $out
export OMP_NUM_THREADS=1
for r in $(seq 1 $rounds); do
 for v in old new; do
  for cfg in "2w-16M --workers 2 --numel 16M" "2w-4M --workers 2 --numel 4M" "4w-4M --workers 4 --numel 4M" "2w-4M-ded --workers 2 --numel 4M --aggregators dedicated"; do
   name=${cfg%% *}; args=${cfg#* }
   PYTHONPATH=/tmp/wt/$v/src timeout 900 ./dev sparcoll bench --algos sparcoll,sparse,ring --warmup 5 $args --network none --density 1 --repeat 20 --json $out/$name-$v-r$r.json > $out/$name-$v-r$r.txt 2>&1
  done
 done
done
