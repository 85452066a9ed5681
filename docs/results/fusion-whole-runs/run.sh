#!/usr/bin/env bash
# One collective for a whole run of units (7848164) against the greedy's units, side by side, 4 workers at
# 1 Gbit/s, 2 rounds with the order reversed in the second, each run from a worktree of 7848164 (/tmp/wt/fuse):
#   gpt: uniform blocktopk:0.01 in 14 units (plan-306a328's file, the greedy's) and in 1 unit (plan-2512ab6's,
#        what 7848164 plans from the 306a328 profile too), 20 steps
#   vgg: uniform blocktopk:0.01 in 2 units (plan-2512ab6's) and the plan of 7848164 from the same profile
#        (vgg-plan.json here: 1 unit), 6 steps
cd /work/main
out=docs/results/fusion-whole-runs
g14=poseidon:strategy=docs/results/plan-306a328/gpt-u-blocktopk_0.01.json
g1=poseidon:strategy=docs/results/plan-2512ab6/gpt-u-blocktopk_0.01.json
v2=poseidon:strategy=docs/results/plan-2512ab6/vgg-u-blocktopk_0.01.json
v1=poseidon:strategy=$out/vgg-plan.json
run() {  # workload steps round modes
  OMP_NUM_THREADS=1 PYTHONPATH=/tmp/wt/fuse/src timeout 1800 .venv/bin/python -m sparcoll train --workload $1 --workers 4 \
    --network 1gbit --steps $2 --warmup 2 --compare $4 --json $out/$1-r$3.json > $out/$1-r$3.txt 2> $out/$1-r$3.err
  echo "$1 round $3: rc=$?"
}
run gpt 20 1 $g14,$g1
run gpt 20 2 $g1,$g14
run vgg 6 1 $v2,$v1
run vgg 6 2 $v1,$v2
