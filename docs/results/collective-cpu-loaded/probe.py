"""How much CPU a collective's threads spend beside training, against alone (what the profile prices,
`profiler.timed`)? ncf's four embedding gradients (dense, from one backward) under the sparse AllReduce
one after another, 4 workers: their CPU alone (the process's, the workers' mean), and on a second thread
while the training thread steps forward and backward back to back (the process's CPU less the training
thread's, over the collectives' span, read from the collectives' thread), in alternating rounds.
Run: PYTHONPATH=src:benchmarks:docs/results/collective-cpu-loaded .venv/bin/python docs/results/collective-cpu-loaded/probe.py"""
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

NAMES = ("item_mlp.weight", "user_mlp.weight", "item_gmf.weight", "user_gmf.weight")
ROUNDS, RUNS = 6, 8


def body(cfg: dict, rank: int, world: int) -> None:
    import sparcoll
    from sparcoll.bench.events import emit
    from sparcoll.plan import profiler
    comm = sparcoll.init(timeout=cfg["timeout"])
    try:
        model, loss_of = profiler.model_and_loss(cfg, rank, world)
        model.zero_grad()
        loss_of(model).backward()
        params = dict(model.named_parameters())
        grads = [params[n].grad.detach().clone() for n in NAMES]
        train = profiler.training_step(model, loss_of)

        def chain(_=None) -> None:
            for g in grads:
                comm.allreduce(g.clone(), op="avg")
        alone, loaded = [], []
        for _ in range(ROUNDS):
            alone.append(profiler.timed(chain).cpu)
            trainer = time.pthread_getcpuclockid(threading.get_ident())
            span, done = [], threading.Event()

            def loop() -> None:
                cpu, own = time.process_time(), time.clock_gettime(trainer)
                for _ in range(RUNS):
                    chain()
                span.append(((time.process_time() - cpu) - (time.clock_gettime(trainer) - own)) / RUNS)
                done.set()
            dist.barrier()
            thread = threading.Thread(target=loop, daemon=True)
            thread.start()
            while not done.is_set():
                train()
            thread.join(60)
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, torch.tensor(span, dtype=torch.float64))
            loaded.append(torch.cat(every).mean().item())
        if rank == 0:
            emit({"event": "probe", "alone_cpu_s": alone, "loaded_cpu_s": loaded})
    finally:
        comm.close()


def report(e: dict) -> None:
    a, b = statistics.median(e["alone_cpu_s"]), statistics.median(e["loaded_cpu_s"])
    print(f"the four collectives' CPU a worker: alone {1e3 * a:.2f} ms, beside training {1e3 * b:.2f} ms "
          f"({b / a:.2f}x; medians of {len(e['alone_cpu_s'])} rounds)")


if __name__ == "__main__":
    from probe_job import run_probe
    sys.exit(run_probe(report, {"workload": "ncf", "seed": 0, "options": {}, "batch_size": 256}))
