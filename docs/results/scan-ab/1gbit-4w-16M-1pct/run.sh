#!/usr/bin/env bash
# Colocated, 4 workers, 16M, 1 Gbit/s emulated, 1% (issue 11: "within 1.3x of the bound"), root needed.
# 1gbit-4w-16M-r{1..5}: 5 runs at aaf2d9b's code (318791e, the scan of 4f96bb6);
# ab-{m1,main}-r{1,2,3}: 8127d7d (m1, a worktree, its src on PYTHONPATH) and the same code as above, alternated.
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1
run() { ./dev sparcoll bench --algos sparcoll,sparse,ring --warmup 5 --workers 4 --numel 16M --network 1gbit \
          --density 0.01 --repeat 5 --json "$1.json" > "$1.txt" 2>&1; }
out=${1:-/tmp/c1}; mkdir -p "$out"
for r in 1 2 3 4 5; do run "$out/1gbit-4w-16M-r$r"; done
for r in 1 2 3; do PYTHONPATH=/tmp/wt/m1/src run "$out/ab-m1-r$r"; run "$out/ab-main-r$r"; done
