#!/usr/bin/env bash
# A plan trained alone under the code before (OLD) and after (NEW) 0002e6a, alternated, each work tree
# with train-cpu-probe.patch applied (every rank writes per step its training thread's CPU in forward,
# backward and the optimizer, and each compression's CPU there, to $PROBE_CPU.<rank>). From the root:
#   docs/results/blocktopk-small-tensors/ab.sh OLD_TREE NEW_TREE WORKLOAD PLAN STEPS PAIRS
set -u
old=$1 new=$2 w=$3 plan=$4 steps=$5 pairs=$6
out=docs/results/blocktopk-small-tensors
for i in $(seq 1 "$pairs"); do
  for v in old new; do
    tree=$old; [ "$v" = new ] && tree=$new
    PROBE_CPU=$out/cpu/$w-$v-$i.cpu OMP_NUM_THREADS=1 PYTHONPATH=$tree/src timeout 600 ./dev sparcoll train \
      --workload "$w" --workers 4 --network 1gbit --steps "$steps" --warmup 2 --comm planned --plan "$plan" \
      --json "$out/$w-$v-$i.json" > "$out/$w-$v-$i.txt" 2> "$out/$w-$v-$i.err" && rm -f "$out/$w-$v-$i.err"
    python3 "$out/summarize.py" "$out/$w-$v-$i"
  done
done
