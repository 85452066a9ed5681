#!/usr/bin/env bash
# Each workload's kept plan trained alone (no other mode in the job), 3 runs, 4 workers at 1 Gbit/s:
# the step a user of the plan gets, against its prediction. From the project root:
#   PYTHONPATH=<work tree of bb1d344>/src docs/results/plan-bb1d344-cpu/run_alone.sh
set -u
here=docs/results/plan-bb1d344-cpu
declare -A plan=([ncf]=$here/ncf-plan.json [deeplight]=$here/deeplight-plan.json
                 [gpt]=docs/results/plan-bb1d344-cpu-gpt/gpt-plan.json)
declare -A steps=([ncf]=60 [deeplight]=60 [gpt]=30)
for run in 1 2 3; do
  for w in ncf deeplight gpt; do
    timeout 900 ./dev sparcoll train --workload "$w" --workers 4 --network 1gbit --steps "${steps[$w]}" \
      --warmup 2 --comm planned --plan "${plan[$w]}" --json "$here/alone/$w-$run.json" \
      > "$here/alone/$w-$run.txt" 2> "$here/alone/$w-$run.err" && rm -f "$here/alone/$w-$run.err" \
      || echo "$(date +%T) FAILED: $w run $run" >&2
  done
done
