"""One-off: gloo's ring on the default group against the candidates named in argv[3] (comma-separated:
group2, a second gloo group made as sparcoll's ring makes its own; sparcoll, its call; ringdirect,
sparcoll's Ring.allreduce called without the communicator), each repetition in a shuffled order,
timed from a barrier to the slowest rank's end; "gc" in argv[4] reports Python's collections."""
import gc, time, sys, random, numpy as np, torch, torch.distributed as dist, sparcoll
from datetime import timedelta
collections = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
began = [0.0]


def count(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        collections[info["generation"]][0] += 1
        collections[info["generation"]][1] += time.perf_counter() - began[0]


if len(sys.argv) > 4 and sys.argv[4] == "gc":
    gc.callbacks.append(count)
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
comm = sparcoll.init()
n, seed, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3].split(":")[1]) if ":" in sys.argv[3] else 40
names = ["gloo"] + [c for c in sys.argv[3].split(":")[0].split(",") if c]
opts = dist.ProcessGroupGloo._Options()
opts._timeout = timedelta(seconds=60)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
g2 = dist.ProcessGroupGloo(dist.PrefixStore("exp2", dist.distributed_c10d._get_default_store()), r, w, opts)
ids = iter(range(10**6, 10**7))
src = torch.randn(n)
calls = {"gloo": lambda t: dist.all_reduce(t), "group2": lambda t: g2.allreduce([t]).wait(),
         "sparcoll": lambda t: comm.allreduce(t),
         "ringdirect": lambda t: comm._engine.ring.allreduce(next(ids), t, 0, 60.0, lambda: None)}
res = {k: [] for k in names}


def timed(name):
    t = src.clone()
    dist.barrier()
    s = time.perf_counter()
    calls[name](t)
    e = torch.tensor([time.perf_counter() - s], dtype=torch.float64)
    dist.all_reduce(e, op=dist.ReduceOp.MAX)
    res[name].append(e.item())


for _ in range(20):
    for name in names:
        timed(name)
for k in res:
    res[k].clear()
order = random.Random(seed)
for _ in range(reps):
    for name in order.sample(names, len(names)):
        timed(name)
if r == 0:
    g = np.array(res["gloo"])
    for k, v in res.items():
        v = np.array(v)
        print(k, "median %.1f ms p10 %.1f p90 %.1f  paired gloo/this median %.3f" % (
            np.median(v) * 1e3, np.percentile(v, 10) * 1e3, np.percentile(v, 90) * 1e3, np.median(g / v)))
    if gc.callbacks:
        print("GC", {k: (c, round(s * 1e3, 1)) for k, (c, s) in collections.items()})
comm.close()
dist.destroy_process_group()
