#!/bin/bash
# uniform sparse (not among the three uniform strategies the plan predicted best) beside the plan and the
# best uniform strategy of the rounds, interleaved: DIR WORD OPTIONS... ROUNDS
set -eu
dir=$1; w=$2; workload=$3; shift 3; rounds=$1; shift
best=${BEST:-qsgd_16}; opts=("$@")
./dev sparcoll plan --workload $workload "${opts[@]}" --workers 4 --network 1gbit --profile $dir/$w-profile.json \
  --uniform sparse --trial 0 --json $dir/$w-u-sparse.json > /dev/null
for r in $(seq 1 $rounds); do
  timeout 1200 ./dev sparcoll train --workload $workload "${opts[@]}" --workers 4 --network 1gbit --steps 60 --warmup 2 \
    --interleave --compare ddp,planned,poseidon:strategy=$dir/$w-u-sparse.json,poseidon:strategy=$dir/$w-u-$best.json \
    --plan $dir/$w-plan.json --json $dir/$w-sparse-check-r$r.json > $dir/$w-sparse-check-r$r.txt 2> $dir/$w-sparse-check-r$r.err
done
