import cProfile, pstats, io, sys, time, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
t = torch.ones(1)
for _ in range(50): comm.allreduce(t)
pr = cProfile.Profile()
if rank == 0: pr.enable()
for _ in range(1000): comm.allreduce(t)
if rank == 0:
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue()[:6000])
comm.close(); dist.destroy_process_group()
