"""Probe: rebuild_beside_training's pieces for vgg's out.weight on 4 workers, each worker's own numbers."""
import time, threading, statistics, os
import torch, torch.distributed as dist
import sparcoll
from sparcoll.plan import profiler as P

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sparcoll.keep_freed_memory()
cfg = {"workload": "vgg", "options": {}, "batch_size": 32, "seed": 0}
model, loss_of = P.model_and_loss(cfg, rank, world)
def train_step():
    model.zero_grad()
    loss_of(model).backward()
alone_step = P.timed(lambda _: train_step())
m, n = 21841, 4096
rows = 32
big_u, big_v, result = torch.randn(rows * world, m), torch.randn(rows * world, n), torch.empty(m, n)
run = lambda _: torch.mm(big_u.t(), big_v, out=result)
alone = P.timed(run)
# under_load, instrumented
times, span, stepts = [], [], []
done = threading.Event()
runs = max(P.LOADED_RUNS, min(P.MOST_LOADED_RUNS, -(-alone_step // max(alone, 1e-6))))
def loop():
    began = time.perf_counter()
    for _ in range(int(runs)):
        s = time.perf_counter(); run(None); times.append(time.perf_counter() - s)
    span[:] = [began, time.perf_counter()]
    done.set()
dist.barrier()
t = threading.Thread(target=loop); t.start()
steps, start = 0, time.perf_counter()
while not done.is_set() or not steps:
    s = time.perf_counter(); train_step(); stepts.append(time.perf_counter() - s); steps += 1
elapsed = time.perf_counter() - start
t.join()
overlap = min(span[1], start + elapsed) - max(span[0], start)
print(f"rank {rank}: alone_step {alone_step:.3f} alone {alone:.3f} runs {runs} loaded {statistics.median(times):.3f} "
      f"steps {[round(x,2) for x in stepts]} elapsed {elapsed:.2f} span {span[1]-span[0]:.2f} overlap {overlap:.2f} "
      f"slowed {P.slowed(overlap, elapsed, steps * alone_step):.2f} (own, not the slowest's)", flush=True)
dist.destroy_process_group()
