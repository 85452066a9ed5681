#!/usr/bin/env bash
# The kept plans of ncf and gpt (plan-63e569f-speed) trained alone, 3 runs each, alternated, with the
# machine's speed per step. From the project root on an idle machine (code of 63e569f: src unchanged
# since): docs/results/plan-63e569f-speed/alone/run.sh
set -euo pipefail
out=docs/results/plan-63e569f-speed/alone plans=docs/results/plan-63e569f-speed
export OMP_NUM_THREADS=1
for i in 1 2 3; do
  for w in ncf gpt; do
    timeout 900 ./dev sparcoll train --workload $w --workers 4 --network 1gbit --steps 60 --warmup 5 \
      --compare planned --plan $plans/$w-plan.json --json $out/$w-plan-$i.json > $out/$w-plan-$i.txt \
      2> >(grep -v "━\|╸" | grep -v -E '^\s*[0-9]+/[0-9]+ [0-9]+:[0-9]+:[0-9]+ ' > $out/$w-plan-$i.err)  # empty: not kept
  done
done
