#!/usr/bin/env bash
# loopback at 100%, sparcoll (auto) next to gloo's ring, 60 interleaved repetitions, 3 rounds, at 44ccd3e (code of 4f96bb6): run.sh OUT 3
out=$1; rounds=$2; mkdir -p $out; cd /work/main
export OMP_NUM_THREADS=1
for r in $(seq 1 $rounds); do
  for cfg in "2w-16M --workers 2 --numel 16M" "2w-4M --workers 2 --numel 4M" "4w-4M --workers 4 --numel 4M" "2w-4M-ded --workers 2 --numel 4M --aggregators dedicated"; do
   name=${cfg%% *}; args=${cfg#* }
   timeout 900 ./dev sparcoll bench --algos sparcoll,ring --warmup 5 $args --network none --density 1 --repeat 60 --json $out/$name-r$r.json > $out/$name-r$r.txt 2>&1
  done
 echo "round $r done $(date +%T)"
done
