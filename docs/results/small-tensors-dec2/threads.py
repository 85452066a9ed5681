import os, time, threading, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
t = torch.ones(1)
for _ in range(50): comm.allreduce(t)
tick = os.sysconf("SC_CLK_TCK")
def cpu():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(f[11]) + int(f[12])) / tick
        except OSError: pass
    return out
names = {th.native_id: th.name for th in threading.enumerate()}
dist.barrier(); a = cpu()
for _ in range(3000): comm.allreduce(t)
b = cpu()
names = {th.native_id: th.name for th in threading.enumerate()}
d = sorted(((b[k] - a.get(k, 0)) / 3000 * 1e6, names.get(k, "native"), k) for k in b)
if rank in (0, 1):
    print(f"rank {rank}: " + ", ".join(f"{n}:{v:.0f}us" for v, n, k in reversed(d) if v > 0.5), flush=True)
comm.close(); dist.destroy_process_group()
