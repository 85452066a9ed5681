#!/bin/bash
# vgg's run-to-run spread with and without glibc's malloc asking for transparent huge pages
# (GLIBC_TUNABLES glibc.malloc.hugetlb=1; this machine's THP mode is madvise), alternated, one
# strategy (uniform blocktopk, the plan of the last rounds), 4 workers at 1 Gbit/s, 6 steps.
#   docs/results/vgg-hugepages/run.sh OUT_DIR ROUNDS [STRATEGY_JSON]   (from the project root, idle)
set -euo pipefail
out=$(realpath -m "$1") rounds=${2:-3}
strategy=$(realpath "${3:-docs/results/plan-54fec5a-fusion/vgg-u-blocktopk_0.01.json}")
mkdir -p "$out"
export OMP_NUM_THREADS=1
for round in $(seq 1 "$rounds"); do
  order="plain huge"; [ $((round % 2)) -eq 0 ] && order="huge plain"
  for mode in $order; do
    tunables=""; [ "$mode" = huge ] && tunables=glibc.malloc.hugetlb=1
    env ${tunables:+GLIBC_TUNABLES=$tunables} timeout 1200 ./dev sparcoll train --workload vgg --workers 4 \
      --network 1gbit --steps 6 --warmup 2 --compare "poseidon:strategy=$strategy" \
      --json "$out/$mode-r$round.json" > "$out/$mode-r$round.txt" 2> "$out/$mode-r$round.err" \
      && rm -f "$out/$mode-r$round.err" || echo "FAILED $mode r$round" >&2
  done
done
