#!/usr/bin/env bash
# A/B of keep_freed_memory: the commit before (3df5d3c) and the commit that keeps freed memory
# (d0ec09f; one arena since the commit after it, whose worktree /tmp/wt/after the later runs use), alternated, each from its own worktree (git worktree add -f /tmp/wt/before 3df5d3c;
# /tmp/wt/after d0ec09f), run from the project root so that .venv is used:
#   docs/results/keep-freed-memory/run.sh WORKLOAD ROUNDS STEPS STRATEGIES...
set -euo pipefail
out=docs/results/keep-freed-memory
workload=$1 rounds=$2 steps=$3; shift 3
modes=ddp
for s in "$@"; do modes="$modes,poseidon:strategy=$s"; done
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    PYTHONPATH=/tmp/wt/$side/src OMP_NUM_THREADS=1 timeout 1800 .venv/bin/python -m sparcoll train \
      --workload "$workload" --compare "$modes" --workers 4 --steps "$steps" --network 1gbit \
      --json "$out/$workload-$side-r$r.json" > "$out/$workload-$side-r$r.txt" 2>&1
  done
done
