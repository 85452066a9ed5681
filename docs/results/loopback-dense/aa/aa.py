"""A/A test: gloo allreduce on the default group and on two more groups made alike (dist.new_group),
called interleaved in a shuffled order, 40 repetitions each, the slowest rank's time; rank 0 prints
the medians. How far apart identical collectives measure on this machine.
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 aa.py NUMEL REPS"""
import statistics, sys, time, random, torch, torch.distributed as dist
dist.init_process_group("gloo")
n = int(sys.argv[1]); reps = int(sys.argv[2])
groups = {"default": None, "groupA": dist.new_group(backend="gloo"), "groupB": dist.new_group(backend="gloo")}
src = torch.randn(n)
bufs = {k: src.clone() for k in groups}
for _ in range(5):
    for k, g in groups.items(): dist.all_reduce(bufs[k], group=g)
res = {k: [] for k in groups}
rng = random.Random(1)
for i in range(reps):
    order = list(groups); rng.shuffle(order)
    for k in order:
        bufs[k].copy_(src); dist.barrier()
        a = time.perf_counter(); dist.all_reduce(bufs[k], group=groups[k]); el = torch.tensor([time.perf_counter() - a]); dist.all_reduce(el, op=dist.ReduceOp.MAX)
        res[k].append(el.item())
if dist.get_rank() == 0:
    m = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    print(n, " ".join(f"{k} {m[k]:.2f}" for k in m), "A/default %.3f B/default %.3f" % (m["default"] / m["groupA"], m["default"] / m["groupB"]))
dist.destroy_process_group()
