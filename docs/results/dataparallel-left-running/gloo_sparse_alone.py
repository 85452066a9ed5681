# One-off: gloo's sparse all_reduce of deeplight's two embedding gradients (sparse embeddings, batch 256)
# among 4 ranks on loopback, and the Python around it. OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone
# --nproc-per-node 4 docs/results/dataparallel-left-running/gloo_sparse_alone.py
import time, statistics, torch, torch.distributed as dist
from sparcoll.compress.channel import Channel
from sparcoll.workloads import get_workload
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
w = get_workload("deeplight", data=None, seed=0, sparse_embeddings=True)
b = w.batches(256, rank, world, 0)
m = w.model
m.zero_grad(); w.loss(m, next(b)).backward()
grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad.is_sparse}
ch = Channel(None)
def ddp_like(g):
    t = g.clone(); dist.all_reduce(t); return t
def med(f, n=20):
    ts = []
    for _ in range(n):
        dist.barrier(); s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    t = torch.tensor([statistics.median(ts)]); dist.all_reduce(t, op=dist.ReduceOp.MAX); return t.item() * 1e3
for name, g in grads.items():
    r = {}
    for label, f in [("sparse_mean", lambda: ch.sparse_mean(g.coalesce())), ("all_reduce only", lambda: ddp_like(g)),
                     ("coalesce", lambda: g.coalesce()), ("div", lambda: g / world),
                     ("allreduce+coalesce", lambda: ddp_like(g).coalesce())]:
        r[label] = med(f)
    out = ddp_like(g)
    if rank == 0:
        print(name, tuple(g.shape), "nnz", g._nnz(), "coalesced", g.is_coalesced(), "result nnz", out._nnz(), "result coalesced", out.is_coalesced(),
              " ".join(f"{k} {v:.2f}ms" for k, v in r.items()), flush=True)
dist.destroy_process_group()
