"""One-off: a round through every rank connected to every other (each sends its fields to all) against a round
through rank 0 (the star) and gloo's allreduce of one float, 600 of each interleaved, the first 50 dropped.
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node N docs/results/small-star/mesh_alone.py"""
import socket, time, numpy as np, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank(); w = dist.get_world_size()
store = dist.distributed_c10d._get_default_store()
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(8)
store.set(f"p{r}", str(ls.getsockname()[1]))
peers = {}
for q in range(w):
    if q < r:
        c = socket.create_connection(("127.0.0.1", int(store.get(f"p{q}")))); c.sendall(bytes([r])); peers[q] = c
for _ in range(w - 1 - r):
    c, _a = ls.accept(); q = c.recv(1)[0]; peers[q] = c
for c in peers.values(): c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
N = 13 * 8 + 8
buf = np.zeros(N // 8); inb = {q: bytearray(N) for q in peers}
def recv_exact(c, b):
    mv = memoryview(b); got = 0
    while got < len(b):
        got += c.recv_into(mv[got:])
def mesh():
    for q, c in peers.items(): c.sendall(buf)
    for q, c in peers.items(): recv_exact(c, inb[q])
def star():
    if r == 0:
        for q in range(1, w): recv_exact(peers[q], inb[q])
        for q in range(1, w): peers[q].sendall(buf.tobytes() * w)
    else:
        peers[0].sendall(buf); b = bytearray(N * w); recv_exact(peers[0], b)
t1 = torch.zeros(1)
res = {"mesh": [], "star": [], "gloo1": []}
for it in range(600):
    for k in res:
        s = time.perf_counter()
        if k == "mesh": mesh()
        elif k == "star": star()
        else: dist.all_reduce(t1)
        res[k].append(time.perf_counter() - s)
if r == 0:
    for k, v in res.items():
        v = np.array(v[50:]) * 1e6
        print(w, k, "median %.0f p90 %.0f mean %.0f" % (np.median(v), np.percentile(v, 90), v.mean()))
