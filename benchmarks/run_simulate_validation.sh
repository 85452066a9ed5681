#!/usr/bin/env bash
# The measured runs that `sparcoll simulate` is validated against: 2, 4, 8 workers at 1 Gbit/s (16M
# floats) and at 200 Mbit/s (4M floats), colocated and dedicated aggregators, 1/10/100% density.
#   benchmarks/run_simulate_validation.sh OUT        # as root (network namespaces); about 20 minutes
set -euo pipefail
out=$(realpath "${1:?output directory}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
common=(--workers 2,4,8 --density 0.01,0.1,1 --repeat 3 --warmup 1)
for spec in "1gbit 16M" "200mbit 4M"; do
  set -- $spec
  ./dev sparcoll bench "${common[@]}" --network "$1" --numel "$2" --algos sparse,ring,ps,agsparse \
    --json "$out/$1-colocated.json" > "$out/$1-colocated.txt" 2>/dev/null
  ./dev sparcoll bench "${common[@]}" --network "$1" --numel "$2" --algos sparse --aggregators dedicated \
    --json "$out/$1-dedicated.json" > "$out/$1-dedicated.txt" 2>/dev/null
done
