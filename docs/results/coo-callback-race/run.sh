#!/usr/bin/env bash
# 2 ranks, sparse COO all_reduce on the sparcoll backend 20000 times each, with two busy loops
# beside them for 100 s; prints (rank, wrong sums, calls). OLD and NEW: worktrees of the commits
# before and after the fix (638ca0c), e.g. git worktree add /tmp/wt/old 1deacd5.
set -euo pipefail
cd "$(dirname "$0")"
for code in "$OLD" "$NEW"; do
  echo "== $code"
  timeout 100 sh -c 'while :; do :; done' & timeout 100 sh -c 'while :; do :; done' &
  N=20000 OMP_NUM_THREADS=1 PYTHONPATH="$code/src" timeout 200 ../../../.venv/bin/python stress.py 2>&1 | grep "^("
  wait
done
