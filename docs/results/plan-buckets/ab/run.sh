#!/bin/bash
cd /work/main
R=/work/main/docs/results/plan-v9
for round in 1 2; do
 for v in old new; do
  for w in ncf gpt; do
   steps=30; [ $w = gpt ] && steps=20
   PYTHONPATH=/tmp/wt/$v/src OMP_NUM_THREADS=1 timeout 900 .venv/bin/sparcoll train --workload $w --workers 4 --network 1gbit --steps $steps --warmup 2 \
     --compare poseidon:strategy=$R/$w-u-blocktopk_0.01.json,poseidon:strategy=$R/$w-plan.json --json /tmp/ab/$w-$v-r$round.json > /tmp/ab/$w-$v-r$round.txt 2>&1 || echo "FAIL $w $v $round"
  done
 done
done
echo done
