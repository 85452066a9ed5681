#!/usr/bin/env bash
# Small calls with the ring's checks on gloo (1d4e4f3) and through the star (the commit of this directory), alternated:
# ROUNDS rounds of 2 ranks and 2 rounds of 4, each run benchmarks/small_tensors.py (gloo, sparcoll
# auto and sparcoll forced sparse interleaved call by call). OLD and NEW are worktrees of the two
# commits (each runs this checkout's benchmark with its own src); OUT (this directory unless
# given) gets the outputs.
#   docs/results/small-star/run.sh OLD NEW [ROUNDS=3] [OUT]
# then: cd OUT && python3 ../small-no-polling/summarize.py > summary.txt
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
out=$(mkdir -p "${4:-$(dirname "$0")}" && cd "${4:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
run() { PYTHONPATH=$2/src timeout 600 .venv/bin/torchrun --standalone --nproc-per-node $3 \
          benchmarks/small_tensors.py 2>/dev/null > "$out/$1.txt"; }
for r in $(seq 1 "$rounds"); do run old-2w-r$r "$old" 2; run new-2w-r$r "$new" 2; done
for r in 1 2; do run old-4w-r$r "$old" 4; run new-4w-r$r "$new" 4; done
