#!/bin/bash
# DDP's reference on sparse gradients, two versions alternated, 3 rounds: deeplight with 4 workers on
# loopback (40 steps) and at 1 Gbit/s (30 steps), ncf with 4 workers on loopback (40 steps).
#   rounds.sh OUT A B    A and B: worktrees /tmp/wt/A and /tmp/wt/B (their src is the PYTHONPATH)
# one-thread-cost/: rounds.sh one-thread-cost old new  (old = e6aa222, gloo's two threads; new = 79b308e, one)
# fresh-cost/:      rounds.sh fresh-cost old fresh    (old = e6aa222, forked; fresh = 4e06d95, new interpreters)
out=$1; shift
mkdir -p "$out" && cd "$out" || exit 1
for r in 1 2 3; do
  for v in "$@"; do
    for case in "dl-loopback|--workload deeplight --workers 4 --network none --steps 40" \
                "dl-1gbit|--workload deeplight --workers 4 --network 1gbit --steps 30" \
                "ncf-loopback|--workload ncf --workers 4 --network none --steps 40"; do
      name=${case%%|*}; args=${case#*|}
      PYTHONPATH=/tmp/wt/$v/src timeout 600 /work/main/.venv/bin/python -m sparcoll train $args \
        --workload-option sparse_embeddings=true --comm ddp --json $name-$v-r$r.json > $name-$v-r$r.txt 2>&1
      echo "$name $v r$r rc=$? $(date +%T)"
    done
  done
done
