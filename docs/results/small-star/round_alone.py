"""One-off: a round of our own sockets (every rank's 1,034-float64 buffer to rank 0, every rank's back)
against gloo's allreduce of one float and its allgather of that buffer, interleaved, 600 of each (the
first 50 dropped). Rank 0 prints median / p90 / mean us.
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node N docs/results/small-star/round_alone.py"""
import os, socket, time, struct, sys
import numpy as np, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank(); w = dist.get_world_size()
store = dist.distributed_c10d._get_default_store()
# mesh for 2 ranks
if r == 0:
    ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(4)
    store.set("port", str(ls.getsockname()[1]))
    conns = [ls.accept()[0] for _ in range(w - 1)]
else:
    port = int(store.get("port"))
    c = socket.create_connection(("127.0.0.1", port)); conns = [c]
for c in conns:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
N = 1034 * 8
buf = np.zeros(1034, np.float64)
def recv_exact(c, n, out):
    mv = memoryview(out).cast("B"); got = 0
    while got < n:
        k = c.recv_into(mv[got:], n - got)
        if not k: raise EOFError
        got += k
other = np.zeros((w, 1034), np.float64)
def sock_round():
    if r == 0:
        other[0] = buf
        for i, c in enumerate(conns): recv_exact(c, N, other[i + 1])
        s = other.tobytes()
        for c in conns: c.sendall(s)
    else:
        conns[0].sendall(buf.tobytes())
        recv_exact(conns[0], N * w, other)
t1 = torch.zeros(1); tb = torch.zeros(1034, dtype=torch.float64)
outs = [torch.zeros(1034, dtype=torch.float64) for _ in range(w)]
res = {"sock": [], "gloo1": [], "gloo_ag": []}
for it in range(600):
    for k in res:
        dist.barrier() if it % 50 == 0 else None
        t = time.perf_counter()
        if k == "sock": sock_round()
        elif k == "gloo1": dist.all_reduce(t1)
        else: dist.all_gather(outs, tb)
        res[k].append(time.perf_counter() - t)
if r == 0:
    for k, v in res.items():
        v = np.array(v[50:]) * 1e6
        print(w, k, "median %.0f p90 %.0f mean %.0f" % (np.median(v), np.percentile(v, 90), v.mean()))
dist.destroy_process_group()
