#!/usr/bin/env bash
# Profiles of ncf (4 workers, 1 Gbit/s, no trial: the decision's plan) by the code before (488c547: one
# timeline window at the profile's start) and after (b08b413: three spread over it), alternated, each
# plan trained right after it in one job of 60 steps after 2 warm-up ones.
# From the project root on an idle machine: [FIRST=1] docs/results/timeline-windows/ab.sh LAST_ROUND
# (worktrees of the two commits at /tmp/wt/before and /tmp/wt/after)
set -euo pipefail
out=docs/results/timeline-windows/ab
mkdir -p $out
export OMP_NUM_THREADS=1
clean() { grep -v "━\|╸" | grep -v -E '^\s*[0-9]+/[0-9]+ [0-9]+:[0-9]+:[0-9]+ ' || true; }
for i in $(seq ${FIRST:-1} ${1:-3}); do
  for code in before after; do
    p=$out/$code-$i
    PYTHONPATH=/tmp/wt/$code/src timeout 1200 ./dev sparcoll plan --workload ncf --workers 4 --network 1gbit \
      --trial 0 --profile $p-profile.json --json $p-plan.json > $p-plan.txt 2> >(clean > $p-plan.err)
    PYTHONPATH=/tmp/wt/$code/src timeout 1200 ./dev sparcoll train --workload ncf --workers 4 --network 1gbit \
      --steps 60 --warmup 2 --compare planned --plan $p-plan.json --json $p-planned.json > $p-planned.txt \
      2> >(clean > $p-planned.err)
  done
done
