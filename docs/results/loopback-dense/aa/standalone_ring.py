import statistics, sys, time, random, torch, torch.distributed as dist
from datetime import timedelta
import sparcoll
dist.init_process_group("gloo")
rank = dist.get_rank()
n = int(sys.argv[1]); reps = int(sys.argv[2])
import os; comm = sparcoll.init(algorithm=os.environ.get("ALGO", "ring"))
ring = comm._engine.ring
src = torch.randn(n)
bufs = {k: src.clone() for k in ("gloo", "datagroup", "sparcoll")}
def g(): dist.all_reduce(bufs["gloo"])
def d(): ring.data_group.allreduce([bufs["datagroup"]]).wait()
def s(): comm.allreduce(bufs["sparcoll"])
cands = {"gloo": g, "datagroup": d, "sparcoll": s}
for _ in range(5):
    for f in cands.values(): f()
res = {k: [] for k in cands}
rng = random.Random(1)
for i in range(reps):
    order = list(cands); rng.shuffle(order)
    for k in order:
        bufs[k].copy_(src); dist.barrier()
        a = time.perf_counter(); cands[k](); el = torch.tensor([time.perf_counter() - a]); dist.all_reduce(el, op=dist.ReduceOp.MAX)
        res[k].append(el.item())
if rank == 0:
    m = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    print(n, reps, " ".join(f"{k} {m[k]:.2f}ms" for k in m), "ratio gloo/sparcoll %.3f gloo/datagroup %.3f" % (m["gloo"] / m["sparcoll"], m["gloo"] / m["datagroup"]))
comm.close(); dist.destroy_process_group()
