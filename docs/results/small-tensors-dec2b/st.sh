#!/bin/bash
# alternate base/new small_tensors runs: st.sh ROUNDS NPROC
R=$1; N=$2
cd /work/main
for i in $(seq $R); do for v in base new; do
  PYTHONPATH=/tmp/small2/$v/src OMP_NUM_THREADS=1 timeout 600 .venv/bin/torchrun --standalone --nproc-per-node $N benchmarks/small_tensors.py > /tmp/small2/bench/$v-${N}r-$i.txt 2>&1
  echo "$v $i $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; grep -E "^\| (1|8|256|1024|4096|16384|65536) \|" /tmp/small2/bench/$v-${N}r-$i.txt | cut -d'|' -f2,3,4,6,7
done; done
