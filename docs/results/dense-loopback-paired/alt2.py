"""One-off: as the bench interleaves: each repetition runs gloo's ring and sparcoll's group (dense, then
the same data as COO) in a shuffled order; the dense call timed with and without the COO call."""
import time, sys, random, numpy as np, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo")
r = dist.get_rank(); w = dist.get_world_size()
comm = sparcoll.init()
n = int(sys.argv[1]); with_coo = sys.argv[2] == "coo"
src = torch.randn(n)
coo_src = src.view(-1, 256).to_sparse(1) if with_coo else None
def timed(fn):
    dist.barrier(); s = time.perf_counter(); fn(); e = torch.tensor([time.perf_counter() - s], dtype=torch.float64)
    dist.all_reduce(e, op=dist.ReduceOp.MAX); return e.item()
res = {"gloo": [], "sparcoll": [], "coo": []}
def ring():
    t = src.clone(); res["gloo"].append(timed(lambda: dist.all_reduce(t)))
def sc():
    t = src.clone(); res["sparcoll"].append(timed(lambda: comm.allreduce(t)))
    if with_coo:
        c = coo_src.clone(); res["coo"].append(timed(lambda: comm.allreduce_coo(c)))
for i in range(6): sc(); ring()
for k in res: res[k].clear()
order = random.Random(0)
for rep in range(30):
    for f in order.sample([ring, sc], 2): f()
if r == 0:
    for k, v in res.items():
        if v:
            v = np.array(v) * 1e3
            print(w, n, "coo" if with_coo else "nocoo", k, "median %.1f p10 %.1f p90 %.1f" % (np.median(v), np.percentile(v, 10), np.percentile(v, 90)))
comm.close(); dist.destroy_process_group()
