#!/usr/bin/env bash
# The README's demo with the code of 67dbb10 (when the README's figures were measured, Nov 26) and of
# today's commit, alternated twice on the same machine in the same quarter hour.
#   THEN=/tmp/wt/nov26 NOW=/tmp/wt/now docs/results/demo-then-now/run.sh (worktrees of the two commits)
set -euo pipefail
out="$(cd "$(dirname "$0")" && pwd)"
for round in 1 2; do
  for v in nov26 now; do
    code=$([ "$v" = nov26 ] && echo "$THEN" || echo "$NOW")
    PYTHONPATH=$code/src OMP_NUM_THREADS=1 timeout 400 "$out/../../../.venv/bin/sparcoll" demo \
      --out "/tmp/demo-$v-$round" 2>&1 | grep -v "━" | grep -v "^╸ " > "$out/demo-$v-$round.txt"
  done
done
