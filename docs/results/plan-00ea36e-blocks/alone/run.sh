#!/usr/bin/env bash
# The kept plans of ncf, gpt and deeplight (this directory's rounds) and the best uniform strategies of those
# rounds, each trained alone (its own job, no other mode), 3 runs, 4 workers at 1 Gbit/s emulated (root):
# the step a user of the strategy gets, against its prediction. From the project root, the code of 00ea36e:
#   git worktree add /tmp/wt/blocks 00ea36e; PYTHONPATH=/tmp/wt/blocks/src docs/results/plan-00ea36e-blocks/alone/run.sh
set -u
export OMP_NUM_THREADS=1
here=docs/results/plan-00ea36e-blocks
declare -A steps=([ncf]=60 [gpt]=30 [deeplight]=60)
runs="ncf:plan gpt:plan gpt:u-blocktopk_0.01 deeplight:plan deeplight:u-blocktopk_0.01 deeplight:u-sparse"
for run in 1 2 3; do
  for job in $runs; do
    w=${job%%:*} s=${job#*:}
    out=$here/alone/$w-$s-$run
    timeout 900 ./dev sparcoll train --workload "$w" --workers 4 --network 1gbit --steps "${steps[$w]}" --warmup 2 \
      --comm planned --plan "$here/$w-$s.json" --json "$out.json" > "$out.txt" 2> "$out.err" && rm -f "$out.err" \
      || echo "$(date +%T) FAILED: $w $s run $run" >&2
  done
done
