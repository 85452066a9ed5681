#!/usr/bin/env bash
# The rest of issue 11's figures, ROUNDS rounds: small tensors per call (2 ranks, loopback), the
# narrowrec model (embedding rows of 32) trained on loopback with sparse and dense embedding
# gradients, at sparcoll's default block size, at fixed ones, and on gloo, and the demo.
#   benchmarks/run_choice_extra.sh OUT_DIR [ROUNDS=3] [FIRST_ROUND=1]
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 rounds=${2:-3} first=${3:-1}
mkdir -p "$out"
export OMP_NUM_THREADS=1
train() { local name=$1; shift; timeout 1200 ./dev sparcoll train --workload narrowrec --workers 4 \
            --network none --steps 200 "$@" --json "$out/$name-r$round.json" > "$out/$name-r$round.txt" \
            2>/dev/null || echo "$(date +%T) FAILED: $name round $round" >&2; }
for round in $(seq "$first" $((first + rounds - 1))); do
  timeout 600 .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/small_tensors.py \
      2>/dev/null > "$out/small-tensors-r$round.txt" || echo "$(date +%T) FAILED: small tensors" >&2
  sparse=(--workload-option sparse_embeddings=true)
  train narrowrec-coo "${sparse[@]}" --compare sparcoll,agsparse
  for block in 16 32 64; do
    train "narrowrec-coo-block$block" "${sparse[@]}" --comm sparcoll --block-size "$block"
  done
  train narrowrec-dense --workload-option table_rows=100000,100000 --compare sparcoll,ddp
  train narrowrec-dense-block32 --workload-option table_rows=100000,100000 --comm sparcoll \
      --block-size 32
  timeout 600 ./dev demo --out "$out/demo-r$round" > "$out/demo-r$round.txt" 2>/dev/null \
      || echo "$(date +%T) FAILED: demo" >&2
  echo "$(date +%T) round $round done" >&2
done
