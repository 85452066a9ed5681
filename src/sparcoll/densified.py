"""A small sparse COO tensor as one dense buffer for gloo's paths (ring.py), and the sum back as COO.

The sparse path's fixed cost (a message to every aggregator and back) is most of a small COO
tensor's sum: a table of 64K elements over 2 ranks on loopback took 2.3-2.9 ms a call where gloo's
sparse all_reduce took 1.4-2.6 in the same runs. A COO tensor small enough to gather (algorithm.py)
may go through gloo's ring or the gathered round instead, as one dense buffer: its values, then a
mark per entry (1 where this rank stored it). The summed marks tell which entries some rank stored,
so the result lists those, as the sparse path does: every stored entry, except where entries share
the sparse path's blocks (a table taller than its block indices number); there it cannot tell a
stored entry whose sum is exactly zero from one nobody stored and lists neither, and so does this,
so that a kind's result is the same whichever path it takes.
"""
from __future__ import annotations

import numpy as np
import torch

from .blocks import coo_of, entries_of, entries_share_blocks, entry_width, holding, linear_entries


def buffer_numel(coo: torch.Tensor) -> int:
    """Elements of `coo`'s buffer: its dense values and a mark per entry."""
    return coo.numel() + entries_of(coo)


def to_buffer(coo: torch.Tensor) -> torch.Tensor:
    """`coo` as a dense buffer of buffer_numel elements in its dtype: the values of its entries in
    row-major order (zero where it stores nothing), then 1 for each entry it stores."""
    entries, width = entries_of(coo), entry_width(coo)
    coo = coo.coalesce()
    buffer = torch.zeros(coo.numel() + entries, dtype=coo.dtype)
    stored = linear_entries(coo)
    buffer[:coo.numel()].view(entries, width).index_add_(0, stored, coo.values().reshape(-1, width))
    buffer[coo.numel():].index_fill_(0, stored, 1)
    return buffer


def from_buffer(total: torch.Tensor, like: torch.Tensor, block_size: int) -> torch.Tensor:
    """The summed buffer `total` as a coalesced COO tensor of `like`'s shape and sparse dims: the
    entries some rank stored (their marks' sum is non-zero), without those whose sum is exactly zero
    where entries share the sparse path's blocks of `block_size` elements (see the module's
    docstring)."""
    entries, numel, width = entries_of(like), like.numel(), entry_width(like)
    marks = total[numel:]
    listed = np.flatnonzero(marks.ne(0).numpy())
    values = total[:numel].view(entries, width)[torch.from_numpy(listed)]
    if entries_share_blocks(width, block_size):
        listed, values = holding(listed, values)
    return coo_of(listed, values, like.shape, like.sparse_dim())

