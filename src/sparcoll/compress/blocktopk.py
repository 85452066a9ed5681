"""blocktopk (ours): keep the blocks of largest L2 norm, zero the rest, and let sparcoll's sparse
AllReduce sum the result: a zero block never crosses the wire and a kept block needs one 4-byte block
index, not one index per element as topk does.

Blocks are the communicator's (block_size elements of the flattened tensor, the last one shorter),
so the kept blocks are exactly the ones the AllReduce sends. RATIO is the fraction of the tensor's
blocks kept (at least one); blocks of norm 0 are never kept.
"""
from __future__ import annotations

import math

import torch

from .base import Compressor, Payload, block_bytes


class BlockTopK(Compressor):
    """Error: the dropped blocks, each of norm no larger than the smallest kept block's."""
    scheme = "sparse"
    entries = True

    def _keep(self, nblocks: int) -> int:
        return min(nblocks, max(1, math.ceil(self.spec.arg * nblocks)))

    def _top(self, norms: torch.Tensor, nblocks: int) -> torch.Tensor:
        top = norms.topk(min(self._keep(nblocks), norms.numel()), sorted=False).indices
        return top[norms[top] > 0]

    def compress(self, x: torch.Tensor) -> Payload:
        flat, bs = x.reshape(-1), self.block_size
        n = flat.numel()
        full = n // bs
        rows = flat[:full * bs].view(full, bs)
        norms = rows.norm(dim=1)            # 12x faster than square().sum(dim=1): no temporary
        if n % bs:
            norms = torch.cat([norms, flat[full * bs:].norm().reshape(1)])
        keep = self._top(norms, norms.numel())
        out = torch.zeros(n)
        kept_full = keep[keep < full]
        out[:full * bs].view(full, bs)[kept_full] = rows[kept_full]
        if kept_full.numel() < keep.numel():
            out[full * bs:] = flat[full * bs:]
        return Payload((out,), keep.numel())

    def compress_entries(self, idx: torch.Tensor, vals: torch.Tensor, numel: int):
        """The same choice over the blocks a COO tensor's entries touch (linear indices)."""
        blocks, where = torch.unique(idx // self.block_size, return_inverse=True)
        norms = torch.zeros(blocks.numel()).index_add_(0, where, vals.square())
        kept = torch.zeros(blocks.numel(), dtype=torch.bool)
        kept[self._top(norms, -(-numel // self.block_size))] = True
        mask = kept[where]
        return idx[mask], vals[mask]

    def decompress(self, parts: tuple, ctx) -> torch.Tensor:
        return parts[0]

    def sent_bytes(self, payload: Payload) -> int:
        """The kept blocks (`payload.ctx` of them) and their indices, as sparcoll sends them."""
        return self._blocks_bytes(payload.ctx)

    def _blocks_bytes(self, count: int) -> int:
        return block_bytes(count, self.block_size, 4)

    def payload_bytes(self, numel: int, shape=None) -> int:
        """Data of the kept blocks and a 4-byte block index each (sparcoll's wire format)."""
        return self._blocks_bytes(self._keep(-(-numel // self.block_size)))
