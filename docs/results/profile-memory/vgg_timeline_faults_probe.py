"""Probe: the profile's backward timeline on vgg, 4 workers together (each iteration after a barrier,
as Together starts them): per iteration and worker, page faults in backward and how long the first
hidden layer's weight gradient took after the layer before it. The model's first gradients are held,
as profile_model holds them while its timeline runs."""
import resource, sys, time
import torch, torch.distributed as dist
import sparcoll
from sparcoll.plan import profiler as P

sparcoll.keep_freed_memory()      # first, as the profile's workers do: before gloo's threads
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, loss_of = P.model_and_loss({"workload": "vgg", "options": {}, "batch_size": 32, "seed": 0}, rank, world)
model.zero_grad(); loss_of(model).backward()
held = {n: p.grad.detach() for n, p in model.named_parameters()}
model.zero_grad()
params = dict(model.named_parameters())
seen = {}
for name in ("hidden.1.weight", "hidden.0.weight"):
    params[name].register_post_accumulate_grad_hook(lambda p, name=name: seen.__setitem__(name, time.perf_counter()))
opt = torch.optim.SGD(model.parameters(), lr=0.0)
if len(sys.argv) > 2:       # pre-grow the heap: that many blocks of the largest gradient, written, then freed
    blocks = [torch.ones(max(p.numel() for p in model.parameters())) for _ in range(int(sys.argv[2]))]
    del blocks
rows = []
for i in range(int(sys.argv[1])):
    opt.zero_grad()
    dist.barrier()
    loss = loss_of(model)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    loss.backward()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    opt.step()
    rss = int(open("/proc/self/statm").read().split()[1]) * 4 / 1024
    rows.append([1e3 * (seen["hidden.0.weight"] - seen["hidden.1.weight"]), faults * 4 / 1024, rss])
table = torch.tensor(rows)
every = [torch.zeros_like(table) for _ in range(world)]
dist.all_gather(every, table)
if rank == 0:
    for i in range(len(rows)):
        print(f"iteration {i}: hidden.0 after hidden.1, ms / MB faulted in backward / RSS MB after the step, per worker:",
              "  ".join(f"{int(t[i, 0])}/{int(t[i, 1])}/{int(t[i, 2])}" for t in every), flush=True)
dist.destroy_process_group()
