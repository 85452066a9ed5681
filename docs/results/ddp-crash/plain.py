"""One-off: plain DDP on gloo of ncf tiny with sparse embeddings (no sparcoll collective), 2 ranks under
torchrun, 30 steps; PROBE=1 adds sparcoll.train's GradientProbe. 40 runs each way under two busy loops:
    PYTHONPATH=src OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 docs/results/ddp-crash/plain.py"""
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from sparcoll.workloads import get_workload
PROBE = os.environ.get("PROBE") == "1"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
w = get_workload("ncf", tiny=True, sparse_embeddings=True, seed=0)
model = DistributedDataParallel(w.model, gradient_as_bucket_view=True)
params = list(w.model.parameters())
if PROBE:
    from sparcoll.train.worker import GradientProbe
    probe = GradientProbe(params, 256)
opt = torch.optim.SGD(params, lr=0.01)
batches = w.batches(8, rank, world, 0)
for step in range(30):
    batch = next(batches)
    opt.zero_grad()
    if PROBE:
        probe.reset(marking=step % 10 == 0)
    loss = w.loss(model, batch)
    loss.backward()
    opt.step()
    if PROBE and step % 10 == 0:
        probe.local_density(); probe.reduced_density()
    rows = [torch.empty(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor([loss.item(), 0.0, 0.0], dtype=torch.float64))
dist.destroy_process_group()
os._exit(0)
