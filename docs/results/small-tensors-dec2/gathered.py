import os, statistics, time, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
for numel in (4096, 16384):
    t = torch.randn(numel); times = []
    for i in range(400):
        dist.barrier() if i % 10 == 0 else None
        s = time.perf_counter(); comm.allreduce(t); times.append(time.perf_counter() - s)
    st = comm.stats
    if rank == 0:
        print(numel, f"median {statistics.median(times[50:])*1e6:.0f} us", "gathered", st.ring_gathered, "checked_first", st.ring_checked_first, "ring", st.ring_collectives, flush=True)
comm.close(); dist.destroy_process_group()
