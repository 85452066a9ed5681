#!/bin/bash
# usage: cpu.sh MODE STEPS -> busy CPU seconds over the run (all processes), wall seconds
mode=$1; steps=$2
read -r _ u n s i w q sq st _ < <(grep '^cpu ' /proc/stat)
b0=$((u+n+s+q+sq)); t0=$(date +%s.%N)
.venv/bin/python -m sparcoll train --workload deeplight --workers 4 --network none --steps $steps --workload-option sparse_embeddings=true --compare $mode --json /tmp/cpu-$mode-$steps.json >/dev/null 2>&1
read -r _ u n s i w q sq st _ < <(grep '^cpu ' /proc/stat)
b1=$((u+n+s+q+sq)); t1=$(date +%s.%N)
echo "$mode $steps busy_s=$(echo "($b1-$b0)/100" | bc -l | cut -c1-6) wall=$(echo "$t1-$t0" | bc | cut -c1-6) step_ms=$(python3 -c "import json;print(round(json.load(open('/tmp/cpu-$mode-$steps.json'))['runs'][0]['step_s']*1e3,1))")"
