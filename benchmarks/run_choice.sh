#!/usr/bin/env bash
# "Never slower than gloo": sparcoll as users get it (algorithm auto) next to sparcoll forced onto its
# sparse AllReduce and gloo's ring, on every configuration issue 11 names, ROUNDS rounds (each a full
# pass, so a busy moment of the machine does not hit one configuration only). Root is needed for the
# emulated network. 8 warm-up repetitions: "auto" times a dense kind three times on each path and
# shares the times in a seventh collective before it settles (sparcoll/algorithm.py; 5 covered the
# two trials a path before `12876e8`; with the bench's default 2, 4 workers at 1 Gbit/s with
# dedicated aggregators and 100% density gave "auto" 1.31-1.40x the ring, 1.41-1.43x with 8, as the
# sparse path forced). About 8 minutes per
# round on the project's 2-core machine; run it idle.
#   benchmarks/run_choice.sh OUT_DIR [ROUNDS=3] [FIRST_ROUND=1]
# then: python3 benchmarks/choice_summary.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 rounds=${2:-3} first=${3:-1}
mkdir -p "$out"
export OMP_NUM_THREADS=1
# A configuration that fails is reported (its stderr kept in .err) and the others still run.
# Default warm-ups (14 for sparcoll's own choice: bench/algorithms.py); 8 left one sparse-path trial in the
# timed repetitions of 1gbit-2w-16M at 100% (2 workers' union at 10% is 0.19, just "clearly sparse").
bench() { local name=$1; shift; timeout 1200 ./dev sparcoll bench --algos sparcoll,sparse,ring "$@" \
            --json "$out/$name-r$round.json" > "$out/$name-r$round.txt" 2> "$out/$name-r$round.err" \
            && rm -f "$out/$name-r$round.err" || echo "$(date +%T) FAILED: $name round $round" >&2; }
for round in $(seq "$first" $((first + rounds - 1))); do
  bench loopback-2w-16M --workers 2 --numel 16M --network none --density 0.01,0.1,1 --repeat 10
  bench loopback-2w-4M --workers 2 --numel 4M --network none --density 0.01,0.1,1 --repeat 10
  bench loopback-4w-4M --workers 4 --numel 4M --network none --density 0.01,0.1,1 --repeat 5
  bench 1gbit-4w-16M --workers 4 --numel 16M --network 1gbit --density 0.01,0.1,1 --repeat 5
  bench 1gbit-4w-4M --workers 4 --numel 4M --network 1gbit --density 0.01,0.1,1 --repeat 5
  bench 1gbit-2w-16M --workers 2 --numel 16M --network 1gbit --density 0.01,0.1,1 --repeat 5
  bench 1gbit-4w-16M-dedicated --workers 4 --numel 16M --network 1gbit --aggregators dedicated \
        --density 0.01,0.1,1 --repeat 5
  bench loopback-2w-4M-dedicated --workers 2 --numel 4M --network none --aggregators dedicated \
        --density 0.01,0.1,1 --repeat 5
  bench 1gbit-4w-16M-rows32 --workers 4 --numel 16M --network 1gbit --row-width 32 --density 0.01,0.1 \
        --repeat 5
  echo "$(date +%T) round $round done" >&2
done
