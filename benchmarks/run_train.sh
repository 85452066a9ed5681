#!/usr/bin/env bash
# Training figures of docs/benchmarks.md, section 4: sparcoll (DDP on the sparcoll backend) against DDP
# on gloo, 4 workers on 1 Gbit/s emulated links, each workload at its default size, ROUNDS rounds (each
# a pass over the workloads). Root needed; run on an otherwise idle machine.
#   benchmarks/run_train.sh OUT [ROUNDS]     -> OUT/rN/train-W.{json,txt}
#   python3 benchmarks/train_summary.py OUT   (the table, ranges over the rounds)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: run_train.sh OUT [ROUNDS]}
rounds=${2:-3}
steps=${STEPS:-30}
for round in $(seq 1 "$rounds"); do
  mkdir -p "$out/r$round"
  for workload in deeplight ncf lstm cnn; do
    echo "+ round $round: sparcoll train --workload $workload --compare" >&2
    ./dev sparcoll train --workload "$workload" --workers 4 --network 1gbit --steps "$steps" \
        --batch-size 256 --warmup 3 --compare --json "$out/r$round/train-$workload.json" \
        > "$out/r$round/train-$workload.txt"
  done
done
