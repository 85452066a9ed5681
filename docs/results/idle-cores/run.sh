#!/usr/bin/env bash
# How long the cores stand idle in a step: strategies of plan-63e569f-speed trained alone (60 steps,
# 4 workers, 1 Gbit/s), each run with the ranks' mean CPU per step (cpu_mean_s, da65400). From the
# project root on an idle machine: PYTHONPATH=<work tree of da65400>/src docs/results/idle-cores/run.sh
set -euo pipefail
out=docs/results/idle-cores plans=docs/results/plan-63e569f-speed
export OMP_NUM_THREADS=1
run() {  # workload, name, mode args...
  local w=$1 name=$2; shift 2
  timeout 900 ./dev sparcoll train --workload "$w" --workers 4 --network 1gbit --steps 60 --warmup 5 \
    "$@" --json "$out/$w-$name-$i.json" > "$out/$w-$name-$i.txt" \
    2> >(grep -v "━\|╸" | grep -v -E '^\s*[0-9]+/[0-9]+ [0-9]+:[0-9]+:[0-9]+ ' > "$out/$w-$name-$i.err")
}
for i in 1 2; do
  run ncf plan --compare planned --plan $plans/ncf-plan.json
  run ncf u-sparse --compare poseidon:strategy=$plans/ncf-u-sparse.json
  run ncf u-onebit --compare poseidon:strategy=$plans/ncf-u-onebit.json
  run gpt plan --compare planned --plan $plans/gpt-plan.json
  run gpt u-onebit --compare poseidon:strategy=$plans/gpt-u-onebit.json
  run deeplight plan --compare planned --plan $plans/deeplight-plan.json
  run deeplight u-blocktopk --compare poseidon:strategy=$plans/deeplight-u-blocktopk_0.01.json
done
