#!/bin/bash
# usage: ab.sh ROUNDS [NPROC] ; compares /tmp/small2/base/src with a snapshot of /work/main/src
R=${1:-3}; N=${2:-4}

cd /work/main
for i in $(seq $R); do
  for v in base new; do
    LABEL=$v PYTHONPATH=/tmp/small2/$v/src OMP_NUM_THREADS=1 timeout 120 .venv/bin/torchrun --standalone --nproc-per-node $N /tmp/small2/cpu.py 2>&1 | grep "^$v"
  done
done
