"""Time per allreduce of a dense mid-size tensor on each path sparcoll's chooser can take, forced.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/ring_paths.py

The chooser (sparcoll/algorithm.py) times each path a few times and keeps the fastest; this forces
each in turn (by setting the kind's chosen path, after its trials) to show what the choice is
between: the sparse AllReduce, gloo's ring with sparcoll's check, the gathered path, and gloo's own
allreduce beside them. The four run interleaved, call by call. Rank 0 prints median / mean
microseconds per call.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import sparcoll
from sparcoll.algorithm import Algorithm

SIZES = [4096, 16384, 65536]
CALLS = 200
WARMUP = 20
PATHS = (Algorithm.SPARSE, Algorithm.RING, Algorithm.GATHER)


def main() -> int:
    dist.init_process_group("gloo")
    comm = sparcoll.init(algorithm="auto")
    chooser = comm._engine.chooser
    lines = []
    for numel in SIZES:
        tensor = torch.randn(numel)
        for _ in range(20):                 # past the kind's trials
            comm.allreduce(tensor)
        state = chooser._kinds[(numel, 0, 0)]
        times = {name: [] for name in ("sparse", "ring", "gather", "gloo")}
        for i in range(WARMUP + CALLS):
            for path in (*PATHS, None):
                if path is None:
                    start = time.perf_counter()
                    dist.all_reduce(tensor)
                else:
                    state.chosen = path
                    start = time.perf_counter()
                    comm.allreduce(tensor)
                if i >= WARMUP:
                    times["gloo" if path is None else path.value].append(time.perf_counter() - start)
        lines.append(f"| {numel} | " + " | ".join(
            f"{statistics.median(v) * 1e6:.0f} / {statistics.mean(v) * 1e6:.0f}"
            for v in times.values()) + " |")
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, float32, dense data; median / mean microseconds per "
              f"call over {CALLS} calls of each, interleaved")
        print("| elements | sparse | ring | gather | gloo |")
        print("|---:|---:|---:|---:|---:|")
        print("\n".join(lines))
        sys.stdout.flush()
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
