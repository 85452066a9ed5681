#!/usr/bin/env bash
# The same allreduce points launched two ways on the same emulated 1 Gbit/s links: workers started
# directly by `sparcoll bench`, and by a torchrun agent per host (c10d rendezvous, as multi-host jobs
# launch). Colocated and dedicated aggregators, ROUNDS rounds, the two launchers alternating.
#   sudo benchmarks/run_multihost.sh OUT ROUNDS
set -euo pipefail
out=$(realpath "${1:?output directory}"); rounds=${2:-3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for layout in colocated dedicated; do
    for launcher in direct torchrun; do
      ./dev sparcoll bench --workers 4 --numel 16M --density 0.01,0.1,1 --algos sparcoll,ring \
        --aggregators "$layout" --network 1gbit --repeat 5 --warmup 2 --launcher "$launcher" \
        --json "$out/$layout-$launcher-r$round.json" > "$out/$layout-$launcher-r$round.txt" 2>/dev/null
    done
  done
done
