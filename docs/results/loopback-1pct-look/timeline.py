"""One-off: both ranks' events on CLOCK_MONOTONIC (one clock for every process of the machine) over the
last 10 of 40 calls of job.py's job: where each call's time goes between the two ranks.
    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 timeline.py"""
import threading
import time

import torch.distributed as dist

import job
from sparcoll import aggregator, algorithm, blocks, communicator, worker

events = []


def record(owner, name, label):
    original = getattr(owner, name)

    def recorded(*args, **kwargs):
        thread = threading.current_thread().name[:6]
        events.append((time.monotonic(), label + ">", thread))
        try:
            return original(*args, **kwargs)
        finally:
            events.append((time.monotonic(), label + "<", thread))
    setattr(owner, name, recorded)


for owner, name, label in [(communicator.Communicator, "allreduce", "call"), (worker.WorkerJob, "run", "run"),
                           (blocks.BlockTensor, "nonzero", "scan"), (worker.WorkerJob, "_transmit", "transmit"),
                           (aggregator.AggregatorJob, "_broadcast", "bcast"),
                           (worker._ResultPlacement, "finish", "placed"), (algorithm.Chooser, "learn", "learn")]:
    record(owner, name, label)
comm, loop = job.start()
loop(40, each=lambda i: events.clear() if i == 30 else None)
both = [None, None]
dist.all_gather_object(both, events)
if dist.get_rank() == 0:
    first = min(t for rank_events in both for t, _, _ in rank_events)
    for t, rank, event, thread in sorted((t, rank, e, th) for rank, evs in enumerate(both) for t, e, th in evs):
        print(f"{(t - first) * 1e3:8.2f} r{rank} {thread:6s} {event}")
comm.close()
