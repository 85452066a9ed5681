"""The machine's speed at a moment: the CPU time of a fixed piece of work. On this project's 2-core
virtual machine the same work took 1.25-1.29x longer at its 90th percentile than at its 10th, second
to second, on an otherwise idle machine (benchmarks/machine_speed.py, docs/benchmarks-log.md): a step
bounded by the workers' CPU moves with it, so a measured step is read beside the speed it ran at.

The work is matrix products (compute) and an elementwise sum over a few MB (memory), timed by the
calling thread's CPU clock: a thread the scheduler takes off its core meanwhile does not count."""
from __future__ import annotations

import functools
import time

import torch

PRODUCTS = 4            # 256 x 256 float32 products
STREAMED = 1 << 20      # floats summed elementwise, 4 MB: past the 2 MB L2 of this machine's cores


@functools.cache
def _operands() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(256, 256, generator=generator) for _ in range(2))
    x, y = (torch.randn(STREAMED, generator=generator) for _ in range(2))
    return a, b, torch.empty(256, 256), x, y, torch.empty(STREAMED)


def reference_cpu_s() -> float:
    """The calling thread's CPU seconds for the reference work (about 2-3 ms here)."""
    a, b, product, x, y, total = _operands()
    start = time.thread_time()
    for _ in range(PRODUCTS):
        torch.mm(a, b, out=product)
        torch.add(x, y, out=total)
    return time.thread_time() - start
