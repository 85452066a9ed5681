#!/usr/bin/env bash
# ncf profiled by two commits in turn, 3 profiles each (no trial):  ab.sh BASE_WORKTREE NEW_WORKTREE OUT
# OUT/base and OUT/new then hold W-profile-N.json and W-plan-N.{json,txt}, as run.sh writes them.
set -euo pipefail
base=$1 new=$2 out=$3
export OMP_NUM_THREADS=1
for i in 1 2 3; do
  order="base new"; [ $((i % 2)) -eq 0 ] && order="new base"
  for v in $order; do
    src=$base; [ "$v" = new ] && src=$new
    mkdir -p "$out/$v"
    PYTHONPATH=$src/src timeout 1800 ./dev sparcoll plan --workload ncf --workers 4 --network 1gbit --trial 0 \
      --profile "$out/$v/ncf-profile-$i.json" --json "$out/$v/ncf-plan-$i.json" > "$out/$v/ncf-plan-$i.txt" \
      2> >(grep -v "━\|╸" > "$out/$v/ncf-plan-$i.err")  # only progress lines: not kept
  done
done
