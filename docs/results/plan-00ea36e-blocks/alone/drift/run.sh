#!/usr/bin/env bash
# Drift check: ncf's plan of this directory (blocktopk for every tensor, one unit) and ../../../ncf-alone-d491e31's
# uniform blocktopk (the same strategy from 0002e6a's profile), each alone, alternated in 3 pairs whose order
# flips; the code of 00ea36e. From the project root:
#   PYTHONPATH=/tmp/wt/blocks/src docs/results/plan-00ea36e-blocks/alone/drift/run.sh
set -u
export OMP_NUM_THREADS=1
here=docs/results/plan-00ea36e-blocks/alone/drift
declare -A file=([new]=docs/results/plan-00ea36e-blocks/ncf-plan.json
                 [old]=docs/results/plan-0002e6a-blocktopk/ncf-u-blocktopk_0.01.json)
one() {
  timeout 900 ./dev sparcoll train --workload ncf --workers 4 --network 1gbit --steps 60 --warmup 2 \
    --comm planned --plan "${file[$1]}" --json "$here/$1-$2.json" > "$here/$1-$2.txt" 2> "$here/$1-$2.err" \
    && rm -f "$here/$1-$2.err" || echo "$(date +%T) FAILED: $1 $2" >&2
}
for pair in 1 2 3; do
  if [ $((pair % 2)) = 1 ]; then one new "$pair"; one old "$pair"
  else one old "$pair"; one new "$pair"; fi
done
