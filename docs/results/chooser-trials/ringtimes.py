"""One-off: where a dense 16M sparcoll call's wall time goes on the ring path, 2 ranks, beside gloo's."""
import random, sys, time
import numpy as np, torch, torch.distributed as dist, sparcoll
from sparcoll import ring as R, algorithm as A
dist.init_process_group("gloo")
r = dist.get_rank()
comm = sparcoll.init()
n = 16 << 20
src = torch.randn(n)
ev = {}
def wrap(cls, name, key):
    orig = getattr(cls, name)
    def f(*a, **k):
        s = time.perf_counter(); out = orig(*a, **k); ev.setdefault(key, []).append((s, time.perf_counter())); return out
    setattr(cls, name, f)
wrap(R.Ring, "_allreduce_data", "data_start")
wrap(R.Ring, "_round", "round")
wrap(R.Ring, "_wait", "wait")
wrap(R.Ring, "allreduce", "ring")
wrap(A.Chooser, "learn", "learn")
rows = []
def timed(mode, fn):
    t = src.clone()
    dist.barrier()
    for k in ev: ev[k].clear()
    s = time.perf_counter(); fn(t); e = time.perf_counter()
    if mode == "sparcoll":
        g = lambda k, i: (ev[k][-1][i] - s) * 1e3 if ev.get(k) else float("nan")
        rows.append([(e - s) * 1e3, g("data_start", 0), g("round", 0), g("round", 1), g("wait", 0), g("wait", 1),
                     g("ring", 1), g("learn", 0), g("learn", 1)])
    else:
        rows_g.append((e - s) * 1e3)
rows_g = []
modes = {"gloo": lambda t: dist.all_reduce(t), "sparcoll": lambda t: comm.allreduce(t)}
for i in range(8):
    for m, f in modes.items(): timed(m, f)
rows.clear(); rows_g.clear()
order = random.Random(0)
for rep in range(int(sys.argv[1])):
    for m in order.sample(list(modes), 2): timed(m, modes[m])
a = np.array(rows)
names = ["total", "data started", "round start", "round end", "wait start", "wait end", "ring end", "learn start", "learn end"]
print(f"rank {r}: gloo's own call median {np.median(rows_g):.1f} ms; sparcoll's, medians from the call's start (ms): " +
      ", ".join(f"{k} {np.nanmedian(a[:, i]):.2f}" for i, k in enumerate(names)), flush=True)
st = comm._engine.chooser._kinds
print(f"rank {r} chooser:", {k: (v.block, v.dense, v.chosen, {p.value: [round(x * 1e3, 1) for x in ts] for p, ts in v.times.items()}) for k, v in st.items()}, flush=True)
comm.close(); dist.destroy_process_group()
