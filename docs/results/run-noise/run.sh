#!/bin/bash
# Is gpt's run-to-run spread the workers' placement on the cores? One strategy (the plan of
# docs/results/plan-54fec5a-fusion), 4 workers at 1 Gbit/s, 20 steps, 4 rounds alternating the
# project as it is ("plain") with each worker pinned to one core (rank % cores; "pin": a worktree
# with pin-workers.patch applied, given as PIN_SRC). Run from the project root, idle.
#   PIN_SRC=/tmp/wt/pin/src docs/results/run-noise/run.sh OUT_DIR
set -euo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"
for r in 1 2 3 4; do
  for m in plain pin; do
    src=$PWD/src; [ "$m" = pin ] && src=$PIN_SRC
    PYTHONPATH=$src OMP_NUM_THREADS=1 timeout 600 ./dev sparcoll train --workload gpt --workers 4 --network 1gbit \
      --steps 20 --warmup 2 --compare poseidon:strategy=docs/results/plan-54fec5a-fusion/gpt-plan.json \
      --json "$out/$m-$r.json" > /dev/null 2> "$out/$m-$r.err" && rm -f "$out/$m-$r.err"
  done
done
