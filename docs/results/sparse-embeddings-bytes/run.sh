#!/bin/bash
# deeplight with sparse embeddings, 4 workers at 1 Gbit/s: uniform strategies and the two plans of
# make_plans.py, interleaved step by step, ROUNDS rounds. From the project root:
#   docs/results/sparse-embeddings-bytes/run.sh OUT_DIR ROUNDS
set -eu
out=$1; rounds=$2
mkdir -p "$out"
.venv/bin/python docs/results/sparse-embeddings-bytes/make_plans.py "$out"
for r in $(seq 1 "$rounds"); do
  timeout 1200 ./dev sparcoll train --workload deeplight --workers 4 --network 1gbit --steps 40 --warmup 3 \
    --workload-option sparse_embeddings=true --interleave \
    --compare ddp,poseidon:strategy=sparse,poseidon:strategy=blocktopk:0.01,poseidon:strategy=$out/mlp-blocktopk.json,poseidon:strategy=$out/mlp-ring.json \
    --json "$out/r$r.json" > "$out/r$r.txt" 2> "$out/r$r.err"
done
