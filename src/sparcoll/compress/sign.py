"""Sign compressors: one bit per element (bit-packed) and two reconstruction values per rank.

  signsgd    x' = mean|x| * sign(x); ranks combine by majority vote: sign(sum of signs) times the
             ranks' mean scale (so a step keeps the gradient's magnitude); no error feedback.
             One bit has no room for 0: sign(0) is +1 here, so an element whose gradient is 0 on
             every rank still moves by the scale (efsignsgd's feedback takes the step back later)
  efsignsgd  the same x', error feedback on, ranks' x' averaged (EF-SignSGD, Karimireddy et al.)
  onebit     1-bit SGD (Seide et al.): x' = mean of x's non-negative entries where x >= 0, mean of
             its negative entries where x < 0; error feedback on, averaged
"""
from __future__ import annotations

import torch

from . import bits
from .base import Compressor, Payload


class Sign(Compressor):
    """The bit is x < 0; `levels` = (value for a 0 bit, value for a 1 bit)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.vote = spec.name == "signsgd"

    def levels(self, flat: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        # not flat.norm(p=1): in float32 it was 5% low over 25M elements; abs().sum() sums pairwise
        scale = flat.abs().sum() / max(1, flat.numel())
        return torch.stack([scale, -scale])

    def compress(self, x: torch.Tensor) -> Payload:
        flat = x.reshape(-1)
        negative = flat < 0
        return Payload((self.levels(flat, negative), bits.pack(negative)), flat.numel())

    def decompress(self, parts: tuple, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        levels, packed = parts
        return bits.decode(packed, numel, levels, out)

    def combine(self, gathered: list[tuple], numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.vote:
            return super().combine(gathered, numel, out)
        ballot = torch.tensor([1.0, -1.0])      # a 0 bit votes +1, a 1 bit -1
        votes = bits.decode(gathered[0][1], numel, ballot, out)
        for _, packed in gathered[1:]:
            votes += bits.decode(packed, numel, ballot, self.scratch(numel))
        scale = torch.stack([levels[0] for levels, _ in gathered]).mean()
        return votes.sign_().mul_(scale)

    def payload_bytes(self, numel: int, shape=None) -> int:
        return 8 + bits.packed_bytes(numel)


class OneBit(Sign):
    """Two levels per rank: the means of the non-negative and of the negative entries, which keeps
    each group's sum (the error is zero-mean within each)."""

    def levels(self, flat: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        count_neg = torch.count_nonzero(negative)
        sum_neg = flat.clamp(max=0.0).sum()
        pos = (flat.sum() - sum_neg) / (flat.numel() - count_neg).clamp(min=1)
        return torch.stack([pos, sum_neg / count_neg.clamp(min=1)])
