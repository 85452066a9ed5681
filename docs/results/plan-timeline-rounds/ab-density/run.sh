#!/bin/bash
# the plans of docs/results/plan-timeline-rounds (ncf, deeplight: the plan and the planner without compression) at dc843fb (old: every synchronization
# scans its average for the density) and cdff393 (new: only where the hybrid choice reads it), alternating
cd /work/main
R=/tmp/pbt
for round in 1 2; do
 for v in old new; do
  for w in ncf deeplight; do
   PYTHONPATH=/tmp/wt/$v/src OMP_NUM_THREADS=1 timeout 900 .venv/bin/sparcoll train --workload $w --workers 4 --network 1gbit --steps 30 --warmup 2      --compare poseidon:strategy=$R/$w-plan.json,poseidon:strategy=$R/$w-without-compression.json --json /tmp/abd/$w-$v-r$round.json > /tmp/abd/$w-$v-r$round.txt 2>&1 || echo "FAIL $w $v $round"
  done
 done
done
echo done
