"""One-off: gloo's default group, a second gloo group made as sparcoll's ring makes its own, and sparcoll's call."""
import time, sys, random, numpy as np, torch, torch.distributed as dist, sparcoll
from datetime import timedelta
dist.init_process_group("gloo")
r = dist.get_rank(); w = dist.get_world_size()
comm = sparcoll.init()
n = int(sys.argv[1])
opts = dist.ProcessGroupGloo._Options(); opts._timeout = timedelta(seconds=60)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
store = dist.distributed_c10d._get_default_store()
g2 = dist.ProcessGroupGloo(dist.PrefixStore("exp2", store), r, w, opts)
src = torch.randn(n)
def timed(fn):
    dist.barrier(); s = time.perf_counter(); fn(); e = torch.tensor([time.perf_counter() - s], dtype=torch.float64)
    dist.all_reduce(e, op=dist.ReduceOp.MAX); return e.item()
res = {"gloo": [], "group2": []}
def ring():
    t = src.clone(); res["gloo"].append(timed(lambda: dist.all_reduce(t)))
def two():
    t = src.clone(); res["group2"].append(timed(lambda: g2.allreduce([t]).wait()))
def sc():
    t = src.clone(); res["sparcoll"].append(timed(lambda: comm.allreduce(t)))
fns = [ring, two]
for i in range(20):
    for f in fns: f()
for k in res: res[k].clear()
order = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 40):
    for f in order.sample(fns, 2): f()
if r == 0:
    g = np.array(res["gloo"])
    for k, v in res.items():
        v = np.array(v)
        print(k, "median %.1f ms p10 %.1f p90 %.1f  paired gloo/this median %.3f" % (np.median(v)*1e3, np.percentile(v, 10)*1e3, np.percentile(v, 90)*1e3, np.median(g / v)))
comm.close(); dist.destroy_process_group()
