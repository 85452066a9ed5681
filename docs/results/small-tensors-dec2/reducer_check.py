import statistics, time, torch, torch.distributed as dist, sparcoll.compress as sc
dist.init_process_group("gloo"); rank = dist.get_rank()
for spec, n in (("none", 64), ("fp16", 64), ("none", 4096), ("qsgd:16", 4096)):
    out = []
    for check in (False, True, False, True):
        r = sc.Reducer(spec, check_sizes=check); x = torch.randn(n)
        for _ in range(20): r.reduce(x, key="w")
        ts = []
        for _ in range(300):
            s = time.perf_counter(); r.reduce(x, key="w"); ts.append(time.perf_counter() - s)
        out.append(f"{'on' if check else 'off'} {statistics.median(ts)*1e6:.0f}")
    if rank == 0: print(spec, n, "; ".join(out), flush=True)
dist.destroy_process_group()
