#!/usr/bin/env bash
# The sparse AllReduce before and after the failure path's take-back (leases on messages queued from
# the tensor, a lock per result placed): forced sparse, 4M floats, the two commits alternated.
# 4 workers on the emulated 1 Gbit/s network (old-*, dev-*), 2 on loopback (lo-*); out.txt: medians.
#   OLD=/tmp/wt/old NEW=/tmp/wt/new docs/results/take-back-ab/run.sh (worktrees of the two commits)
set -euo pipefail
out="$(cd "$(dirname "$0")" && pwd)"
bench() {   # bench VERSION FILE ARGS...
  local src; src=$([ "$1" = old ] && echo "$OLD" || echo "$NEW")/src
  PYTHONPATH=$src OMP_NUM_THREADS=1 "$out/../../../.venv/bin/sparcoll" bench --numel 4M --density 0.01,0.1,1 \
    --algos sparse --repeat 10 --warmup 3 --json "$out/$2" "${@:3}" > /dev/null
}
for round in 1 2; do for v in old dev; do bench $v "$v-$round.json" --workers 4; done; done
for round in 1 2 3; do for v in old dev; do bench $v "lo-$v-$round.json" --workers 2 --network none; done; done
python3 - "$out" <<'PY' > "$out/out.txt"
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    rows = json.load(open(f))
    print(os.path.basename(f), " ".join(f"{r['density']:g}/{r['input']}: {r['median_s'] * 1e3:.2f} ms" for r in rows))
PY
