#!/bin/bash
# $1 plan, $2 out prefix: ncf trained alone under the plan, two workers' threads sampled for 8 s from 16 s in
cd "$(git rev-parse --show-toplevel)"
PYTHONPATH=${WT:-.}/src timeout 300 ./dev sparcoll train --workload ncf --workers 4 --network 1gbit --steps 700 \
  --comm planned --plan $1 > $2.txt 2>&1 &
sleep 16
for p in $(ps -eo pid,pcpu,args --sort=-pcpu | grep "[f]orkserver import main" | head -2 | awk '{print $1}'); do
  /tmp/spyenv/bin/python docs/results/plan-3dfa44f-whole-grid/probe/threads.py $p 8 > $2.threads.$p 2>&1 &
done
wait
