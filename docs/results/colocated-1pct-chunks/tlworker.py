"""One-off: events of every rank of a colocated sparcoll job on the emulated network (CLOCK_MONOTONIC,
one clock for the machine's processes), 1% block-sparse 16M floats, the last 5 of 20 calls."""
import json, threading, time, sys
import numpy as np, torch, torch.distributed as dist
import sparcoll
from sparcoll import aggregator, blocks, communicator, worker
from sparcoll.bench.worker import run_worker, exit_process

events = []
def record(owner, name, label, arg=None):
    original = getattr(owner, name)
    def recorded(*args, **kwargs):
        thread = threading.current_thread().name[:6]
        extra = "" if arg is None else str(arg(*args))
        events.append((time.monotonic(), label + ">", thread, extra))
        try:
            return original(*args, **kwargs)
        finally:
            events.append((time.monotonic(), label + "<", thread, extra))
    setattr(owner, name, recorded)

record(communicator.Communicator, "allreduce", "call")
record(blocks.BlockTensor, "nonzero", "scan", lambda self, lo, hi: lo)
record(worker.WorkerJob, "_transmit", "transmit", lambda self, coll, agg, stream, sends: agg)
record(aggregator.AggregatorJob, "_broadcast", "bcast")
record(worker._ResultPlacement, "finish", "placed", lambda self, m: self.agg)

def body(cfg, rank, world):
    comm = sparcoll.init(timeout=60)
    n = 16 << 20
    rng = np.random.default_rng(rank)
    mask = np.repeat(rng.random(n // 256) < 0.01, 256)
    src = torch.from_numpy(np.where(mask, rng.standard_normal(n), 0).astype(np.float32))
    for i in range(20):
        if i == 15:
            events.clear()
        t = src.clone()
        dist.barrier()
        comm.allreduce(t)
    allev = [None] * world
    dist.all_gather_object(allev, events)
    if rank == 0:
        first = min(e[0] for evs in allev for e in evs)
        with open("/tmp/tl/out.txt", "w") as f:
            for t, r, ev, th, extra in sorted((e[0], r, e[1], e[2], e[3]) for r, evs in enumerate(allev) for e in evs):
                f.write(f"{(t - first) * 1e3:8.2f} r{r} {th:6s} {ev} {extra}\n")
    comm.close()

if __name__ == "__main__":
    exit_process(run_worker(sys.argv[1:], body))
