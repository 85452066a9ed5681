"""Probe: with sparcoll.keep_freed_memory (glibc keeps freed blocks in its heap), is a freed 411 MB
block reused by the next allocation of the same size? numpy allocates with malloc, torch's CPU
tensors with posix_memalign (64-byte alignment).
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python docs/results/allocator-aligned/reuse_probe.py"""
import resource

import numpy as np
import torch

import sparcoll

print("glibc", " ".join(__import__("platform").libc_ver()), "| kept:", sparcoll.keep_freed_memory(), flush=True)


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_mb() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4 // 1024


def calls(name, allocate) -> None:
    out = []
    for _ in range(CALLS):
        before = faults()
        y = allocate()
        del y
        out.append((round((faults() - before) * 4 / 1024), rss_mb()))
    print(name, "(MB of 4 KiB pages faulted in, RSS MB after):", out, flush=True)


CALLS = 16
x = np.random.default_rng(0).random(102760448, dtype=np.float32)      # vgg's first hidden layer
calls("numpy abs, malloc", lambda: np.abs(x))
t = torch.from_numpy(x)
calls("torch abs, posix_memalign", lambda: t.abs())
