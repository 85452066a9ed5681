#!/usr/bin/env bash
# 3 runs each of 16M and 4M floats, 2 ranks on loopback: docs/results/loopback-dense/aa/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../../.."
export OMP_NUM_THREADS=1
for n in 16777216 4194304; do for r in 1 2 3; do
  timeout 300 .venv/bin/torchrun --standalone --nproc-per-node 2 "$here/aa.py" $n 40 2>/dev/null | grep "^$n"
done; done > "$here/out.txt"
