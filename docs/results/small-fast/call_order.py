"""One-off: benchmarks/small_tensors.py as of ea74fc1 (candidates in turns of one call each), with the
candidates in the order $ORDER gives and sizes 1 and 8 only; outputs in call-order.txt.
    ORDER=gloo,sparcoll,sparse OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node N \
        docs/results/small-fast/call_order.py"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import sparcoll

SIZES = [1, 8]
CALLS = 300         # timed blocking calls per size and candidate (after WARMUP)
WARMUP = 20
BATCH = 16          # async calls in flight at once
BATCHES = 30


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    candidates = {"gloo": lambda t, a: dist.all_reduce(t, async_op=a),
                  "sparcoll": None, "sparse": None}
    comms = {"sparcoll": sparcoll.init(algorithm="auto"), "sparse": sparcoll.init(algorithm="sparse")}
    for name, comm in comms.items():
        candidates[name] = (lambda c: lambda t, a: c.allreduce(t, async_op=a))(comm)
    rows = []
    for numel in SIZES:
        tensor = torch.randn(numel)
        blocking = {name: [] for name in candidates}
        import os
        order = os.environ["ORDER"].split(",")
        for i in range(WARMUP + CALLS):
            for name in order:
                run = candidates[name]
                start = time.perf_counter()
                run(tensor, False)
                if i >= WARMUP:
                    blocking[name].append(time.perf_counter() - start)
        batched = {name: [] for name in candidates}
        tensors = [torch.randn(numel) for _ in range(BATCH)]
        for _ in range(BATCHES):
            for name, run in candidates.items():
                start = time.perf_counter()
                works = [run(t, True) for t in tensors]
                for work in works:
                    work.wait()
                batched[name].append((time.perf_counter() - start) / BATCH)
        rows.append((numel, blocking, batched))
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, float32, dense data; microseconds per call "
              f"(median / p90 / mean of {CALLS} blocking calls; median of {BATCHES} batches of "
              f"{BATCH} async calls)")
        print("| elements | gloo | sparcoll | sparse | sparcoll / gloo | sparcoll / gloo, mean "
              "| gloo async | sparcoll async | sparse async | sparcoll / gloo async |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for numel, blocking, batched in rows:
            med = {n: statistics.median(v) * 1e6 for n, v in blocking.items()}
            p90 = {n: sorted(v)[int(len(v) * 0.9)] * 1e6 for n, v in blocking.items()}
            amed = {n: statistics.median(v) * 1e6 for n, v in batched.items()}
            mean = {n: statistics.mean(v) * 1e6 for n, v in blocking.items()}
            cells = [f"{med[n]:.0f} / {p90[n]:.0f} / {mean[n]:.0f}" for n in candidates]
            acells = [f"{amed[n]:.0f}" for n in candidates]
            print(f"| {numel} | " + " | ".join(cells) + f" | {med['sparcoll'] / med['gloo']:.2f} | "
                  f"{mean['sparcoll'] / mean['gloo']:.2f} | " + " | ".join(acells)
                  + f" | {amed['sparcoll'] / amed['gloo']:.2f} |")
        ring = comms["sparcoll"].stats
        print(f"sparcoll (auto) ran {ring.ring_collectives} of {ring.collectives} collectives on "
              f"gloo's ring")
        sys.stdout.flush()
    for comm in comms.values():
        comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
