"""ncf's training step CPU (forward, backward, SGD lr 0), 4 workers at once: WINDOWS windows of 12 steps each."""
import os, sys, time, statistics, torch, torch.distributed as dist
from sparcoll.workloads import get_workload
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
w = get_workload("ncf", data=None, seed=0)
batches = w.batches(256, rank, world, 0)
model = w.model
opt = torch.optim.SGD(model.parameters(), lr=0.0)
def step():
    opt.zero_grad(); w.loss(model, next(batches)).backward(); opt.step()
for _ in range(5): step()
t0 = time.perf_counter()
for win in range(int(sys.argv[1])):       # as many on every rank
    cpus, walls = [], []
    for i in range(12):
        dist.barrier()
        c, t = time.process_time(), time.perf_counter()
        step()
        cpus.append(time.process_time() - c); walls.append(time.perf_counter() - t)
    v = torch.tensor([statistics.median(cpus), statistics.median(walls)], dtype=torch.float64)
    mx = v.clone(); dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    sm = v.clone(); dist.all_reduce(sm, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"{time.perf_counter()-t0:6.1f} s  cpu max {mx[0]*1e3:5.2f} mean {sm[0]/world*1e3:5.2f} ms  wall max {mx[1]*1e3:5.2f}", flush=True)
dist.destroy_process_group()
