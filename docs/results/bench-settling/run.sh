#!/usr/bin/env bash
# sparcoll's automatic choice at 100% right after the 1% point of the same tensor, 2 workers on
# loopback, 16M floats: "before" with 7 warm-ups per point (the sparse path's trials of the new
# density fell into the timed repetitions), "after" with the bench's default since it warms the
# automatic series up for LOOK_EVERY + 2 * TRIALS collectives. out.txt: every repetition, in ms.
#   docs/results/bench-settling/run.sh before|after   (before: run on a commit before the change; these: c4aec20)
set -euo pipefail
out="$(cd "$(dirname "$0")" && pwd)"
warmup=$([ "${1:?before or after}" = before ] && echo "--warmup 7" || echo "")
for r in 1 2 3; do
  OMP_NUM_THREADS=1 "$out/../../../.venv/bin/sparcoll" bench --workers 2 --network none --numel 16M \
    --density 0.01,1 --algos sparcoll,sparse,ring --repeat 10 $warmup --json "$out/$1-r$r.json" > /dev/null
done
python3 - "$out" <<'PY' > "$out/out.txt"
import glob, json, os, statistics, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-r?.json"))):
    rows = {r["algo"]: r["times_s"] for r in json.load(open(f)) if r["density"] == 1 and r["input"] == "dense"}
    ratio = statistics.median(rows["ring"]) / statistics.median(rows["sparcoll"])
    print(os.path.basename(f), f"sparcoll {ratio:.2f}x the ring;",
          "; ".join(f"{a}: {' '.join(str(round(t * 1e3)) for t in ts)}" for a, ts in rows.items()))
PY
