#!/usr/bin/env bash
# How much the emulated links' token bucket flatters sparcoll with dedicated aggregators: 4 workers,
# 16M float32, 1 Gbit/s, 100%, with netem's default bucket (1 MB) and with 128 KiB, ROUNDS rounds.
#   benchmarks/run_burst.sh OUT [ROUNDS]        # as root; about 1 minute a run
set -euo pipefail
out=$(realpath "${1:?output directory}")
rounds=${2:-3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for burst in default 128K; do
    extra=(); [ "$burst" = default ] || extra=(--link-burst "$burst")
    ./dev sparcoll bench --workers 4 --numel 16M --density 1 --algos ring,sparse --aggregators dedicated \
      --network 1gbit --repeat 5 --warmup 2 "${extra[@]}" --json "$out/burst-$burst-r$round.json" \
      > "$out/burst-$burst-r$round.txt" 2>/dev/null
  done
done
