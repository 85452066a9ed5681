#!/usr/bin/env bash
# old (m1) = 8127d7d, new = 8127d7d + the one-pass scan (each a worktree under /tmp/wt, its src on PYTHONPATH); loopback 2 workers 16M at 1% and 10%, alternated
out=$1; rounds=$2; mkdir -p $out; cd /work/main
export OMP_NUM_THREADS=1
for r in $(seq ${3:-1} $((${3:-1} + rounds - 1))); do
 for v in m1 new; do
   PYTHONPATH=/tmp/wt/$v/src timeout 900 ./dev sparcoll bench --algos sparcoll,sparse,ring --warmup 5 --workers 2 --numel 16M --network none --density 0.01,0.1 --repeat 10 --json $out/2w-16M-$v-r$r.json > $out/2w-16M-$v-r$r.txt 2>&1
 done
 echo "round $r done $(date +%T)"
done
