import os, time, threading, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
numel = int(os.environ.get("NUMEL", "1")); B = 16; N = int(os.environ.get("BATCHES", "200"))
ts = [torch.ones(numel) for _ in range(B)]
def batch():
    ws = [comm.allreduce(t, async_op=True) for t in ts]
    for w in ws: w.wait()
for _ in range(20): batch()
tick = os.sysconf("SC_CLK_TCK")
def cpu():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(f[11]) + int(f[12])) / tick
        except OSError: pass
    return out
dist.barrier(); a = cpu(); w0 = time.perf_counter()
for _ in range(N): batch()
w1 = time.perf_counter(); b = cpu()
names = {th.native_id: th.name for th in threading.enumerate()}
d = sorted(((b[k] - a.get(k, 0)) / (N * B) * 1e6, names.get(k, "native"), k) for k in b)
gw0 = time.perf_counter()
for _ in range(N):
    ws = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in ws: w.wait()
gw1 = time.perf_counter()
if rank in (0, 1):
    print(f"rank {rank}: sparcoll {(w1-w0)/(N*B)*1e6:.0f} us/call, gloo {(gw1-gw0)/(N*B)*1e6:.0f}; cpu " + ", ".join(f"{n}:{v:.0f}us" for v, n, k in reversed(d) if v > 0.5), flush=True)
comm.close(); dist.destroy_process_group()
