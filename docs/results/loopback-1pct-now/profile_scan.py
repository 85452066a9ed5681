"""One-off: 40 sparse allreduces of 16M float32 at 1% block density, 2 ranks on loopback, rank 0 under cProfile
(sorted by the first argument, e.g. tottime); the median of 40 calls before it.
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 docs/results/loopback-1pct-now/profile_scan.py tottime"""
import sys, time, torch, numpy as np, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); r = dist.get_rank()
comm = sparcoll.init(algorithm="sparse")
n, bs = 16 << 20, 256
g = torch.Generator().manual_seed(r)
def make():
    t = torch.zeros(n)
    idx = torch.randperm(n // bs, generator=g)[: n // bs // 100]
    t.view(-1, bs)[idx] = 1.0
    return t
ts = [make() for _ in range(4)]
work = [t.clone() for t in ts]
for i in range(10): work[i % 4].copy_(ts[i % 4]); comm.allreduce(work[i % 4])
def loop(k):
    times = []
    for i in range(k):
        work[i % 4].copy_(ts[i % 4]); dist.barrier()
        s = time.perf_counter(); comm.allreduce(work[i % 4]); times.append(time.perf_counter() - s)
    return times
t1 = loop(40)
if len(sys.argv) > 1 and r == 0:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable(); loop(40); pr.disable()
    pstats.Stats(pr).sort_stats(sys.argv[1]).print_stats(25)
elif len(sys.argv) > 1:
    loop(40)
if r == 0: print("median ms", np.median(t1) * 1e3)
comm.close()
