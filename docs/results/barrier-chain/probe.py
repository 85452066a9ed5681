"""Does the profile's way of timing a collective (`profiler.timed`: a barrier before each run, the
slowest worker's time from it) price a chain of collectives as training runs them? The sparse
AllReduce of one random tensor of ncf's largest embedding shape (4431776 elements) at its block
densities, 4 workers: timed alone as the profile does, and K of them back to back after one barrier
(the chain's time over K), in alternating order; and how far apart the workers leave the barrier.
Run: PYTHONPATH=src:benchmarks:docs/results/barrier-chain .venv/bin/python docs/results/barrier-chain/probe.py"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

NUMEL, DENSITY, CHAIN, ROUNDS = 4431776, 0.09, 5, 6


def body(cfg: dict, rank: int, world: int) -> None:
    import sparcoll
    from sparcoll.bench.events import emit
    from sparcoll.plan import profiler
    comm = sparcoll.init(timeout=cfg["timeout"])
    try:
        x, local, union = profiler.sparse_input(NUMEL, DENSITY, comm.block_size, rank, world)
        run = lambda t: comm.allreduce(t, op="avg")     # noqa: E731
        singles, chains, skews = [], [], []
        for _ in range(ROUNDS):
            singles.append(profiler.timed(run, x.clone).seconds)
            inputs = [x.clone() for _ in range(CHAIN)]
            dist.barrier()
            start = time.perf_counter()
            for t in inputs:
                run(t)
            chains.append(profiler.slowest(time.perf_counter() - start) / CHAIN)
            dist.barrier()
            left = torch.tensor([time.perf_counter()], dtype=torch.float64)
            every = [torch.empty_like(left) for _ in range(world)]
            dist.all_gather(every, left)
            skews.append((max(every) - min(every)).item())
        if rank == 0:
            emit({"event": "probe", "local": local, "union": union, "single_s": singles, "chain_s": chains,
                  "barrier_skew_s": skews})
    finally:
        comm.close()


def report(e: dict) -> None:
    s, c = statistics.median(e["single_s"]), statistics.median(e["chain_s"])
    print(f"alone after a barrier {1e3 * s:.2f} ms (median of {len(e['single_s'])} medians), in a chain of "
          f"{CHAIN} {1e3 * c:.2f} ms each: {s / c:.2f}x; workers leave a barrier "
          f"{1e3 * min(e['barrier_skew_s']):.2f}-{1e3 * max(e['barrier_skew_s']):.2f} ms apart")


if __name__ == "__main__":
    from probe_job import run_probe
    sys.exit(run_probe(report))
