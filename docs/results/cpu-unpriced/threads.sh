#!/usr/bin/env bash
# A workload (WORKLOAD, ncf) trained alone under a plan (4 workers at 1 Gbit/s, STEPS steps, 700), two
# workers' threads sampled for SPAN s (8) from DELAY s (20) in: CPU seconds per second of each thread
# (../plan-3dfa44f-whole-grid/probe/threads.py: /proc, and py-spy's names from /tmp/spyenv).
# Usage from the project root: PYTHONPATH=<work tree>/src docs/results/cpu-unpriced/threads.sh PLAN OUT_PREFIX
set -euo pipefail
spy=/tmp/spyenv/bin
export OMP_NUM_THREADS=1
timeout 900 ./dev sparcoll train --workload ${WORKLOAD:-ncf} --workers 4 --network 1gbit --steps ${STEPS:-700} \
  --comm planned --plan "$1" --json "$2.json" > "$2.txt" 2> >(grep -v "━\|╸" | grep -v -E "^\s*[0-9]+/[0-9]+ [0-9]+:[0-9]+:[0-9]+ " > "$2.err" || true) &
sleep ${DELAY:-20}
for p in $(ps -eo pid,pcpu,args --sort=-pcpu | grep "[f]orkserver import main" | head -2 | awk '{print $1}'); do
  timeout 60 $spy/python docs/results/plan-3dfa44f-whole-grid/probe/threads.py $p ${SPAN:-8} > "$2.threads.$p" 2>&1 &
done
wait
