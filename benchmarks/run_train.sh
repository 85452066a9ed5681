#!/usr/bin/env bash
# Training figures of docs/benchmarks.md: sparcoll (DDP on the sparcoll backend) against DDP on gloo,
# 4 workers on 1 Gbit/s emulated links, each workload at its default size. Root needed; run on an
# otherwise idle machine. Results land in docs/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/results
mkdir -p "$out"
steps=${STEPS:-30}
for workload in deeplight ncf lstm cnn; do
  echo "+ sparcoll train --workload $workload --compare" >&2
  ./dev sparcoll train --workload "$workload" --workers 4 --network 1gbit --steps "$steps" \
      --batch-size 256 --warmup 3 --compare --json "$out/train-$workload.json" | tee "$out/train-$workload.txt"
done
