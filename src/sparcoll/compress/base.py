"""The compressor role (GRACE's): compress a tensor into the parts that cross the wire, rebuild a
dense tensor from them, and say which collective fits the parts.

Every compressor takes a contiguous float32 tensor (any shape) and decompresses to a flat float32
tensor of its numel: a new one, or the caller's `out` (the executors pass the gradient itself, which
saves a temporary and a copy of the whole tensor per step). `scheme` tells the Reducer how the parts travel:

  "allreduce"  parts are summable elementwise across ranks (fp16, bf16, randomk): an allreduce
  "sparse"     one dense, block-sparse part, summed by sparcoll's sparse AllReduce (blocktopk)
  "allgather"  per-rank parts are gathered and combined (topk, qsgd, signs, ...)
  "powersgd"   the compressor runs its own two allreduces (see powersgd.py)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .spec import Spec


@dataclass
class Payload:
    """What crosses the wire (`parts`, 1-D tensors) and what only the sender needs to decompress
    them (`ctx`: the numel, or the randomk indices every rank derives from the shared seed)."""
    parts: tuple
    ctx: Any


@dataclass
class Entries:
    """The positions of a flat tensor whose values a rank sent exactly as they are (repeats allowed):
    error feedback zeroes k elements of its residual instead of subtracting a dense tensor."""
    idx: torch.Tensor


def parts_bytes(parts) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


def block_bytes(count: int, block_size: int, itemsize: int) -> int:
    """What sparcoll's sparse AllReduce sends for `count` blocks: their data and a 4-byte index
    each (message headers not counted)."""
    return count * (block_size * itemsize + 4)


def zeroed(numel: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out` zeroed, or a new zero tensor of `numel` float32: where a decompression writes its
    entries."""
    return torch.zeros(numel) if out is None else out.zero_()


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices where they fit: half the bytes of int64."""
    return torch.int32 if numel < 2 ** 31 else torch.int64


class Compressor:
    scheme = "allgather"
    variable = False        # payload size depends on the data: the Reducer gathers sizes first
    entries = False         # compresses the entries of a sparse COO tensor without densifying
    keeps_entries = False   # ... and keeps every one of them (a cast)
    carries_exact = False   # its collective can also carry uncompressed tensors (`whole`)
    block_size = 256        # sparcoll's, for the sparse AllReduce (the Reducer sets the comm's)

    def __init__(self, spec: Spec):
        self.spec = spec
        self._kept = threading.local()      # each thread's scratch buffer
        self.seed_rank(0)

    def seed_rank(self, rank: int) -> None:
        """Seed the private randomness (stochastic rounding, sampling) for `rank`: independent across
        ranks, reproducible per rank. Shared seeds (randomk, powersgd) are the compressors' own.
        numpy's generator: uniform floats 5x faster than torch's on the CPU."""
        self.rng = np.random.default_rng(7919 * rank + 1)

    def uniform(self, count: int) -> torch.Tensor:
        """`count` private uniform float32 draws in [0, 1)."""
        return torch.from_numpy(self.rng.random(count, dtype=np.float32))

    def compress(self, x: torch.Tensor) -> Payload:
        raise NotImplementedError

    def decompress(self, parts: tuple, ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense tensor the parts stand for: a new one (an allgather scheme's never a view of the
        parts: `combine` sums into it; a cast's may be its averaged part), or `out` (flat float32 of
        its numel) overwritten."""
        raise NotImplementedError

    def sent(self, payload: Payload, numel: int):
        """This rank's own payload as error feedback subtracts it (of a tensor of `numel` elements):
        Entries, or a dense tensor in a buffer the calling thread keeps (as large as its largest
        tensor so far; valid until its next call), not a new gradient-sized tensor per call: 770 MB
        a step for vgg's head under efsignsgd, allocated and freed in processes that keep freed
        memory (vgg's profile, 4 workers on one host, is close to the machine's memory)."""
        return self.decompress(payload.parts, payload.ctx, self.scratch(numel))

    def combine(self, gathered: list[tuple], ctx: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Average of every rank's decompressed parts (allgather scheme), in `out` as `decompress`'s;
        majority vote and sparse sums override it."""
        total = self.decompress(gathered[0], ctx, out)
        if len(gathered) > 1:
            scratch = self.scratch(total.numel())
            for parts in gathered[1:]:
                total += self.decompress(parts, ctx, scratch)
        return total.div_(len(gathered))

    def scratch(self, numel: int) -> torch.Tensor:
        """A float32 buffer of `numel` elements, the calling thread's (valid until its next call):
        for `sent`, and for the other ranks' parts while combining. Kept (as large as the thread's
        largest tensor so far) and reused, where a new one each time took a third longer (ncf's
        4.4M-element table under efsignsgd, 4 ranks); per thread, as compressing may run on the
        training thread or an offload thread while the synchronization thread combines."""
        buffer = getattr(self._kept, "buffer", None)
        if buffer is None or buffer.numel() < numel:
            buffer = self._kept.buffer = torch.empty(numel)
        return buffer[:numel]

    def sent_bytes(self, payload: Payload) -> int:
        """Bytes of this payload's parts (what this rank contributes to the collective)."""
        return parts_bytes(payload.parts)

    def payload_bytes(self, numel: int, shape: tuple | None = None) -> int:
        """Bytes of one rank's parts for a tensor of `numel` elements, known before sending (an
        upper bound for data-dependent sizes: topk, dgc, threshold)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.spec)!r})"
