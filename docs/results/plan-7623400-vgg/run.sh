#!/usr/bin/env bash
# vgg, the one training workload the fresh check at 0de37c5 left out: profiled, planned (with its trial)
# and its kept plan trained in 3 separate jobs of 20 steps after 2 warm-up ones, 4 workers at 1 Gbit/s.
# From the project root on an idle machine: PYTHONPATH=<work tree of 7623400>/src docs/results/plan-7623400-vgg/run.sh
set -euo pipefail
out=docs/results/plan-7623400-vgg
export OMP_NUM_THREADS=1
clean() { grep -v "━\|╸" | grep -v -E '^\s*[0-9]+/[0-9]+ [0-9]+:[0-9]+:[0-9]+ ' || true; }
w=vgg
timeout 5400 ./dev sparcoll plan --workload $w --workers 4 --network 1gbit --profile $out/$w-profile.json \
  --json $out/$w-plan.json > $out/$w-plan.txt 2> >(clean > $out/$w-plan.err)
for i in 1 2 3; do
  timeout 2400 ./dev sparcoll train --workload $w --workers 4 --network 1gbit --steps 20 --warmup 2 \
    --compare planned --plan $out/$w-plan.json --json $out/$w-planned-$i.json > $out/$w-planned-$i.txt \
    2> >(clean > $out/$w-planned-$i.err)
done
