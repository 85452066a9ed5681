"""What find_unused_parameters costs a model that uses every parameter: DataParallel with and without
it on two copies of one workload, their steps alternated, each step's time the slowest rank's.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 cost.py WORKLOAD [STEPS] [OPTION=VALUE ...]
"""
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist

import sparcoll
import sparcoll.torch
from sparcoll.workloads import get_workload

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
name, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
options = dict(arg.split("=", 1) for arg in sys.argv[3:])
options = {k: {"true": True, "false": False}.get(v, v) for k, v in options.items()}
comm = sparcoll.init()
workload = get_workload(name, seed=0, **options)
models = {flag: sparcoll.torch.DataParallel(copy.deepcopy(workload.model), comm=comm,
                                            find_unused_parameters=flag) for flag in (False, True)}
optimizers = {flag: torch.optim.SGD(m.parameters(), lr=0.01) for flag, m in models.items()}
batches = workload.batches(256, rank, world, 0)
times = {False: [], True: []}
for step in range(steps + 2):
    batch = next(batches)
    for flag in ((False, True) if step % 2 == 0 else (True, False)):
        dist.barrier()
        start = time.perf_counter()
        optimizers[flag].zero_grad()
        workload.loss(models[flag], batch).backward()
        optimizers[flag].step()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step >= 2:
            times[flag].append(took.item() * 1e3)
if rank == 0:
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"{name} {options or ''} {world} ranks, {steps} steps each: median ms without "
          f"{without:.1f}, with find_unused_parameters {with_:.1f} ({with_ / without:.2f}x); "
          f"strategies without {sorted({e.strategy for e in models[False].trace})}, "
          f"with {sorted({e.strategy for e in models[True].trace})}")
for m in models.values():
    m.close()
comm.close()
dist.destroy_process_group()
