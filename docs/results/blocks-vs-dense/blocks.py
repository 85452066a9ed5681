"""The sparse AllReduce of a dense tensor with 1% of its blocks non-zero (what the planner's grid
times) against the same blocks given as blocks (Channel.blocks_mean, as blocktopk's payload goes)."""
import sys, time, statistics, numpy as np, torch, torch.distributed as dist
import sparcoll
from sparcoll.compress.channel import Channel
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
comm = sparcoll.init()
channel = Channel(None, comm)
numel, bs = int(sys.argv[1]), 256
nblocks = -(-numel // bs)
rng = np.random.default_rng(rank + 7)
idx = torch.from_numpy(np.sort(rng.choice(nblocks, max(1, nblocks // 100), replace=False)))
rows = torch.randn(len(idx), bs)
dense = torch.zeros(nblocks * bs)
dense.view(nblocks, bs)[idx] = rows
dense = dense[:numel].clone()
def timed(run, prepare=lambda: None):
    cpus, walls = [], []
    for i in range(23):
        arg = prepare()             # outside the timing, as the profile's prepare
        dist.barrier()
        c, t = time.process_time(), time.perf_counter()
        run(arg)
        cpu, wall = time.process_time() - c, time.perf_counter() - t
        if i >= 3: cpus.append(cpu); walls.append(wall)
    v = torch.tensor([statistics.median(cpus), statistics.median(walls)], dtype=torch.float64)
    s = v.clone(); dist.all_reduce(s); m = v.clone(); dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return s[0].item() / world * 1e3, m[0].item() * 1e3, m[1].item() * 1e3
into = [torch.empty(numel)]
a = timed(lambda t: comm.allreduce(t, op="avg"), dense.clone)
b = timed(lambda _: channel.blocks_mean([(idx, rows, numel)], bs, into))
if rank == 0:
    print(f"numel {numel}: dense 1% blocks: cpu mean {a[0]:.2f} max {a[1]:.2f} wall {a[2]:.2f} ms | as blocks: cpu mean {b[0]:.2f} max {b[1]:.2f} wall {b[2]:.2f} ms", flush=True)
comm.close(); dist.destroy_process_group()
