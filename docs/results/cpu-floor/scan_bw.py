"""One-off: the scan (nonzero_mask) against a plain OR-reduce of the same 64 MB, each after a fresh copy
of the tensor (as the bench prepares its input), one core. Run alone, then two at once:
    PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/cpu-floor/scan_bw.py alone
    (PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/cpu-floor/scan_bw.py pairA & \
     PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/cpu-floor/scan_bw.py pairB; wait)
Measured 2026-11-27 (a8ca1ca): alone 4.22 / 3.49 ms; pairA 4.61 / 4.12, pairB 5.31 / 4.75 (scan / plain)."""
import sys
import time

import numpy as np
import torch

from sparcoll.blocks import nonzero_mask

torch.set_num_threads(1)
t = torch.zeros(16 << 20)
t.view(-1, 256)[torch.randperm(65536)[:655]] = 1
src = t.clone()
rows = t.view(-1, 256)
scan, plain = [], []
for _ in range(60):
    t.copy_(src)
    start = time.perf_counter()
    nonzero_mask(rows)
    scan.append(time.perf_counter() - start)
    start = time.perf_counter()
    np.bitwise_or.reduce(t.numpy().view(np.uint64))
    plain.append(time.perf_counter() - start)
print(sys.argv[1], "scan after copy ms %.2f  plain or-reduce ms %.2f" % (np.median(scan) * 1e3, np.median(plain) * 1e3))
