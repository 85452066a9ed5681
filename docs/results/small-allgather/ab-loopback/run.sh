#!/bin/bash
cd /work/main
export OMP_NUM_THREADS=1
for round in 1 2 3; do
 for c in old new; do
  for cfg in "2w-4M --workers 2 --numel 4M --repeat 10" "4w-4M --workers 4 --numel 4M --repeat 5" "2w-16M --workers 2 --numel 16M --repeat 10"; do
   set -- $cfg; name=$1; shift
   PYTHONPATH=/tmp/wt/$c/src timeout 900 ./dev sparcoll bench --algos sparcoll,ring --warmup 5 --network none --density 1 "$@" > /tmp/ab2/$c-$name-r$round.txt 2>&1
  done
 done
done
echo done > /tmp/ab2/finished
