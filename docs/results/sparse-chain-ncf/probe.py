"""Do ncf's embeddings under the sparse AllReduce take as long in a chain, as training runs them, as
the profile times each alone (`profiler.timed`: a barrier before each run, the slowest worker's time)?
The four embedding gradients of one backward (4 workers, batch 256 a worker): each timed as the profile
times it, then the four back to back after one barrier in backward's order (each one's time on every
worker, the slowest), in 6 rounds.
Run: PYTHONPATH=src:benchmarks:docs/results/sparse-chain-ncf .venv/bin/python docs/results/sparse-chain-ncf/probe.py"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

ORDER = ("item_mlp.weight", "user_mlp.weight", "item_gmf.weight", "user_gmf.weight")
ROUNDS = 6


def body(cfg: dict, rank: int, world: int) -> None:
    import sparcoll
    from sparcoll.bench.events import emit
    from sparcoll.plan import profiler
    comm = sparcoll.init(timeout=cfg["timeout"])
    try:
        model, loss_of = profiler.model_and_loss({"workload": "ncf", "options": {}, "batch_size": 256, "seed": 0},
                                                 rank, world)
        loss_of(model).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if name in ORDER}
        run = lambda t: comm.allreduce(t, op="avg")     # noqa: E731
        singles = {name: [] for name in ORDER}
        chains = {name: [] for name in ORDER}
        totals = []
        for _ in range(ROUNDS):
            for name in ORDER:
                singles[name].append(profiler.timed(run, grads[name].clone).seconds)
            inputs = [grads[name].clone() for name in ORDER]
            took = torch.zeros(len(ORDER) + 1, dtype=torch.float64)
            dist.barrier()
            first = time.perf_counter()
            for i, t in enumerate(inputs):
                start = time.perf_counter()
                run(t)
                took[i] = time.perf_counter() - start
            took[-1] = time.perf_counter() - first
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            for name, s in zip(ORDER, took.tolist()):
                chains[name].append(s)
            totals.append(took[-1].item())
        if rank == 0:
            emit({"event": "probe", "single_s": singles, "chain_s": chains, "chain_total_s": totals})
    finally:
        comm.close()


def report(e: dict) -> None:
    for name in ORDER:
        s, c = statistics.median(e["single_s"][name]), statistics.median(e["chain_s"][name])
        print(f"{name:16} alone after a barrier {1e3 * s:6.2f} ms, in the chain {1e3 * c:6.2f} ms: {s / c:.2f}x")
    alone = sum(statistics.median(e["single_s"][n]) for n in ORDER)
    chain = statistics.median(e["chain_total_s"])
    print(f"the four: alone {1e3 * alone:.2f} ms summed, the chain {1e3 * chain:.2f} ms: {alone / chain:.2f}x")


if __name__ == "__main__":
    from probe_job import run_probe
    sys.exit(run_probe(report))
