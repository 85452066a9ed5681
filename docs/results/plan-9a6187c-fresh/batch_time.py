"""Each workload's batch generation (next(batches)) and forward on one process, one thread, medians:
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python docs/results/plan-9a6187c-fresh/batch_time.py"""
import time, torch, statistics
torch.set_num_threads(1)
from sparcoll.workloads import get_workload
for name, bs in (('ncf', 256), ('deeplight', 256), ('gpt', 1), ('vgg', 32)):
    w = get_workload(name, data=None, seed=0)
    it = w.batches(bs, 0, 4, 0)
    next(it)
    ts = []
    for _ in range(20):
        t = time.perf_counter(); b = next(it); ts.append(time.perf_counter() - t)
    m = w.model
    fs = []
    for _ in range(5):
        b = next(it)
        t = time.perf_counter(); loss = w.loss(m, b); fs.append(time.perf_counter() - t)
    print(name, 'batch ms %.3f' % (statistics.median(ts) * 1e3), 'forward ms %.2f' % (statistics.median(fs) * 1e3))
