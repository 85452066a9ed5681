"""One-off: Chooser.densities timed on 16M float32 at a block density (default 0.01), one core, with the
src directory given as the first argument and the density second (the median of 200 looks at the same
result, so the sampled rows are warm); then the parts of the new look.
    OMP_NUM_THREADS=1 .venv/bin/python docs/results/loopback-1pct-look/look_time.py src 1.0"""
import sys
import time

import numpy as np
import torch

sys.path.insert(0, sys.argv[1])
from sparcoll import algorithm
from sparcoll.blocks import nonzero_mask

n, size = 16 << 20, 256
density = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
x = torch.zeros(n)
x.view(-1, size)[torch.randperm(n // size)[:int(n // size * density)]] = 1.0
chooser = algorithm.Chooser.__new__(algorithm.Chooser)    # only what densities reads
chooser.largest_block, chooser._samples = size, {}
kind = (n, 6, 0)


def us(f, k=200):
    f()
    times = []
    for _ in range(k):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return np.median(times) * 1e6


print("densities us", us(lambda: chooser.densities(kind, x)), chooser.densities(kind, x))
sampled = x.view(-1, size)[chooser._samples[kind]]
mask = nonzero_mask(sampled)
touched = sampled[torch.from_numpy(mask)]
print("gather us", us(lambda: x.view(-1, size)[chooser._samples[kind]]))
print("mask us", us(lambda: nonzero_mask(sampled)))
print("touched rows us", us(lambda: sampled[torch.from_numpy(mask)]))
print("sub-block marks us", us(lambda: touched.ne(0).numpy().reshape(len(touched), 16, 16).any(axis=2)))
