"""nonzero_mask before and after 461a30c on 16M float32, alternated 40 times (one core):
    git show 461a30c~1:src/sparcoll/blocks.py > DIR/blocks_old.py
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python docs/results/narrow-flags/scan_ab.py DIR"""
import sys, time, numpy as np, torch
sys.path.insert(0, sys.argv[1])   # a directory with the commit before's blocks.py as blocks_old.py
import blocks_old
from sparcoll import blocks as new
torch.manual_seed(0)
cases = {}
for width, frac in ((16, 0.0094), (16, 1.0), (32, 0.01), (8, 0.01), (8, 1.0)):
    rows = 16 * 2**20 // width
    g = torch.zeros(rows, width)
    ids = torch.randint(0, rows, (int(rows * frac),))
    g[ids] = torch.randn(len(ids), width)
    cases[(width, frac)] = g
for key, g in cases.items():
    a, b = [], []
    assert (blocks_old.nonzero_mask(g) == new.nonzero_mask(g)).all()
    for _ in range(40):
        for mod, acc in ((blocks_old, a), (new, b)):
            t = time.perf_counter(); mod.nonzero_mask(g); acc.append(time.perf_counter() - t)
    print(key, 'old %.2f new %.2f ms' % (np.median(a)*1e3, np.median(b)*1e3))
