"""PowerSGD (Vogels et al. 2019): a rank-r approximation P Q^T of the gradient as a matrix, from one
step of power iteration warm-started with the previous step's Q. Both factors are summable, so it
is two allreduces (P, then Q, each for all tensors at once; one where every tensor goes whole),
never an allgather; it is a
communication scheme of its own, so the compressor drives the two allreduces itself (`reduce_many`).

Q starts from a generator seeded by the spec's seed and a counter of Qs created, identical on every
rank; after each step every rank holds the same averaged Q, the next step's start (unless it is 0:
the start is kept, and so it is where Q is not finite). A tensor of
shape (d0, d1, ...) is the matrix d0 x (d1 * ...); a 1-D one of n elements is padded to the nearest
square ceil(n / c) x c, c = ceil(sqrt(n)). A tensor whose factors would hold at least as many
elements as it does (a thin matrix such as (n, 1), a small one such as 3 x 3) is averaged as it is
in the first allreduce: exact, and no more bytes (as torch's PowerSGD hook does).
"""
from __future__ import annotations

import math

import torch

from .base import Compressor
from .spec import OPTION_DEFAULTS


def matrix_shape(shape: tuple, numel: int) -> tuple[int, int]:
    if len(shape) >= 2 and numel:
        return shape[0], numel // shape[0]
    cols = max(1, math.ceil(math.sqrt(numel)))
    return max(1, math.ceil(numel / cols)), cols


class PowerSGD(Compressor):
    """Error: M - P P^T M with P orthonormal, so ||M - M'|| <= ||M|| (Frobenius); a matrix of rank
    <= r is recovered exactly once Q spans its row space (the first step, from a random Q, almost
    surely)."""
    scheme = "powersgd"

    def __init__(self, spec):
        super().__init__(spec)
        self.rank = spec.arg
        self.seed = spec.options.get("seed", OPTION_DEFAULTS["seed"])
        self.created = 0
        self.q: dict = {}

    def _start(self, key, cols: int, rank: int) -> torch.Tensor:
        q = self.q.get(key)
        if q is None or q.shape != (cols, rank):
            shared = torch.Generator().manual_seed((self.seed * 1_000_003 + self.created) % (1 << 63))
            self.created += 1
            q = torch.randn(cols, rank, generator=shared)
        return q

    def reduce_many(self, xs: list, shapes: list, keys: list, allreduce_mean_many,
                    into: list | None = None) -> list:
        """The average over ranks of each x's rank-r approximation (xs flat float32);
        `allreduce_mean_many` averages a list of tensors over ranks in one collective. `into`: flat
        float32 tensors that receive the approximations (one per x; a target may be x itself: it is
        written only after the last product that reads x), saving a fresh tensor of x's size."""
        whole = [self.sends_whole(x.numel(), shape) for x, shape in zip(xs, shapes)]
        mats, starts = [], []
        for x, shape, key in zip(xs, shapes, keys):
            if self.sends_whole(x.numel(), shape):
                continue
            rows, cols = matrix_shape(tuple(shape), x.numel())
            pad = rows * cols - x.numel()
            mats.append((torch.cat([x, x.new_zeros(pad)]) if pad else x).view(rows, cols))
            starts.append(self._start(key, cols, min(self.rank, rows, cols)))
        # The skinny factor on the left (Q^T M^T rather than M Q, P^T M rather than M^T P): the same
        # products, 3-14x faster on a CPU for ranks of 2 to 8 (BLAS walks the large matrix row by row).
        first = allreduce_mean_many([torch.mm(q.t(), m.t()).t().contiguous() for m, q in zip(mats, starts)]
                                    + [x.clone() for x, alone in zip(xs, whole) if alone])    # x is not ours
        ps, averages = [torch.linalg.qr(p).Q for p in first[:len(mats)]], iter(first[len(mats):])
        qs = allreduce_mean_many([torch.mm(p.t(), m).t().contiguous() for m, p in zip(mats, ps)]) if mats else []
        compressed = [key for key, alone in zip(keys, whole) if not alone]
        # A zero gradient (a parameter unused this step) gives Q = 0, and a warm start from 0 would
        # lose most of the next gradient; a NaN or infinity in one (a loss scaler's overflow step,
        # which it skips) gives a NaN Q, which made every later approximation NaN, with ef=off too
        # (a review): such a tensor keeps its start. Every rank holds the same averaged Q, so every
        # rank decides alike.
        self.q.update((key, q if q.any() and q.isfinite().all() else start)
                      for key, q, start in zip(compressed, qs, starts))
        products = iter(zip(ps, qs, mats))
        targets = into if into is not None else [None] * len(xs)
        return [_copied(next(averages), target) if alone else _product(*next(products), x.numel(), target)
                for x, alone, target in zip(xs, whole, targets)]

    def sends_whole(self, numel: int, shape) -> bool:
        """Whether the tensor goes as it is: its factors would hold at least as many elements."""
        rows, cols = matrix_shape(tuple(shape or (numel,)), numel)
        return min(self.rank, rows, cols) * (rows + cols) >= numel

    def payload_bytes(self, numel: int, shape: tuple | None = None) -> int:
        rows, cols = matrix_shape(tuple(shape or (numel,)), numel)
        return 4 * min(numel, min(self.rank, rows, cols) * (rows + cols))


def _copied(average: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    return average if target is None else target.copy_(average)


def _product(p: torch.Tensor, q: torch.Tensor, mat: torch.Tensor, numel: int,
             target: torch.Tensor | None) -> torch.Tensor:
    """P Q^T as a flat tensor of `numel` elements, written into `target` where the matrix needs no
    padding (a fresh tensor of this size costs more than the product: its pages are new)."""
    if target is None or mat.numel() != numel:
        return torch.mm(p, q.t()).reshape(-1)[:numel]
    return torch.mm(p, q.t(), out=target.view(mat.shape)).view(-1)
