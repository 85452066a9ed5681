#!/usr/bin/env bash
# The planner checked on fresh profiles: each workload profiled, planned (with its trial) and its kept
# plan trained in 3 separate jobs of STEPS steps after 2 warm-up ones, 4 workers at 1 Gbit/s.
# From the project root on an idle machine: PYTHONPATH=<work tree of 0de37c5>/src docs/results/plan-0de37c5-fresh/run.sh
# (here: the defaults; ../plan-7623400-vgg/: OUT=docs/results/plan-7623400-vgg WORKLOADS=vgg STEPS=20, code of 7623400)
set -euo pipefail
out=${OUT:-docs/results/plan-0de37c5-fresh}
export OMP_NUM_THREADS=1
clean() { grep -v "━\|╸" | grep -v -E '^\s*[0-9]+/[0-9]+ [0-9]+:[0-9]+:[0-9]+ ' || true; }
for w in ${WORKLOADS:-ncf gpt deeplight}; do
  timeout 5400 ./dev sparcoll plan --workload $w --workers 4 --network 1gbit --profile $out/$w-profile.json \
    --json $out/$w-plan.json > $out/$w-plan.txt 2> >(clean > $out/$w-plan.err)
  for i in 1 2 3; do
    timeout 2400 ./dev sparcoll train --workload $w --workers 4 --network 1gbit --steps ${STEPS:-60} --warmup 2 \
      --compare planned --plan $out/$w-plan.json --json $out/$w-planned-$i.json > $out/$w-planned-$i.txt \
      2> >(clean > $out/$w-planned-$i.err)
  done
done
