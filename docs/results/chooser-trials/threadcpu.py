"""One-off: per-thread CPU of a dense 16M allreduce, gloo's ring against sparcoll's (auto), 2 ranks."""
import collections, os, random, sys, threading, time
import numpy as np, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo")
r = dist.get_rank()
comm = sparcoll.init()
n = 16 << 20
src = torch.randn(n)
TICK = os.sysconf("SC_CLK_TCK")
def snap():
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm_name = f.read().strip()
        except FileNotFoundError:
            continue
        name = names.get(int(tid), comm_name)
        out[tid] = (name, int(parts[11]) + int(parts[12]))
    return out
cpu = {"gloo": collections.Counter(), "sparcoll": collections.Counter()}
wall = {"gloo": [], "sparcoll": []}
def timed(mode, fn):
    t = src.clone()
    dist.barrier()
    a = snap(); s = time.perf_counter(); fn(t); e = time.perf_counter() - s
    b = snap()
    for tid, (name, v) in b.items():
        cpu[mode][name] += v - a.get(tid, (name, v))[1]
    x = torch.tensor([e], dtype=torch.float64); dist.all_reduce(x, op=dist.ReduceOp.MAX); wall[mode].append(x.item())
modes = {"gloo": lambda t: dist.all_reduce(t), "sparcoll": lambda t: comm.allreduce(t)}
for i in range(8):
    for m, f in modes.items(): timed(m, f)
for m in cpu: cpu[m].clear(); wall[m].clear()
order = random.Random(0)
calls = int(sys.argv[1]) if len(sys.argv) > 1 else 60
for rep in range(calls):
    for m in order.sample(list(modes), 2): timed(m, modes[m])
if r == 0:
    for m in modes:
        print(m, "median ms %.1f" % (np.median(wall[m]) * 1e3), "CPU ms per call by thread (rank 0):",
              ", ".join(f"{k} {1e3 * v / TICK / calls:.1f}" for k, v in cpu[m].most_common() if v))
comm.close(); dist.destroy_process_group()
