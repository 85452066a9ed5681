"""Probe: page faults per step of compress_in_backward (gpt, 4 workers), as the profile runs it after
release_freed_memory: is the timed steps' memory settled after one untimed step?"""
import resource
import torch, torch.distributed as dist
import sparcoll
from sparcoll.plan import profiler as P

dist.init_process_group("gloo")
rank = dist.get_rank()
sparcoll.keep_freed_memory()
model, loss_of = P.model_and_loss({"workload": "gpt", "options": {}, "batch_size": 1, "seed": 0}, rank, 4)
model.zero_grad(); loss_of(model).backward()
names = [n for n, p in model.named_parameters() if p.numel() >= P.OWN_GRADIENT and not p.grad.is_sparse]
grads = {n: p.grad.detach() for n, p in model.named_parameters() if n in names}
model.zero_grad()
marks = []
def counted(m):
    marks.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    return loss_of(m)
for spec, name, seconds in P.compress_in_backward(["efsignsgd", "blocktopk:0.01"], 4, model, counted, names, 60):
    pass
marks.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
if rank == 0:
    steps = [round((b - a) * 4 / 1024, 1) for a, b in zip(marks, marks[1:])]
    print("MB faulted per step (efsignsgd x4, then blocktopk x4; the first of each untimed):", steps, flush=True)
dist.destroy_process_group()
