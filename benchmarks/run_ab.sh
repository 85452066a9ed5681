#!/usr/bin/env bash
# Before/after comparison of two commits on the figures docs/benchmarks.md tracks: loopback 2 workers,
# 1 Gbit/s 4 workers colocated and dedicated (root needed), ROUNDS rounds alternating the two
# commits, each from its own git worktree (the installed environment is shared; PYTHONPATH picks the
# code, and the workers and aggregators the bench starts inherit it). About 6 minutes per round.
#   benchmarks/run_ab.sh OLD_COMMIT NEW_COMMIT OUT_DIR [ROUNDS=3]
# then: python3 benchmarks/ab_summary.py OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 new=$2 out=$3 rounds=${4:-3}
mkdir -p "$out"
trees=$(mktemp -d)
trap 'git worktree remove --force "$trees/old" 2>/dev/null; git worktree remove --force "$trees/new" 2>/dev/null; rm -rf "$trees"' EXIT
git worktree add -q "$trees/old" "$old"
git worktree add -q "$trees/new" "$new"
export OMP_NUM_THREADS=1
for round in $(seq 1 "$rounds"); do
  for version in old new; do
    o="$out/$version-r$round"
    run() { PYTHONPATH="$trees/$version/src" timeout 900 .venv/bin/python -m sparcoll bench "$@" 2>/dev/null; }
    run --workers 2 --numel 16M --network none --algos sparcoll,ring --density 0.01,0.1,1 --repeat 15 \
        --json "$o-loopback.json" > "$o-loopback.txt"
    run --workers 4 --numel 16M --network 1gbit --algos sparcoll,ring --density 0.01,0.1,1 --repeat 10 \
        --json "$o-coloc.json" > "$o-coloc.txt"
    run --workers 4 --numel 16M --network 1gbit --algos sparcoll,ring --aggregators dedicated \
        --density 0.01,1 --repeat 10 --json "$o-dedicated.json" > "$o-dedicated.txt"
    echo "$(date +%T) $version round $round done" >&2
  done
done
