"""One-off: line profile of rank 0's main thread over 40 sparse 16M 1% allreduces, 2 ranks on loopback:
    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 line_profile.py algorithm:Chooser.densities"""
import sys, time, torch, numpy as np, torch.distributed as dist
sys.path.insert(0, "/tmp/lp")
import sparcoll
from sparcoll import worker, aggregator, algorithm, blocks, engine, protocol, collective
from line_profiler import LineProfiler
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
lp = LineProfiler()
for f in sys.argv[1:]:
    mod, name = f.split(":")
    obj = globals()[mod]
    for part in name.split(".")[:-1]:
        obj = getattr(obj, part)
    last = name.split(".")[-1]
    wrapped = lp(getattr(obj, last))
    setattr(obj, last, wrapped)
t2 = loop(40)
if r == 0:
    lp.print_stats(output_unit=1e-3, stripzeros=True)
    print("median ms before/during", np.median(t1) * 1e3, np.median(t2) * 1e3)
comm.close()
