"""gloo all_reduce of N floats on W local ranks (loopback), CALLS times: each call's time and rank 0's CPU.
From the project root: .venv/bin/python docs/results/plan-d59adbf-fresh/gloo_small.py W N CALLS"""
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, world, port, n, calls):
    os.environ["OMP_NUM_THREADS"] = "1"; torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    x = torch.randn(n)
    for _ in range(20): dist.all_reduce(x)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls): dist.all_reduce(x)
    t1, c1 = time.perf_counter(), time.process_time()
    if rank == 0:
        print(f"world {world} n {n}: {1e3*(t1-t0)/calls:.3f} ms/call, cpu {1e3*(c1-c0)/calls:.3f} ms/call (rank 0)")
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    world, n, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.start_processes(run, args=(world, port, n, calls), nprocs=world, start_method="spawn", join=True)
