#!/usr/bin/env bash
# deeplight planned for 4 workers on 100 Mbit/s links (emulated), ten times slower than the planner's
# 1 Gbit/s figures: profile, plan and its trial (deeplight-plan.txt), then 3 rounds of the kept plan
# interleaved step by step with DDP, the trial's candidates (uniform blocktopk fused whole, uniform sparse,
# uniform onebit) and the planner without compression and without the collective choice: 20 steps after 2
# warm-up ones, every other round in reversed order. Each step is skipped if its output exists.
# From the project root on an idle machine: PYTHONPATH=<work tree of 7623400>/src docs/results/plan-7623400-100mbit/run.sh
# then: .venv/bin/python benchmarks/plan_summary.py docs/results/plan-7623400-100mbit
set -euo pipefail
out=docs/results/plan-7623400-100mbit
w=deeplight
export OMP_NUM_THREADS=1
clean() { grep -v "━\|╸" | grep -v -E '^\s*[0-9]+/[0-9]+ [0-9]+:[0-9]+:[0-9]+ ' || true; }
plan() { timeout 5400 ./dev sparcoll plan --workload $w --workers 4 --network 100mbit --profile $out/$w-profile.json "$@"; }
[ -f $out/$w-plan.json ] || plan --json $out/$w-plan.json > $out/$w-plan.txt 2> >(clean > $out/$w-plan.err)
modes=ddp,planned
for spec in "blocktopk:0.01 --fusion whole" sparse onebit; do
  set -- $spec
  file=$out/$w-u-${1//:/_}${2:+-whole}.json
  [ -f $file ] || plan --trial 0 --uniform $spec --json $file > /dev/null
  modes=$modes,poseidon:strategy=$file
done
for dim in compression collective; do
  file=$out/$w-without-$dim.json
  [ -f $file ] || plan --trial 0 --without $dim --json $file > /dev/null
  modes=$modes,poseidon:strategy=$file
done
reversed=$(tr , '\n' <<< "$modes" | tac | paste -sd,)
for round in 1 2 3; do
  [ -f $out/$w-r$round.json ] && continue
  order=$modes; [ $((round % 2)) -eq 0 ] && order=$reversed
  timeout 3600 ./dev sparcoll train --workload $w --workers 4 --network 100mbit --steps 20 --warmup 2 \
    --compare "$order" --interleave --plan $out/$w-plan.json --json $out/$w-r$round.json \
    > $out/$w-r$round.txt 2> >(clean > $out/$w-r$round.err)
done
