"""One-off: Chooser.densities timed on 16M float32 at 1% block density, one core, with the src directory
given as the first argument, the density second (default 0.01):
    OMP_NUM_THREADS=1 .venv/bin/python docs/results/loopback-1pct-look/look_time.py src 1.0"""
import time, numpy as np, torch, sys
sys.path.insert(0, sys.argv[1])
from sparcoll import algorithm
n = 16 << 20
x = torch.zeros(n); idx = torch.randperm(n // 256)[: int(n // 256 * float(sys.argv[2] if len(sys.argv) > 2 else 0.01))]; x.view(-1, 256)[idx] = 1.0
c = algorithm.Chooser.__new__(algorithm.Chooser)
c.largest_block = 256; c._samples = {}
kind = (n, 6, 0)
def t(f, k=200):
    f(); ts = []
    for _ in range(k):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return np.median(ts) * 1e6
print("densities us", t(lambda: algorithm.Chooser.densities(c, kind, x)), algorithm.Chooser.densities(c, kind, x))
sample = c._samples[kind]
blocks = x.view(-1, 256)
print("gather us", t(lambda: blocks[sample]))
print("gather+ne us", t(lambda: blocks[sample].ne(0)))
sizes = algorithm.candidate_block_sizes(256)
def np_version():
    marks = blocks[sample].ne(0).numpy().reshape(len(sample), 256 // sizes[-1], sizes[-1]).any(axis=2)
    shares = {}
    for b in reversed(sizes):
        shares[b] = np.count_nonzero(marks) / marks.size
        if b != 256:
            marks = marks.reshape(len(marks), -1, 2).any(axis=2)
    return shares
print("numpy version us", t(np_version), np_version())
sn = sample.numpy()
def np_version2():
    marks = (blocks.numpy()[sn] != 0).reshape(len(sn), 256 // sizes[-1], sizes[-1]).any(axis=2)
    shares = {}
    for b in reversed(sizes):
        shares[b] = np.count_nonzero(marks) / marks.size
        if b != 256:
            marks = marks.reshape(len(marks), -1, 2).any(axis=2)
    return shares
print("numpy gather version us", t(np_version2), np_version2())
from sparcoll.blocks import nonzero_mask
g = blocks[sample]
print("mask us", t(lambda: nonzero_mask(g)))
m = nonzero_mask(g)
print("from_numpy+to+index us", t(lambda: g[torch.from_numpy(m).to(g.device)]))
tt = g[torch.from_numpy(m)]
print("ne cpu numpy reshape any us", t(lambda: tt.ne(0).cpu().numpy().reshape(len(tt), 16, 16).any(axis=2)))
