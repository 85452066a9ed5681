#!/bin/bash
# vgg, uniform blocktopk:0.01 (plan-v9's plan file): the averages written into the gradients (687552a)
# against a copy (248ea43), alternating, 2 rounds each
cd /work/main
R=/work/main/docs/results/plan-v9
for round in 1 2; do
 for v in pre into; do
   PYTHONPATH=/tmp/wt/$v/src OMP_NUM_THREADS=1 timeout 1200 .venv/bin/sparcoll train --workload vgg --workers 4 --network 1gbit --steps 6 --warmup 2 \
     --compare poseidon:strategy=$R/vgg-u-blocktopk_0.01.json --json /tmp/abv/vgg-$v-r$round.json > /tmp/abv/vgg-$v-r$round.txt 2>&1 || echo "FAIL $v $round"
 done
done
echo done
