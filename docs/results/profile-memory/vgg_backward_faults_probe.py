"""Probe: in one process training vgg (keep_freed_memory, set_to_none zero_grad as the profile's
timeline), per iteration: page faults during backward, and how long the first hidden layer's weight
gradient took after the layer before it."""
import resource, sys, time
import torch
import sparcoll
from sparcoll.plan import profiler as P

sparcoll.keep_freed_memory()
model, loss_of = P.model_and_loss({"workload": "vgg", "options": {}, "batch_size": 32, "seed": 0}, 0, 4)
params = dict(model.named_parameters())
seen = {}
for name in ("hidden.1.weight", "hidden.0.weight"):
    params[name].register_post_accumulate_grad_hook(lambda p, name=name: seen.__setitem__(name, time.perf_counter()))
opt = torch.optim.SGD(model.parameters(), lr=0.0)
for i in range(int(sys.argv[1])):
    opt.zero_grad()
    loss = loss_of(model)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    opt.step()
    print(f"iteration {i}: backward {1e3 * (end - start):.0f} ms, hidden.0 after hidden.1 "
          f"{1e3 * (seen['hidden.0.weight'] - seen['hidden.1.weight']):.0f} ms, faulted in backward {faults * 4 / 1024:.0f} MB", flush=True)
