"""A tensor seen as fixed-size blocks: find the non-zero ones, hand out views, gather and scatter.

All work is whole-tensor torch ops; nothing loops over blocks in Python. Runs of consecutive blocks are
exposed as views so the transport can send from, and receive into, the tensor's own memory.
"""
from __future__ import annotations

import torch


def nonzero_mask(rows: torch.Tensor) -> torch.Tensor:
    """Which rows hold a non-zero element. -0.0 counts as zero; NaN and Inf count as non-zero.

    amax/amin per row was the fastest correct scan measured here (see PLATFORM.md): a NaN makes both
    NaN (!= 0 is true) and -0.0 compares equal to zero."""
    if rows.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=rows.device)
    return (rows.amax(1) != 0) | (rows.amin(1) != 0)


def runs(indices: torch.Tensor, limit: int) -> list[tuple[int, int]] | None:
    """Sorted block indices as [start, stop) runs of consecutive blocks, or None if there are more
    than `limit` runs (then gathering into one buffer beats one system call per run)."""
    if indices.numel() == 0:
        return []
    breaks = ((indices[1:] - indices[:-1]) != 1).nonzero().squeeze(1)
    if breaks.numel() + 1 > limit:
        return None
    starts = torch.cat([indices[:1], indices[breaks + 1]]).tolist()
    stops = torch.cat([indices[breaks] + 1, indices[-1:] + 1]).tolist()
    return list(zip(starts, stops))


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class BlockTensor:
    """A flat contiguous CPU tensor as (nblocks, block_size) rows. A last, partial block is kept padded
    with zeros in a one-row side buffer, copied back by `finish()`."""

    def __init__(self, flat: torch.Tensor, block_size: int):
        self.flat = flat
        self.block_size = block_size
        self.full = flat.numel() // block_size
        self.nblocks = -(-flat.numel() // block_size)
        self.rows = flat[: self.full * block_size].view(self.full, block_size)
        self.tail = None
        if self.nblocks > self.full:
            self.tail = torch.zeros(1, block_size, dtype=flat.dtype)
            self.tail[0, : flat.numel() - self.full * block_size] = flat[self.full * block_size:]

    def nonzero(self) -> torch.Tensor:
        """Indices (int64, sorted) of the non-zero blocks."""
        mask = nonzero_mask(self.rows)
        if self.tail is not None:
            mask = torch.cat([mask, nonzero_mask(self.tail)])
        return mask.nonzero().squeeze(1)

    def views(self, start: int, stop: int) -> list[torch.Tensor]:
        """The blocks [start, stop) as one or two views of the tensor's memory (two when the run
        reaches the padded last block)."""
        out = []
        if start < self.full:
            out.append(self.rows[start:min(stop, self.full)])
        if stop > self.full:
            out.append(self.tail)
        return out

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """Copy of the blocks `indices` as an (m, block_size) tensor."""
        if self.tail is not None and indices.numel() and int(indices[-1]) == self.full:
            return torch.cat([self.rows.index_select(0, indices[:-1]), self.tail])
        return self.rows.index_select(0, indices)

    def rows_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The blocks `indices` as an (m, block_size) tensor: a view when they form one run inside the
        full blocks, else a gathered copy."""
        n = indices.numel()
        if n and int(indices[-1]) < self.full and int(indices[-1]) - int(indices[0]) == n - 1:
            return self.rows[int(indices[0]):int(indices[0]) + n]
        return self.gather(indices)

    def scatter(self, indices: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` into the blocks `indices`."""
        if self.tail is not None and indices.numel() and int(indices[-1]) == self.full:
            self.tail.copy_(rows[-1:])
            indices, rows = indices[:-1], rows[:-1]
        n = indices.numel()
        if n and int(indices[-1]) - int(indices[0]) == n - 1:
            self.rows[int(indices[0]):int(indices[0]) + n].copy_(rows)
        elif n:
            self.rows.index_copy_(0, indices, rows)

    def finish(self) -> None:
        """Copy the padded last block back into the tensor."""
        if self.tail is not None:
            start = self.full * self.block_size
            self.flat[start:].copy_(self.tail[0, : self.flat.numel() - start])
