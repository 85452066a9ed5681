#!/usr/bin/env bash
# The modes of the interleaved rounds one level up, each in a job of its own (as a user runs a
# strategy): the same plan files, the same steps, 3 rounds, every other one in reversed order. From the
# project root on an idle machine, code of 292cd77:
#   PYTHONPATH=<work tree of 292cd77>/src docs/results/plan-292cd77-idle/separate/run.sh
# then .venv/bin/python benchmarks/plan_summary.py docs/results/plan-292cd77-idle/separate
set -euo pipefail
here=docs/results/plan-292cd77-idle/separate up=docs/results/plan-292cd77-idle
export OMP_NUM_THREADS=1
declare -A steps=([deeplight]=30 [ncf]=30 [gpt]=20)
for w in ncf gpt deeplight; do
  cp "$up/$w-plan.json" "$up/$w-profile.json" "$here/"
  for f in "$up/$w"-u-*.json "$up/$w"-without-*.json "$up/$w"-dense-*.json; do [ -e "$f" ] && cp "$f" "$here/"; done
  # the interleaved round's modes, their plan files read from here
  modes=$(.venv/bin/python -c "import json, sys; r = json.load(open(sys.argv[1])); \
print(','.join(run['label'].replace('poseidon:', 'poseidon:strategy=').replace(sys.argv[2], sys.argv[3]) \
for run in r['runs']))" "$up/$w-r1.json" "$up/" "$here/")
  reversed=$(tr , '\n' <<< "$modes" | tac | paste -sd,)
  for round in 1 2 3; do
    order=$modes; [ $((round % 2)) -eq 0 ] && order=$reversed
    timeout 3600 ./dev sparcoll train --workload "$w" --workers 4 --network 1gbit --steps "$((2 * ${steps[$w]}))" \
      --warmup 2 --compare "$order" --plan "$here/$w-plan.json" --json "$here/$w-r$round.json" \
      > "$here/$w-r$round.txt" 2> "$here/$w-r$round.err" && rm -f "$here/$w-r$round.err" \
      || echo "$(date +%T) FAILED: $w round $round" >&2
  done
done
