"""One-off: a timeline of rank 0's and rank 1's events (CLOCK_MONOTONIC, shared) over 40 sparse 16M 1%
allreduces, 2 ranks on loopback: where each call's time goes between the two ranks."""
import sys, time, torch, numpy as np, torch.distributed as dist, threading
import sparcoll
from sparcoll import worker, aggregator, blocks, engine, algorithm
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
events = []
def wrap(obj, name, label):
    orig = getattr(obj, name)
    def f(*a, **k):
        events.append((label + ">", time.monotonic(), threading.current_thread().name[:6]))
        out = orig(*a, **k)
        events.append((label + "<", time.monotonic(), threading.current_thread().name[:6]))
        return out
    setattr(obj, name, f)
wrap(blocks.BlockTensor, "nonzero", "scan")
wrap(worker.WorkerJob, "_transmit", "transmit")
wrap(aggregator.AggregatorJob, "_broadcast", "bcast")
wrap(worker._ResultPlacement, "finish", "placed")
wrap(algorithm.Chooser, "learn", "learn")
wrap(worker.WorkerJob, "run", "run")
for i in range(10): work[i % 4].copy_(ts[i % 4]); comm.allreduce(work[i % 4])
starts = []
for i in range(40):
    work[i % 4].copy_(ts[i % 4]); dist.barrier()
    events.clear() if i == 30 else None
    s = time.monotonic(); starts.append(s); comm.allreduce(work[i % 4]); events.append(("end", time.monotonic(), "main"))
out = [None, None]
dist.all_gather_object(out, (starts[30:], events))
if r == 0:
    t0 = min(out[0][0][0], out[1][0][0])
    merged = sorted([(t, rank, e, th) for rank, (st, ev) in enumerate(out) for e, t, th in ev])
    for t, rank, e, th in merged:
        print(f"{(t - t0) * 1e3:8.2f} r{rank} {th:6s} {e}")
    print("starts r0", [round((s - t0) * 1e3, 2) for s in out[0][0]])
    print("starts r1", [round((s - t0) * 1e3, 2) for s in out[1][0]])
comm.close()
