#!/usr/bin/env bash
# Poseidon figures of docs/benchmarks.md (sparcoll.torch.DataParallel on the vgg head, batch 32 per
# worker, side by side in one `sparcoll train --compare` per point):
#   vgg-rN: 4 workers at 1 Gbit/s. Round 1: DDP (gloo's ring), DDP on the sparcoll backend, and the
#           wrapper with the ring, the parameter server, SFB for every layer, the hybrid choice, and the
#           hybrid without wait-free backpropagation; later rounds repeat DDP and the hybrid with and
#           without wait-free.
#   single: one worker alone (no communication), the base of the speedup over one worker.
#   sweep-RATE-wN: DDP and the hybrid for 2, 4 and 8 workers at 1 Gbit/s, 500 Mbit/s and 100 Mbit/s
#           (fewer steps at 100 Mbit/s, where a DDP step takes 1-2 minutes).
# Root is needed for the emulated network; run it idle: about 20 minutes for the vgg rounds and 35 for
# the sweep.
#   benchmarks/run_poseidon.sh OUT_DIR [ROUNDS=3] [SWEEP=yes]
# then: python3 benchmarks/poseidon_summary.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 rounds=${2:-3} sweep=${3:-yes}
mkdir -p "$out"
export OMP_NUM_THREADS=1
# A point that fails is reported (its stderr kept in .err) and the others still run.
train() { local name=$1; shift; timeout 3600 ./dev sparcoll train --workload vgg --batch-size 32 "$@" \
            --json "$out/$name.json" > "$out/$name.txt" 2> "$out/$name.err" \
            && rm -f "$out/$name.err" || echo "$(date +%T) FAILED: $name" >&2; }
for round in $(seq 1 "$rounds"); do
  modes=ddp,poseidon,poseidon-blocking
  if [ "$round" = 1 ]; then
    modes=ddp,sparcoll,poseidon:strategy=ring,poseidon:strategy=ps,poseidon:strategy=sfb,poseidon,poseidon-blocking
  fi
  train "vgg-r$round" --workers 4 --network 1gbit --steps 8 --warmup 2 --compare "$modes"
done
[ "$sweep" = yes ] || exit 0
train single --workers 1 --network none --steps 6 --warmup 2 --comm poseidon
for rate in 1gbit 500mbit 100mbit; do
  steps="--steps 5 --warmup 2"
  [ "$rate" = 100mbit ] && steps="--steps 3 --warmup 1"
  for workers in 2 4 8; do
    # shellcheck disable=SC2086
    train "sweep-$rate-w$workers" --workers "$workers" --network "$rate" $steps --compare ddp,poseidon
  done
done
