"""Probe: vgg's first backward timeline on 4 workers (as the profile takes it) with the warm-up as given
(argv[1]: "1" = a single warm-up iteration, the old way; "settle" = until the pages settle), then 2 more."""
import resource, sys
import torch, torch.distributed as dist
import sparcoll
from sparcoll.plan import profiler as P
from sparcoll.plan import profile as prof

dist.init_process_group("gloo")
rank = dist.get_rank()
sparcoll.keep_freed_memory()
if sys.argv[1] == "1":
    prof.MOST_WARMUP = 1
model, loss_of = P.model_and_loss({"workload": "vgg", "options": {}, "batch_size": 32, "seed": 0}, rank, 4)
model.zero_grad(); loss_of(model).backward()
grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}   # as the profiler keeps them
model.zero_grad()
for rep in range(3):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = prof.backward_timeline(model, loss_of, iterations=5, peers=P.Together())
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if rank == 0:
        node0 = dict(zip(t.order, t.step.ready))['hidden.0.weight'] - t.output_gradient['hidden.0.weight']
        print(f"warm-up {sys.argv[1]} rep {rep}: backward_end {t.step.backward_end:.3f} forward {t.forward:.3f} "
              f"hidden.0 node {node0:.3f} faults in the call {(f1 - f0) * 4 / 1024:.0f} MB", flush=True)
dist.destroy_process_group()
