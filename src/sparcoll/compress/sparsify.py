"""Sparsifiers: send a subset of the elements.

topk, threshold and dgc send (indices, values) of the elements they select and are gathered (each
rank selects different elements; sizes vary, may be 0). Zeros are never selected, so a mostly-zero
dense tensor sends only its non-zero elements, and the entries of a sparse COO tensor are selected
without densifying it. RATIO is always a fraction of the tensor's numel.

randomk selects the same indices on every rank (drawn from a generator seeded by the spec's seed and
a call counter, identical on all ranks as long as they reduce the same tensors in the same order), so
its values are summable: one allreduce of k values, no indices on the wire.
"""
from __future__ import annotations

import math

import torch

from .base import Compressor, Entries, Payload, index_dtype, zeroed
from .spec import OPTION_DEFAULTS


def _count(ratio: float, numel: int) -> int:
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


class Sparsifier(Compressor):
    """Selection by `select(values, numel)` -> positions; (indices, values) on the wire."""
    variable = True
    entries = True

    def select(self, values: torch.Tensor, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def compress(self, x: torch.Tensor) -> Payload:
        flat = x.reshape(-1)
        pos = self.select(flat, flat.numel())
        return Payload((pos.to(index_dtype(flat.numel())), flat[pos]), flat.numel())

    def compress_entries(self, idx: torch.Tensor, vals: torch.Tensor, numel: int):
        pos = self.select(vals, numel)
        return idx[pos], vals[pos]

    def decompress(self, parts: tuple, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        idx, vals = parts
        return zeroed(numel, out).index_put_((idx.long(),), vals)

    def sent(self, payload: Payload, numel: int) -> Entries:
        return Entries(payload.parts[0].long())

    def combine(self, gathered: list[tuple], numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        idx = torch.cat([parts[0].long() for parts in gathered])
        vals = torch.cat([parts[1] for parts in gathered])
        return zeroed(numel, out).index_add_(0, idx, vals).div_(len(gathered))

    def payload_bytes(self, numel: int, shape=None) -> int:
        return self._bound(numel) * (4 + index_dtype(numel).itemsize)

    def _bound(self, numel: int) -> int:
        return _count(self.spec.arg, numel)


def _above_sampled(values: torch.Tensor, k: int, margin: float, rng) -> torch.Tensor:
    """Positions whose magnitude reaches the threshold that `margin * k` elements would pass,
    estimated on a 1% random sample: one pass over the data instead of a full top-k, by two
    comparisons into bool tensors (no float temporary for |values|)."""
    n = values.numel()
    # a NaN sampled counts as 0: as the floor it would pass every element to the full top-k after
    sample = values[torch.from_numpy(rng.integers(0, n, max(1, n // 100)))].abs().nan_to_num_(nan=0.0)
    expected = min(sample.numel(), max(1, math.ceil(margin * k * sample.numel() / n)))
    floor = sample.topk(expected, sorted=False).values.min()
    return (values < floor).logical_and_(values > -floor).logical_not_().nonzero().squeeze(1)   # NaN passes


def _largest(values: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """The (at most) k positions among `pos` of largest magnitude, none of them zero."""
    if pos.numel() > k:
        pos = pos[values[pos].abs().topk(k, sorted=False).indices]
    return pos[values[pos] != 0]


class TopK(Sparsifier):
    """The k = ceil(RATIO * numel) largest magnitudes (fewer when fewer are non-zero), exactly; the
    error is the dropped elements, each no larger than the smallest kept. On large tensors the top-k
    runs among the elements above a sampled threshold set for 2k of them (a full top-k when fewer
    pass it), 5x faster than torch.topk over 25M elements."""

    def select(self, values: torch.Tensor, numel: int) -> torch.Tensor:
        k = min(_count(self.spec.arg, numel), values.numel())
        pos = None
        if values.numel() >= 100_000 and k * 10 <= values.numel():
            pos = _above_sampled(values, k, 2.0, self.rng)
        if pos is None or pos.numel() < k:
            pos = values.abs().topk(k, sorted=False).indices
        return _largest(values, pos, k)


class Threshold(Sparsifier):
    """Every element with |x| > VALUE (and every NaN): the size depends on the data (0 to numel elements, so
    payload_bytes is the upper bound, numel * 8); the error is at most VALUE per element."""

    def select(self, values: torch.Tensor, numel: int) -> torch.Tensor:
        # comparisons into bool tensors: 2x faster than a float temporary for values.abs(); NaN passes
        above = (values <= self.spec.arg).logical_and_(values >= -self.spec.arg).logical_not_()
        return above.nonzero().squeeze(1)

    def _bound(self, numel: int) -> int:
        return numel


class DGC(Sparsifier):
    """Deep Gradient Compression: the threshold for the top RATIO is estimated on a 1% random sample
    (no full sort), the elements above it are sent, at most k (exact top-k among them if more).
    Momentum correction is its memory (memory.Momentum)."""
    entries = False

    def select(self, values: torch.Tensor, numel: int) -> torch.Tensor:
        k = _count(self.spec.arg, numel)
        if k == 0:
            return torch.zeros(0, dtype=torch.long)
        return _largest(values, _above_sampled(values, k, 1.0, self.rng), k)


class RandomK(Compressor):
    """k = ceil(RATIO * numel) indices drawn uniformly (with replacement, O(k)) from the shared
    generator. With error feedback off the values are divided by P(index drawn) = 1 - (1 - 1/n)^k,
    which makes the result unbiased; with error feedback on (the default) they are sent unscaled,
    since the scaled estimator is not a contraction and error feedback diverges with it."""
    scheme = "allreduce"

    def __init__(self, spec):
        super().__init__(spec)
        self.seed = spec.options.get("seed", OPTION_DEFAULTS["seed"])
        self.calls = 0

    def compress(self, x: torch.Tensor) -> Payload:
        flat = x.reshape(-1)
        n, k = flat.numel(), _count(self.spec.arg, flat.numel())
        shared = torch.Generator().manual_seed((self.seed * 1_000_003 + self.calls) % (1 << 63))
        self.calls += 1
        idx = torch.randint(n, (k,), generator=shared) if n else torch.zeros(0, dtype=torch.long)
        vals = flat[idx]
        if not self.spec.ef and n > 1:
            vals = vals / -math.expm1(k * math.log1p(-1.0 / n))
        return Payload((vals,), (idx, n))

    def decompress(self, parts: tuple, ctx, out: torch.Tensor | None = None) -> torch.Tensor:
        idx, numel = ctx
        return zeroed(numel, out).index_put_((idx,), parts[0])

    def sent(self, payload: Payload, numel: int) -> Entries:
        """The drawn positions: error feedback runs only unscaled, where the values sent are the
        tensor's own."""
        return Entries(payload.ctx[0])

    def payload_bytes(self, numel: int, shape=None) -> int:
        return 4 * _count(self.spec.arg, numel)
