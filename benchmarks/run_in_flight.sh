#!/usr/bin/env bash
# Messages in flight per stream to dedicated aggregators (SPARCOLL_CREDITS 1, 2, 4) under the emulated
# links' default token bucket (1 MB, which lets a link burst after an idle gap) and a 128 KiB one
# (closer to a real NIC, which never sends above its rate): 4 workers, 16M float32, 1 Gbit/s,
# 10% and 100%, ROUNDS rounds, each run next to gloo's ring.
#   benchmarks/run_in_flight.sh OUT [ROUNDS]        # as root; about 1 minute a run
# A run whose JSON already exists is skipped, so an interrupted sweep resumes where it stopped.
set -euo pipefail
out=$(realpath "${1:?output directory}")
rounds=${2:-3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for burst in default 128K; do
    extra=(); [ "$burst" = default ] || extra=(--link-burst "$burst")
    for credits in 1 2 4; do
      name="credits$credits-burst-$burst-r$round"
      [ -e "$out/$name.json" ] && continue
      SPARCOLL_CREDITS=$credits ./dev sparcoll bench --workers 4 --numel 16M --density 0.1,1 \
        --algos ring,sparse --aggregators dedicated --network 1gbit --repeat 5 --warmup 2 "${extra[@]}" \
        --json "$out/$name.json" > "$out/$name.txt" 2>/dev/null
    done
  done
done
