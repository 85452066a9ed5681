#!/usr/bin/env bash
# Compression figures of docs/benchmarks.md: DDP (gloo's ring), DDP on the sparcoll backend and the
# compression hook with each compressor, 4 workers on 1 Gbit/s emulated links, side by side in one
# `sparcoll train --compare` per workload. Round 1 runs every compressor on gpt and a wide set on vgg
# (each vgg mode starts 4 workers of 3.4 GB); later rounds repeat the modes the targets are about.
# Root is needed for the emulated network; run it idle (round 1 about 30 minutes, later ones 12).
#   benchmarks/run_compress.sh OUT_DIR [ROUNDS=3]
# then: python3 benchmarks/compress_summary.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 rounds=${2:-3}
mkdir -p "$out"
export OMP_NUM_THREADS=1
every="none fp16 bf16 topk:0.01 randomk:0.01 threshold:0.01 dgc:0.01 qsgd:16 terngrad signsgd efsignsgd onebit powersgd:4 powersgd:16 blocktopk:0.01"
modes() { local m="ddp,sparcoll" s; for s in "$@"; do m="$m,hook:compress=$s"; done; echo "$m"; }
# A workload that fails is reported (its stderr kept in .err) and the others still run.
train() { local name=$1; shift; timeout 3600 ./dev sparcoll train --workers 4 --network 1gbit "$@" \
            --json "$out/$name-r$round.json" > "$out/$name-r$round.txt" 2> "$out/$name-r$round.err" \
            && rm -f "$out/$name-r$round.err" || echo "$(date +%T) FAILED: $name round $round" >&2; }
for round in $(seq 1 "$rounds"); do
  if [ "$round" = 1 ]; then gpt=$every; vgg="fp16 topk:0.01 efsignsgd powersgd:4 powersgd:16 blocktopk:0.01"
  else gpt="topk:0.01 powersgd:4 powersgd:16 blocktopk:0.01"; vgg="topk:0.01 powersgd:4 powersgd:16 blocktopk:0.01"; fi
  # shellcheck disable=SC2086
  train gpt --workload gpt --steps 30 --warmup 3 --compare "$(modes $gpt)"
  # shellcheck disable=SC2086
  train vgg --workload vgg --steps 8 --warmup 2 --compare "$(modes $vgg)"
  train deeplight --workload deeplight --steps 30 --warmup 3 \
        --compare "agsparse,$(modes fp16 topk:0.01 powersgd:4 blocktopk:0.01)"
done
