"""The sparse path alone on one small tensor: median ms a blocking call, rank 0's view.

    PYTHONPATH=<commit's src> OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \
        docs/results/small-sparse-kinds/sparse_only.py [NUMEL] [DENSITY]

NUMEL floats (default 65536) with DENSITY (default 0.1) of each rank's 256-element blocks non-zero,
300 calls after 20 untimed, each after a barrier; the sum is checked against the dense one.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

import sparcoll

numel = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
density = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
comm = sparcoll.init(algorithm="sparse")
inputs = []
for r in range(world):
    g = torch.Generator().manual_seed(r)
    x = torch.zeros(numel // 256, 256)
    x[torch.randperm(len(x), generator=g)[:int(len(x) * density)]] = 1.0
    inputs.append(x.view(-1))
expected = sum(inputs)
times, x = [], inputs[rank].clone()
for i in range(320):
    x.copy_(inputs[rank])
    dist.barrier()
    start = time.perf_counter()
    comm.allreduce(x)
    if i >= 20:
        times.append((time.perf_counter() - start) * 1e3)
    assert torch.equal(x, expected)
if rank == 0:
    print(f"{world} ranks, {numel} floats, {density:g} of each rank's blocks: "
          f"median {statistics.median(times):.3f} ms, p10 {sorted(times)[len(times) // 10]:.3f} ms")
comm.close()
dist.destroy_process_group()
