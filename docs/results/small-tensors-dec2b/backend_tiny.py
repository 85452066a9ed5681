import os, time, statistics, torch, torch.distributed as dist
import sparcoll.torch  # noqa
dist.init_process_group("sparcoll"); rank = dist.get_rank()
g = dist.new_group(backend="gloo")
numel = int(os.environ.get("NUMEL", "1"))
t = torch.ones(numel)
from sparcoll.torch.backend import _backend_of
comm = _backend_of(dist.distributed_c10d._get_default_group()).comm
res = {"sparcoll": [], "gloo": [], "comm": []}
for _ in range(50):
    dist.all_reduce(t); dist.all_reduce(t, group=g)
for _ in range(30):
    for name, call in (("sparcoll", lambda: dist.all_reduce(t)), ("gloo", lambda: dist.all_reduce(t, group=g)), ("comm", lambda: comm.allreduce(t))):
        call()
        for _ in range(10):
            s = time.perf_counter(); call(); res[name].append(time.perf_counter() - s)
if rank == 0:
    m = {k: statistics.median(v) * 1e6 for k, v in res.items()}
    mean = {k: statistics.mean(v) * 1e6 for k, v in res.items()}
    print(f"numel {numel}: backend median {m['sparcoll']:.0f} us mean {mean['sparcoll']:.0f}; gloo median {m['gloo']:.0f} mean {mean['gloo']:.0f}; ratio {m['sparcoll']/m['gloo']:.2f}; comm API median {m['comm']:.0f}", flush=True)
dist.destroy_process_group()
