#!/usr/bin/env bash
# The COO unit alone: each workload's kept plan (PLAN_DIR/W-plan.json) against the same plan with each
# COO gradient in a unit of its own (made here as W-apart.json), alternated (the order swapped every
# round), ROUNDS rounds of one `sparcoll train --compare` each, 4 workers at 1 Gbit/s (root).
#   docs/results/plan-coo-units/ab.sh PLAN_DIR OUT_DIR [ROUNDS=3] [WORKLOADS="ncf narrowrec"]
set -euo pipefail
cd "$(dirname "$0")/../../.."
plans=$(realpath "$1") out=$(realpath -m "$2") rounds=${3:-3} workloads=${4:-"ncf narrowrec"}
mkdir -p "$out"
export OMP_NUM_THREADS=1
for w in $workloads; do
  fused="$plans/$w+sparse_embeddings_true-plan.json" apart="$out/$w-apart.json"
  .venv/bin/python - "$fused" "$apart" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
coo = {t["unit"] for t in plan["tensors"] if t["strategy"] == "sparse"}
top = max(t["unit"] for t in plan["tensors"])
for t in plan["tensors"]:
    if t["unit"] in coo and sum(u["unit"] == t["unit"] for u in plan["tensors"]) > 1:
        top += 1
        t["unit"] = top
json.dump(plan, open(sys.argv[2], "w"), indent=1)
PY
  for round in $(seq "${FIRST:-1}" "$rounds"); do
    modes="poseidon:strategy=$fused,poseidon:strategy=$apart"
    [ $((round % 2)) -eq 0 ] && modes="poseidon:strategy=$apart,poseidon:strategy=$fused"
    timeout 1800 ./dev sparcoll train --workload "$w" --workload-option sparse_embeddings=true --workers 4 \
      --network 1gbit --steps 30 --warmup 2 --compare "$modes" --json "$out/$w-r$round.json" 2>/dev/null \
      | grep -v "━" > "$out/$w-r$round.txt"
  done
done
