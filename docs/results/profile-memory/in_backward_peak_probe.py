"""Probe: peak RSS of compress_in_backward on vgg with the model's first gradients held (as the profile
held them before) or dropped."""
import resource, sys
import torch, torch.distributed as dist
import sparcoll
from sparcoll.plan import profiler as P
from sparcoll.plan.command import BATCH_SIZES

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sparcoll.keep_freed_memory()
model, loss_of = P.model_and_loss({"workload": "vgg", "options": {}, "batch_size": BATCH_SIZES["vgg"], "seed": 0}, rank, world)
model.zero_grad(); loss_of(model).backward()
names = [n for n, p in model.named_parameters() if p.numel() >= P.OWN_GRADIENT and not p.grad.is_sparse]
grads = {n: p.grad.detach() for n, p in model.named_parameters() if n in names}
model.zero_grad()
if sys.argv[1] == "drop":
    grads = {}
for _ in P.compress_in_backward(sys.argv[2].split(","), world, model, loss_of, names, 600):
    pass
peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
dist.all_reduce(peak, op=dist.ReduceOp.MAX)
if rank == 0:
    print(sys.argv[1], "peak RSS MB of the workers:", round(peak.item()), flush=True)
dist.destroy_process_group()
