"""Benchmark inputs: one block-sparse float32 tensor per worker, with a chosen block density and overlap.

The cost of a sparse allreduce depends on each worker's density d and on the density of the union of
all workers' non-zero blocks. `overlap` moves that union between d (every worker has the same pattern)
and about 1-(1-d)^n (independent patterns): a fraction `overlap` of each worker's non-zero blocks is a
pattern shared by all workers, the rest is drawn independently outside it.

Every worker's input is a pure function of (spec, worker), so any process can regenerate any worker's
input: the correctness check sums all of them without going through the algorithm under test.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

#: float32 unit roundoff. Any order of summing n terms errs by at most (n-1)*U*sum(|x|).
U32 = 2.0 ** -24


@dataclass(frozen=True)
class InputSpec:
    """The inputs of one benchmark point. Densities are block densities in (0, 1]."""
    numel: int
    block_size: int
    workers: int
    density: float
    overlap: float
    seed: int

    def __post_init__(self):
        if self.numel <= 0 or self.block_size <= 0 or self.numel % self.block_size:
            raise ValueError(f"numel {self.numel} must be a positive multiple of block_size {self.block_size}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density {self.density} outside (0, 1]")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap {self.overlap} outside [0, 1]")
        if self.workers < 1:
            raise ValueError(f"workers {self.workers} < 1")

    @property
    def nblocks(self) -> int:
        return self.numel // self.block_size

    @property
    def blocks_per_worker(self) -> int:
        """Non-zero blocks of every worker: density x nblocks, rounded, at least one."""
        return min(self.nblocks, max(1, round(self.density * self.nblocks)))

    @functools.cached_property
    def shared(self) -> np.ndarray:
        """The block ids every worker has non-zero (sorted)."""
        count = round(self.overlap * self.blocks_per_worker)
        return np.sort(self._rng(0).choice(self.nblocks, count, replace=False))

    def _rng(self, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream])

    def _pattern(self, rng: np.random.Generator) -> np.ndarray:
        free = np.ones(self.nblocks, dtype=bool)
        free[self.shared] = False
        own = rng.choice(np.flatnonzero(free), self.blocks_per_worker - len(self.shared), replace=False)
        return np.sort(np.concatenate([self.shared, own]))

    def pattern(self, worker: int) -> np.ndarray:
        """Sorted non-zero block ids of `worker` (int64)."""
        return self._pattern(self._rng(worker + 1))

    def blocks(self, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted block ids, (k, block_size) standard-normal float32 values) of `worker`."""
        rng = self._rng(worker + 1)
        indices = self._pattern(rng)
        values = rng.standard_normal((len(indices), self.block_size), dtype=np.float32)
        return torch.from_numpy(indices), torch.from_numpy(values)

    def to_dense(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The flat float32 tensor holding `values` at blocks `indices`, zero elsewhere."""
        out = torch.zeros(self.numel, dtype=torch.float32)
        out.view(self.nblocks, self.block_size)[indices] = values
        return out

    def union_density(self) -> float:
        """Fraction of blocks that are non-zero at one worker at least."""
        union = np.zeros(self.nblocks, dtype=bool)
        for w in range(self.workers):
            union[self.pattern(w)] = True
        return float(union.mean())

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(exact sum of all workers' inputs rounded to float32, per-element tolerance).

        The sum is accumulated in float64 (exact enough); the tolerance n*2U*sum|x| is twice the worst
        error of any float32 summation order plus the rounding of the reference, and is 0 where every
        input is 0: a block that is zero everywhere must come back exactly zero."""
        total = torch.zeros(self.nblocks, self.block_size, dtype=torch.float64)
        magnitude = torch.zeros(self.nblocks, self.block_size, dtype=torch.float32)
        for w in range(self.workers):
            indices, values = self.blocks(w)
            total.index_add_(0, indices, values.double())
            magnitude.index_add_(0, indices, values.abs())
        return total.float().view(-1), magnitude.mul_(self.workers * 2 * U32).view(-1)


def check(result: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor) -> tuple[bool, float]:
    """(whether every element is within its tolerance (NaN is not), largest absolute error)."""
    error = (result - expected).abs_()
    return bool((error <= tolerance).all()), float(error.max())
