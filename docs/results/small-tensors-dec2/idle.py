import time, resource, torch, torch.distributed as dist, sparcoll, threading
dist.init_process_group("gloo"); comm = sparcoll.init(); rank = dist.get_rank()
t = torch.ones(1)
for _ in range(50): comm.allreduce(t)
dist.barrier()
c0 = time.process_time(); time.sleep(5); idle = time.process_time() - c0
c0 = time.process_time(); w0 = time.perf_counter()
for _ in range(2000): comm.allreduce(t)
busy, wall = time.process_time() - c0, time.perf_counter() - w0
print(f"rank {rank}: idle CPU {idle*1e3:.1f} ms in 5 s; 2000 calls: {wall/2000*1e6:.0f} us wall, {busy/2000*1e6:.0f} us CPU a call; threads {threading.active_count()}", flush=True)
comm.close(); dist.destroy_process_group()
