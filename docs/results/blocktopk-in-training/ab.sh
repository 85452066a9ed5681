#!/bin/bash
# alternate head / opt profiles (none,blocktopk:0.01), then print the embedding's in-backward compress CPU
cd /tmp/probe
for i in 1 2; do
  for v in head opt; do
    PYTHONPATH=/tmp/wt/$v/src timeout 1200 /work/main/.venv/bin/sparcoll plan --workload deeplight --workers 4 --network 1gbit \
      --compressors none,blocktopk:0.01 --trial 0 --profile /tmp/probe/p-$v-$i.json --json /tmp/probe/plan-$v-$i.json 2>&1 | grep -v "━\|╸" > /tmp/probe/plan-$v-$i.txt
  done
done
