"""One-off: how far apart the planner's backward timeline reads from one window to the next within one
job, by window length. 4 workers of ncf on this host (torchrun, gloo, no emulated links: the timeline
only meets at barriers), the profile's settings (batch 256, seed 0). Each round times a reference of the
machine's speed, then timelines of 1 s, 1 s, 1 s and 3 s in turn, as profiler.profile_model calls
backward_timeline (peers Together). Rank 0 prints one line per window.
Run: GLIBC_TUNABLES=glibc.malloc.tcache_count=0 OMP_NUM_THREADS=1 PYTHONPATH=src \
  timeout 900 .venv/bin/torchrun --standalone --nproc-per-node 4 docs/results/timeline-windows/windows.py ROUNDS"""
import sys

import torch.distributed as dist

import sparcoll
from sparcoll.bench.speed import reference_cpu_s
from sparcoll.plan.profile import backward_timeline
from sparcoll.plan.profiler import Together, model_and_loss

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
dist.init_process_group("gloo")
sparcoll.keep_freed_memory()
rank, world = dist.get_rank(), dist.get_world_size()
model, loss_of = model_and_loss({"workload": "ncf", "seed": 0, "options": {}, "batch_size": 256}, rank, world)
if rank == 0:
    print("round window_s reference_ms forward_ms backward_end_ms optimizer_ms total_ms", flush=True)
for r in range(rounds):
    for seconds in (1.0, 1.0, 1.0, 3.0):
        reference = reference_cpu_s()
        t = backward_timeline(model, loss_of, iterations=5, peers=Together(), seconds=seconds)
        if rank == 0:
            s = t.step
            print(f"{r} {seconds:.0f} {reference * 1e3:.2f} {t.forward * 1e3:.2f} {s.backward_end * 1e3:.2f} "
                  f"{s.optimizer * 1e3:.2f} {(t.forward + s.backward_end + s.optimizer) * 1e3:.2f}", flush=True)
dist.destroy_process_group()
