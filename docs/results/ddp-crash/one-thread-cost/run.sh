#!/bin/bash
# DDP reference on sparse gradients: gloo's two worker threads (old = e6aa222) against one (new = 79b308e),
# alternated, 3 rounds: deeplight 4 workers loopback (40 steps) and 1 Gbit/s (30 steps), ncf 4 workers loopback (40 steps).
cd /tmp/threads
for r in 1 2 3; do
  for v in old new; do
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
