"""Stress: sparse COO all_reduce on the sparcoll backend, 2 ranks, many times; count wrong sums."""
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.multiprocessing as mp

N = int(os.environ.get("N", "3000"))   # calls per rank, at most 120 s

def run(rank, world, port, q):
    torch.set_num_threads(1)
    import sparcoll.torch  # noqa
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("sparcoll", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    wrong = 0
    start = time.monotonic()
    for i in range(N):
        s = torch.sparse_coo_tensor([[rank, 2]], [1.0, 2.0], (4,))
        dist.all_reduce(s)
        if s.to_dense().tolist() != [1.0, 1.0, 4.0, 0.0]:
            wrong += 1
        if time.monotonic() - start > 120:
            break
    q.put((rank, wrong, i + 1))
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=run, args=(r, 2, port, q)) for r in range(2)]
    for p in ps: p.start()
    for p in ps: p.join(200)
    for p in ps:
        if p.is_alive(): p.kill()
    while not q.empty(): print(q.get())
