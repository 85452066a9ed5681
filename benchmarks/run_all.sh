#!/usr/bin/env bash
# The commands of docs/benchmarks.md's sections 1-3, in one go (about 12 minutes on the project's 2-core machine;
# root needed for the emulated network). Results land in docs/results/. Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/results
mkdir -p "$out"
run() { echo "+ sparcoll $*" >&2; ./dev sparcoll "$@"; }

# Issue 2: loopback, 2 workers, 16M float32.
run bench --workers 2 --numel 16M --network none --algos sparcoll,ring --density 0.01,0.1,1 \
    --repeat 15 --json $out/loopback-2w.json --plot $out/loopback-2w.png | tee $out/loopback-2w.txt

# Issue 3: 4 workers, 16M float32, 1 Gbit/s links, every algorithm, random independent patterns.
run bench --workers 4 --numel 16M --network 1gbit --algos sparcoll,ring,agsparse,ps --density 0.01,0.1,1 \
    --repeat 10 --json $out/1gbit-4w.json --plot $out/1gbit-4w.png | tee $out/1gbit-4w.txt
run bench --workers 4 --numel 16M --network 1gbit --algos sparcoll,ring --aggregators dedicated \
    --density 0.01,1 --repeat 10 --json $out/1gbit-4w-dedicated.json --plot $out/1gbit-4w-dedicated.png \
    | tee $out/1gbit-4w-dedicated.txt
run bench --workers 4 --numel 16M --network 1gbit --algos sparcoll,agsparse --overlap 0.5 --density 0.01 \
    --repeat 10 --json $out/1gbit-4w-overlap.json | tee $out/1gbit-4w-overlap.txt
run bench --workers 2,4,8 --numel 16M --network 1gbit --algos sparcoll,ring --density 0.01,1 \
    --repeat 5 --json $out/1gbit-sweep.json --plot $out/1gbit-sweep.png | tee $out/1gbit-sweep.txt
run bench --workers 2,4,8 --numel 16M --network 1gbit --algos sparcoll --aggregators dedicated \
    --density 1 --repeat 5 --json $out/1gbit-sweep-dedicated.json --plot $out/1gbit-sweep-dedicated.png \
    | tee $out/1gbit-sweep-dedicated.txt
