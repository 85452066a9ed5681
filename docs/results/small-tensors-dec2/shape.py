import statistics, time, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
t = torch.ones(1)
for _ in range(50): comm.allreduce(t)
def run(every):
    out = []
    w0 = time.perf_counter()
    for i in range(600):
        if every and i % every == 0: comm.allreduce(t)
        s = time.perf_counter(); comm.allreduce(t); out.append(time.perf_counter() - s)
    q = statistics.quantiles(out, n=10)
    return f"every {every}: median {statistics.median(out)*1e6:.0f} mean {statistics.mean(out)*1e6:.0f} p10 {q[0]*1e6:.0f} p90 {q[-1]*1e6:.0f}"
res = [run(0), run(10), run(0), run(10)]
if rank == 0: print(" | ".join(res), flush=True)
comm.close(); dist.destroy_process_group()
