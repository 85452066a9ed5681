"""A sparse COO tensor as entries of its flattened form (linear indices, values) and back, so the
compressors see one representation for dense and sparse input. Hybrid tensors (values with dense
dimensions, e.g. nn.Embedding(sparse=True) gradients: rows x embedding dim) keep their layout."""
from __future__ import annotations

import torch


def _strides(shape) -> torch.Tensor:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return torch.tensor(strides[::-1], dtype=torch.long)


def entries(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 linear indices, float32 values) of a coalesced COO tensor's stored entries."""
    sparse_dim = t.sparse_dim()
    rows = (t.indices() * _strides(t.shape[:sparse_dim]).unsqueeze(1)).sum(dim=0)
    width = t.values()[0].numel() if t.values().shape[0] else 1
    idx = (rows.unsqueeze(1) * width + torch.arange(width)).reshape(-1)
    return idx, t.values().reshape(-1).float()


def from_entries(idx: torch.Tensor, vals: torch.Tensor, shape, sparse_dim: int) -> torch.Tensor:
    """The coalesced COO tensor of `shape` with `sparse_dim` sparse dimensions whose flattened form
    holds the sum of `vals` at `idx` (repeated indices add up)."""
    shape = tuple(shape)
    width = 1
    for size in shape[sparse_dim:]:
        width *= size
    rows, where = torch.unique(idx // width, return_inverse=True)
    values = torch.zeros(rows.numel(), width).index_put_((where, idx % width), vals, accumulate=True)
    indices = torch.stack(torch.unravel_index(rows, shape[:sparse_dim])) if rows.numel() else \
        torch.zeros(sparse_dim, 0, dtype=torch.long)
    return torch.sparse_coo_tensor(indices.reshape(sparse_dim, -1), values.reshape(-1, *shape[sparse_dim:]),
                                   shape, is_coalesced=True,
                                   check_invariants=False)
