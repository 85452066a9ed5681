import os, sys, time, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
numel = int(os.environ.get("NUMEL", "1")); n = int(os.environ.get("CALLS", "3000"))
t = torch.ones(numel)
for _ in range(100): comm.allreduce(t)
dist.barrier()
import resource
r0 = resource.getrusage(resource.RUSAGE_THREAD)
w0, p0, th0 = time.perf_counter(), time.process_time(), time.thread_time()
for _ in range(n): comm.allreduce(t)
w1, p1, th1 = time.perf_counter(), time.process_time(), time.thread_time()
r1 = resource.getrusage(resource.RUSAGE_THREAD)
res = torch.tensor([(w1 - w0) / n * 1e6, (p1 - p0) / n * 1e6, (r1.ru_utime - r0.ru_utime) / n * 1e6, (r1.ru_stime - r0.ru_stime) / n * 1e6])
out = [torch.zeros(4) for _ in range(dist.get_world_size())]
dist.all_gather(out, res)
if rank == 0:
    print(os.environ.get("LABEL", ""), "wall %.0f" % out[0][0], " proc cpu/thread user/thread sys per rank: " +
          " ".join("%.0f/u%.0f/s%.0f" % (o[1], o[2], o[3]) for o in out), flush=True)
comm.close(); dist.destroy_process_group()
