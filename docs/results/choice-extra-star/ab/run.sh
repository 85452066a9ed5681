#!/usr/bin/env bash
# narrowrec on 4 workers on loopback, checks on gloo (OLD, 1d4e4f3) and through the star (NEW),
# alternated, ROUNDS rounds: sparse (COO) embedding gradients against gloo's sparse all_reduce, dense
# ones (tables of 100K rows) against DDP, 200 steps each, as benchmarks/run_choice_extra.sh trains them.
#   docs/results/choice-extra-star/ab/run.sh OLD NEW [ROUNDS=3]
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
out=$(cd "$(dirname "$0")" && pwd)
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1
for round in $(seq 1 "$rounds"); do
  for c in old new; do
    tree=$old; [ $c = new ] && tree=$new
    PYTHONPATH=$tree/src timeout 1200 .venv/bin/sparcoll train --workload narrowrec --workers 4 \
      --network none --steps 200 --workload-option sparse_embeddings=true --compare sparcoll,agsparse \
      > "$out/$c-coo-r$round.txt" 2>/dev/null
    PYTHONPATH=$tree/src timeout 1200 .venv/bin/sparcoll train --workload narrowrec --workers 4 \
      --network none --steps 200 --workload-option table_rows=100000,100000 --compare sparcoll,ddp \
      > "$out/$c-dense-r$round.txt" 2>/dev/null
  done
done
