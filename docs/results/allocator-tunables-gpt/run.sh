#!/usr/bin/env bash
# gpt, uniform blocktopk:0.01 (the plan file of docs/results/plan-2512ab6), 4 workers at 1 Gbit/s, 20 steps:
# e5812fb (before: glibc's thread cache and fastbins on) and 2512ab6 (after), alternated, 3 rounds, each
# side from its own worktree (/tmp/wt/before, /tmp/wt/heap)
cd /work/main
out=docs/results/allocator-tunables-gpt
for r in 1 2 3; do
  for side in before heap; do
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/wt/$side/src timeout 1800 .venv/bin/python -m sparcoll train --workload gpt --workers 4 \
      --network 1gbit --steps 20 --warmup 2 --compare poseidon:strategy=docs/results/plan-2512ab6/gpt-u-blocktopk_0.01.json \
      --json $out/$side-r$r.json > $out/$side-r$r.txt 2> $out/$side-r$r.err
    echo "$side round $r: rc=$?"
  done
done
