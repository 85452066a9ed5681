"""Time per allreduce of small tensors: gloo, sparcoll as users get it ("auto"), sparcoll forced sparse.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \
        benchmarks/small_tensors.py [DENSITY]

Dense float32 data (every block non-zero: the usual small tensor, a loss or a bias), or with DENSITY
(below 1) that share of each rank's 256-element blocks non-zero and 4K to 64K floats only (smaller
tensors are one block: dense, or zero); the sums, kept in place call after call, then hold the
union of the ranks' blocks. Blocking calls
(one at a time) and async ones (a batch of 16 issued, then waited for). The three take turns in
runs of RUN calls, so a busy moment of the machine hits them alike. Each run (and each batch) starts
with an untimed call: ranks leave a collective at different times and the next call, whoever's,
waits for the last of them, so each candidate pays for the spread it leaves, not the one before
(with turns of one call each, sparcoll's 1-float call on 4 ranks took 1081 us median right after
gloo's, 576-658 us after the forced sparse path's). Rank 0 prints a markdown table of median,
90th-percentile and mean microseconds per call (the mean is what a loop of calls costs: gloo's
median hides a tail of 3-4 ms calls on a busy machine).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import sparcoll

SIZES = [1, 8, 256, 1024, 4096, 16384, 65536]
CALLS = 300         # timed blocking calls per size and candidate (after WARMUP)
WARMUP = 20
RUN = 10            # timed blocking calls of a candidate in a row, after one untimed call
BATCH = 16          # async calls in flight at once
BATCHES = 30


def make(numel: int, density: float, generator: torch.Generator) -> torch.Tensor:
    """Random floats in `density` of the tensor's 256-element blocks (all of them at 1), zeros
    elsewhere."""
    tensor = torch.randn(numel, generator=generator)
    if density < 1:
        blocks = tensor.view(-1, 256)
        blocks[torch.rand(len(blocks), generator=generator) >= density] = 0.0
    return tensor


def main() -> int:
    density = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    sizes = SIZES if density >= 1 else [n for n in SIZES if n >= 4096]
    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(dist.get_rank())
    rank = dist.get_rank()
    candidates = {"gloo": lambda t, a: dist.all_reduce(t, async_op=a),
                  "sparcoll": None, "sparse": None}
    comms = {"sparcoll": sparcoll.init(algorithm="auto"), "sparse": sparcoll.init(algorithm="sparse")}
    for name, comm in comms.items():
        candidates[name] = (lambda c: lambda t, a: c.allreduce(t, async_op=a))(comm)
    rows = []
    for numel in sizes:
        tensor = make(numel, density, generator)
        blocking = {name: [] for name in candidates}
        for name, run in candidates.items():
            for _ in range(WARMUP):
                run(tensor, False)
        for _ in range(CALLS // RUN):
            for name, run in candidates.items():
                run(tensor, False)      # waits for the ranks' spread the last candidate left
                for _ in range(RUN):
                    start = time.perf_counter()
                    run(tensor, False)
                    blocking[name].append(time.perf_counter() - start)
        batched = {name: [] for name in candidates}
        tensors = [make(numel, density, generator) for _ in range(BATCH)]
        for _ in range(BATCHES):
            for name, run in candidates.items():
                run(tensors[0], False)
                start = time.perf_counter()
                works = [run(t, True) for t in tensors]
                for work in works:
                    work.wait()
                batched[name].append((time.perf_counter() - start) / BATCH)
        rows.append((numel, blocking, batched))
    if rank == 0:
        data = "dense data" if density >= 1 else f"{density:g} of each rank's blocks non-zero"
        print(f"{dist.get_world_size()} ranks, float32, {data}; microseconds per call "
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
