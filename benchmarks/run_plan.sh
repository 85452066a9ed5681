#!/usr/bin/env bash
# The planner's figures of docs/benchmarks-log.md, 4 workers at 1 Gbit/s (emulated; root needed), per
# workload (default: deeplight ncf gpt vgg):
#   W-profile.json, W-plan.{json,txt}   `sparcoll plan`: the profile, the plan and its predictions
#   W-u-NAME.json                       the uniform strategies the plan predicts best (three), the ring and
#                                       the sparse AllReduce (the lossless ones, always: the model's ranking
#                                       missed the fastest uniform strategy, uniform sparse on ncf with
#                                       sparse embeddings)
#   W-u-NAME-whole.json                 the best of those with its units fused whole (--fusion whole), if
#                                       that fuses them differently
#   W-dense-NAME.json                   for a model with sparse gradients, the compressor predicted best on
#                                       its dense gradients only (--dense-only), if the plan is not that
#   W-without-DIM.json                  the planner without compression, collective or offload choice
#   W-rN.{json,txt}                     one `sparcoll train --compare` per round: DDP, the plan, each
#                                       uniform strategy and each ablation whose plan differs from the plan,
#                                       all run by the same executor (sparcoll.torch.DataParallel); every
#                                       other round in reversed order
# Run it idle: about 15 minutes per round for the four workloads, plus 5 for the profiles.
#   benchmarks/run_plan.sh OUT_DIR [ROUNDS=3] [WORKLOADS="deeplight ncf gpt vgg"]
# A workload may carry options of its config after '+' (each as --workload-option, in every mode, DDP's
# included), e.g. deeplight+sparse_embeddings=true; its files are then named deeplight+sparse_embeddings_true-*.
# LINK_BURST=128K (for example) gives the links that token bucket in the profile and every run (--link-burst).
# INTERLEAVE=1 runs each round's modes in one job, a step of each in turn (`sparcoll train --interleave`),
# with twice the steps: the machine's drift then falls on every mode alike, and plan_summary.py compares
# the plan with each uniform strategy step by step. Every mode holds its own model in every worker:
# too much memory for vgg (about 2.5 GB a mode and worker).
# then: .venv/bin/python benchmarks/plan_summary.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "$1") rounds=${2:-3} workloads=${3:-"deeplight ncf gpt vgg"}
mkdir -p "$out"
export OMP_NUM_THREADS=1
declare -A steps=([deeplight]=30 [ncf]=30 [gpt]=20 [vgg]=6 [lstm]=20 [cnn]=20 [narrowrec]=30)
py=.venv/bin/python
for word in $workloads; do
  IFS=+ read -r workload extra <<< "$word"
  options=()
  for o in ${extra//+/ }; do options+=(--workload-option "$o"); done
  [ -n "${LINK_BURST:-}" ] && options+=(--link-burst "$LINK_BURST")
  w=${word//=/_}
  plan() { timeout 3600 ./dev sparcoll plan --workload "$workload" "${options[@]}" --workers 4 --network 1gbit \
             --profile "$out/$w-profile.json" "$@"; }
  plan --json "$out/$w-plan.json" > "$out/$w-plan.txt"
  modes=ddp,planned
  best=$($py -c "import json, sys; u = json.load(open(sys.argv[1]))['uniform']; \
print(' '.join(dict.fromkeys(sorted(u, key=u.get)[:3] + ['ring', 'sparse'])))" "$out/$w-plan.json")
  same() {  # whether two plan files execute the same way (as the trial tells its candidates apart)
    $py -c "import json, sys; from sparcoll.plan.trial import signature; \
a, b = (signature(json.load(open(f))) for f in sys.argv[1:]); sys.exit(0 if a == b else 1)" "$@"
  }
  for name in $best; do
    file="$out/$w-u-${name//:/_}.json"
    plan --uniform "$name" --json "$file" > /dev/null
    modes="$modes,poseidon:strategy=$file"
  done
  # for a model with sparse gradients, the compressor predicted best on its dense ones only
  dense=$($py -c "import json, sys; d = json.load(open(sys.argv[1])).get('dense_only', {}); \
print(min(d, key=d.get) if d else '')" "$out/$w-plan.json")
  if [ -n "$dense" ]; then
    file="$out/$w-dense-${dense//:/_}.json"
    plan --uniform "$dense" --dense-only --json "$file" > /dev/null
    same "$file" "$out/$w-plan.json" || modes="$modes,poseidon:strategy=$file"
  fi
  first=${best%% *} file="$out/$w-u-${first//:/_}-whole.json"
  plan --uniform "$first" --fusion whole --json "$file" > /dev/null
  same "$file" "$out/$w-u-${first//:/_}.json" || modes="$modes,poseidon:strategy=$file"
  for dim in compression collective offload; do
    file="$out/$w-without-$dim.json"
    plan --without "$dim" --json "$file" > /dev/null
    # an ablation that plans the same as the planner runs as the plan did
    same "$file" "$out/$w-plan.json" || modes="$modes,poseidon:strategy=$file"
  done
  reversed=$(tr , '\n' <<< "$modes" | tac | paste -sd,)
  interleave=() n=${steps[$workload]}
  [ -n "${INTERLEAVE:-}" ] && interleave=(--interleave) n=$((2 * n))
  for round in $(seq 1 "$rounds"); do
    # every other round in reversed order: the machine's speed drifts over minutes (benchmarks-log.md,
    # section 7), and a fixed order would hand the same modes the same part of every round
    order=$modes; [ $((round % 2)) -eq 0 ] && order=$reversed
    timeout 3600 ./dev sparcoll train --workload "$workload" "${options[@]}" --workers 4 --network 1gbit --steps "$n" \
      --warmup 2 --compare "$order" "${interleave[@]}" --plan "$out/$w-plan.json" --json "$out/$w-r$round.json" \
      > "$out/$w-r$round.txt" 2> "$out/$w-r$round.err" && rm -f "$out/$w-r$round.err" \
      || echo "$(date +%T) FAILED: $w round $round" >&2
  done
done
