"""find_unused_parameters on a model built in the reverse of the order it is used in: its first
layer's gradient is ready first but its parameters' reverse order puts it last. DataParallel with
and without the flag on two copies, their steps alternated with DDP's on a third, each step's time the
slowest rank's. DDP's communication share: the time from its last gradient to backward's return
(communication not hidden behind backward) over its step, as `sparcoll train` measures it.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 order.py [STEPS] [LAYERS] [WIDTH] [ROWS]
"""
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sparcoll.torch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
steps, layers, width, rows = (int(a) for a in (sys.argv[1:] + ["20", "8", "1024", "64"][len(sys.argv) - 1:]))


class BuiltUpsideDown(nn.Module):
    """layers[0] is applied last, so its gradient is ready first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.relu(layer(x))
        return x


model = BuiltUpsideDown()
models = {flag: sparcoll.torch.DataParallel(copy.deepcopy(model), strategy="ring",
                                            find_unused_parameters=flag) for flag in (False, True)}
models["ddp"] = DistributedDataParallel(copy.deepcopy(model))
last_gradient = [0.0]
for p in models["ddp"].parameters():
    p.register_post_accumulate_grad_hook(lambda _: last_gradient.__setitem__(0, time.perf_counter()))
optimizers = {key: torch.optim.SGD(m.parameters(), lr=0.01) for key, m in models.items()}
generator = torch.Generator().manual_seed(rank)
times = {key: [] for key in models}
shares = []
for step in range(steps + 2):
    x = torch.randn(rows, width, generator=generator)
    for key in ((False, True, "ddp") if step % 2 == 0 else ("ddp", True, False)):
        dist.barrier()
        start = time.perf_counter()
        optimizers[key].zero_grad()
        models[key](x).pow(2).mean().backward()
        exposed = time.perf_counter() - last_gradient[0]
        optimizers[key].step()
        took = torch.tensor([time.perf_counter() - start, exposed])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step >= 2:
            times[key].append(took[0].item() * 1e3)
            if key == "ddp":
                shares.append(took[1].item() * 1e3 / times[key][-1])
same = all(torch.equal(a, b) for a, b in zip(models[False].parameters(), models[True].parameters()))
close = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(models[False].parameters(), models["ddp"].parameters()))
if rank == 0:
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"{layers} layers of {width}, {rows} rows, {world} ranks, {steps} steps each: median ms "
          f"without {without:.1f}, with find_unused_parameters {with_:.1f} ({with_ / without:.2f}x); "
          f"same parameters after: {same}; DDP {statistics.median(times['ddp']):.1f}, communicating "
          f"{statistics.median(shares):.0%} of its step, its parameters within 1e-6: {close}")
for key in (False, True):
    models[key].close()
dist.destroy_process_group()
