#!/usr/bin/env bash
# 2 workers on loopback, 16M floats at 1%: the code of d491e31 (issue 11's
# last loopback round) and of today's commit alternated, 20 repetitions each; prints ring / sparcoll.
#   THEN=/tmp/wt/d491 NOW=/tmp/wt/now docs/results/loopback-then-now/run.sh (worktrees of the two)
set -euo pipefail
out="$(cd "$(dirname "$0")" && pwd)"
for r in 1 2; do for v in d491 now; do
  code=$([ "$v" = d491 ] && echo "$THEN" || echo "$NOW")
  PYTHONPATH=$code/src OMP_NUM_THREADS=1 "$out/../../../.venv/bin/sparcoll" bench --workers 2 --network none \
    --numel 16M --density 0.01 --algos sparcoll,ring --repeat 20 --warmup 7 --json "$out/$v-$r.json" > /dev/null
  python3 -c "import json, statistics, sys
rows = {r['algo']: r['times_s'] for r in json.load(open(sys.argv[1])) if r['input'] == 'dense'}
print(sys.argv[2], round(statistics.median(rows['ring']) / statistics.median(rows['sparcoll']), 2))" \
    "$out/$v-$r.json" "$v $r"
done; done
