#!/usr/bin/env bash
# Large dense calls (100% density) with the ring's checks on gloo (OLD, 1d4e4f3) and through the star
# (NEW), alternated, ROUNDS rounds: loopback 2 workers 4M and 16M, 4 workers 4M, and 4 workers 4M at
# 1 Gbit/s emulated; sparcoll (auto: these go to gloo's ring with their check beside) and gloo's ring in
# the same run; OUT (this directory unless given) gets the outputs.
#   docs/results/small-star/dense/run.sh OLD NEW [ROUNDS=3] [OUT]
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
out=$(mkdir -p "${4:-$(dirname "$0")}" && cd "${4:-$(dirname "$0")}" && pwd)
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1
for round in $(seq 1 "$rounds"); do
  for c in old new; do
    tree=$old; [ $c = new ] && tree=$new
    for cfg in "loopback-2w-4M --workers 2 --numel 4M --repeat 10 --network none" \
               "loopback-4w-4M --workers 4 --numel 4M --repeat 5 --network none" \
               "loopback-2w-16M --workers 2 --numel 16M --repeat 10 --network none" \
               "1gbit-4w-4M --workers 4 --numel 4M --repeat 10 --network 1gbit"; do
      set -- $cfg; name=$1; shift
      PYTHONPATH=$tree/src timeout 900 .venv/bin/sparcoll bench --algos sparcoll,ring --warmup 6 \
        --density 1 "$@" > "$out/$c-$name-r$round.txt" 2>&1
    done
  done
done
