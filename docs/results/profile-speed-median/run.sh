#!/usr/bin/env bash
# ncf profiled three times in a row (no trial), as profile-speed-8a76fdc, with each CPU time given at
# the profile's median speed (profiler.at_profile_speed): how far the predicted CPU per worker moves
# between profiles now. From the project root on an idle machine:
#   [PYTHONPATH=WORKTREE/src] docs/results/profile-speed-median/run.sh [OUT] [WORKLOAD]
set -euo pipefail
out=${1:-docs/results/profile-speed-median} w=${2:-ncf}
mkdir -p "$out"
export OMP_NUM_THREADS=1
for i in 1 2 3; do
  timeout 1800 ./dev sparcoll plan --workload "$w" --workers 4 --network 1gbit --trial 0 \
    --profile "$out/$w-profile-$i.json" --json "$out/$w-plan-$i.json" > "$out/$w-plan-$i.txt" \
    2> >(grep -v "━\|╸" > "$out/$w-plan-$i.err")  # only progress lines: not kept
done
