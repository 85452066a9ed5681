"""The job the one-offs here share: 2 ranks (torchrun), sparse allreduces of 16M float32 at 1% block
density, four inputs in turn; `loop(k)` times k calls, each after a barrier."""
import time

import torch
import torch.distributed as dist

import sparcoll

NUMEL, BLOCK = 16 << 20, 256


def start():
    dist.init_process_group("gloo")
    comm = sparcoll.init(algorithm="sparse")
    g = torch.Generator().manual_seed(dist.get_rank())
    inputs = []
    for _ in range(4):
        t = torch.zeros(NUMEL)
        t.view(-1, BLOCK)[torch.randperm(NUMEL // BLOCK, generator=g)[:NUMEL // BLOCK // 100]] = 1.0
        inputs.append(t)
    work = [t.clone() for t in inputs]

    def loop(k, each=None):
        times = []
        for i in range(k):
            work[i % 4].copy_(inputs[i % 4])
            dist.barrier()
            if each is not None:
                each(i)
            begin = time.perf_counter()
            comm.allreduce(work[i % 4])
            times.append(time.perf_counter() - begin)
        return times

    loop(10)
    return comm, loop
