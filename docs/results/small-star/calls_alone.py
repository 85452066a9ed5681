"""One-off: sparcoll's allreduce (auto) of NUMEL floats against gloo's, not interleaved: 400 calls of each,
twice, the first 50 of each batch dropped; with a second argument rank 0 then profiles 300 sparcoll calls.
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node N docs/results/small-star/calls_alone.py NUMEL [prof]"""
import time, sys, numpy as np, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo")
r = dist.get_rank()
comm = sparcoll.init(algorithm="auto")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
t = torch.randn(n)
res = {}
for name, fn in [("gloo", lambda: dist.all_reduce(t)), ("sparcoll", lambda: comm.allreduce(t))] * 2:
    dist.barrier()
    ts = []
    for i in range(400):
        s = time.perf_counter(); fn(); ts.append(time.perf_counter() - s)
    res.setdefault(name, []).extend(ts[50:])
if len(sys.argv) > 2 and r == 0:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for i in range(300): comm.allreduce(t)
    pr.disable(); pstats.Stats(pr).sort_stats(sys.argv[3] if len(sys.argv) > 3 else "cumtime").print_stats(40)
elif len(sys.argv) > 2:
    for i in range(300): comm.allreduce(t)
if r == 0:
    for k, v in res.items():
        v = np.array(v) * 1e6
        print(dist.get_world_size(), n, k, "median %.0f p90 %.0f mean %.0f" % (np.median(v), np.percentile(v, 90), v.mean()))
