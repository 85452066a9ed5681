#!/bin/bash
# The heap's blocks under torch's aligned allocations, over many hash seeds: the script of
# tests/test_allocator.py::test_a_freed_aligned_block_serves_the_next_one_between_small_allocations
# (24 blocks of 100 MB, small tensors allocated between them), run RUNS times in each of three setups:
# as sparcoll starts its workers; without the tcache tunable; with the tunable but fastbins left on.
# Prints, per setup, how many runs gave each list of iterations at which a new block address appeared.
# Usage (from the project root): docs/results/allocator-aligned/spread_probe.sh RUNS
set -euo pipefail
runs=${1:?RUNS}
script=$(PYTHONPATH=tests .venv/bin/python -c "from test_allocator import ALIGNED; print(ALIGNED)")
fastbins_on=${script/sparcoll.keep_freed_memory()/import ctypes; mallopt = ctypes.CDLL(None).mallopt
[mallopt(parameter, value) for parameter, value in ((-8, 1), (-4, 0), (-1, 2**31 - 1))]}
run() {  # setup-name tunables script
    for seed in $(seq "$runs"); do
        env GLIBC_TUNABLES="$2" PYTHONHASHSEED="$seed" OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore \
            timeout 120 .venv/bin/python -c "$3" | python3 -c "import json, sys; r = json.loads(sys.stdin.read()); print(r['new_at'], round(r['growth'] / 1e6), 'MB')"
    done | sort | uniq -c | sed "s/^/$1: /"
}
run "tunable and fastbins off" glibc.malloc.tcache_count=0 "$script"
run "without the tunable" "" "$script"
run "tunable, fastbins on" glibc.malloc.tcache_count=0 "$fastbins_on"
