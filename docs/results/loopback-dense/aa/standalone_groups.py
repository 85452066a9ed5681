import os, statistics, sys, time, random, torch, torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
import sparcoll
dist.init_process_group("gloo")
rank = dist.get_rank()
n = int(sys.argv[1]); reps = int(sys.argv[2])
comm = sparcoll.init(algorithm="ring")
ring = comm._engine.ring
src = torch.randn(n)
names = ["gloo", "defaultdirect", "datagroup", "sparcoll"]
bufs = {k: src.clone() for k in names}
# check, c and s: the earlier version's "concurrent" and "serial" candidates (standalone.txt);
# the version as it is now does not call them.
def check():
    return ring.check_group.allgather([ring._gathered_rows], [ring._check], AllgatherOptions())
def g(): dist.all_reduce(bufs["gloo"])
def d(): ring.data_group.allreduce([bufs["datagroup"]]).wait()
def c():
    w = ring.data_group.allreduce([bufs["concurrent"]]); k = check(); k.wait(); w.wait()
def s():
    ring.data_group.allreduce([bufs["serial"]]).wait(); check().wait()
def sp(): comm.allreduce(bufs["sparcoll"])
pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
def dd(): pg.allreduce([bufs["defaultdirect"]]).wait()
cands = dict(zip(names, [g, dd, d, sp]))
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
    print(n, reps, " ".join(f"{k} {m[k]:.2f}" for k in m))
comm.close(); dist.destroy_process_group()
