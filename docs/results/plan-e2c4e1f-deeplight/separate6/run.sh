#!/usr/bin/env bash
# The plan kept by this directory's trial against the two best uniform strategies, each in a job of
# its own (as a user runs one), 40 steps after 2 warm-ups, 6 rounds, the order reversed every other
# round. From the project root: docs/results/plan-e2c4e1f-deeplight/separate6/run.sh
set -euo pipefail
D=docs/results/plan-e2c4e1f-deeplight
modes="poseidon:strategy=$D/deeplight-plan.json,poseidon:strategy=$D/deeplight-u-blocktopk_0.01.json,poseidon:strategy=$D/deeplight-u-sparse.json"
reversed=$(tr , '\n' <<< "$modes" | tac | paste -sd,)
for round in 1 2 3 4 5 6; do
  order=$modes; [ $((round % 2)) -eq 0 ] && order=$reversed
  timeout 1800 ./dev sparcoll train --workload deeplight --workers 4 --network 1gbit --steps 40 --warmup 2 \
    --compare "$order" --json "$D/separate6/r$round.json" > "$D/separate6/r$round.txt"
done
