"""Quantizers: every element is sent, with fewer bits.

`none`, `fp16`, `bf16` cast (summable: one allreduce in the cast dtype, each rank's share divided
before the sum, so the sum of fp16 shares overflows no sooner than their mean; a rank's own value
beyond 65504 overflows already when it is cast); `qsgd` and `terngrad` round
stochastically (unbiased, so error feedback is off by default) against a per-rank scale, so their
payloads are gathered, not summed.
"""
from __future__ import annotations

import torch

from . import bits
from .base import Compressor, Payload

_CASTS = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Cast(Compressor):
    """Round to `dtype` (none: float32, no rounding). Error: |x - x'| <= |x| * 2^-11 (fp16, in its
    normal range) or 2^-8 (bf16); fp16 overflows beyond 65504."""
    scheme = "allreduce"
    entries = True
    keeps_entries = True

    def __init__(self, spec):
        super().__init__(spec)
        self.dtype = _CASTS[spec.name]

    def compress(self, x: torch.Tensor) -> Payload:
        # A copy even for float32: the allreduce works in place and x may be the caller's tensor.
        return Payload((x.reshape(-1).to(self.dtype, copy=True),), x.numel())

    def compress_entries(self, idx: torch.Tensor, vals: torch.Tensor, numel: int):
        return idx, vals.to(self.dtype)

    def decompress(self, parts: tuple, ctx, out: torch.Tensor | None = None) -> torch.Tensor:
        return parts[0].float() if out is None else out.copy_(parts[0])    # its own averaged copy

    def payload_bytes(self, numel: int, shape=None) -> int:
        return numel * self.dtype.itemsize


class QSGD(Compressor):
    """QSGD with s levels: |x_i| / ||x|| rounded stochastically to a multiple of 1/s, sent as a signed
    int8 (s <= 127) or int16 with the norm. Unbiased; |x_i - x'_i| <= ||x|| / s."""

    def __init__(self, spec):
        super().__init__(spec)
        self.levels = spec.arg
        self.dtype = torch.int8 if self.levels <= 127 else torch.int16

    def compress(self, x: torch.Tensor) -> Payload:
        flat = x.reshape(-1)
        norm = flat.norm().reshape(1)      # float32: ~0.1% off over 25M, harmless: x' uses it too
        if norm.item() == 0.0:
            return Payload((norm, torch.zeros(flat.numel(), dtype=self.dtype)), flat.numel())
        # floor(s + u), u uniform in [0, 1): s rounded up with probability frac(s), in place; the
        # clamp catches |x| / ||x|| rounding above 1, which would overflow int8 at 127 levels
        level = flat.abs().mul_(self.levels / norm).add_(self.uniform(flat.numel())).floor_()
        level.clamp_(max=self.levels)
        return Payload((norm, level.copysign_(flat).to(self.dtype)), flat.numel())

    def decompress(self, parts: tuple, ctx, out: torch.Tensor | None = None) -> torch.Tensor:
        norm, level = parts
        scale = norm / self.levels
        return level.float().mul_(scale) if out is None else torch.mul(level, scale, out=out)

    def payload_bytes(self, numel: int, shape=None) -> int:
        return 4 + numel * self.dtype.itemsize


class TernGrad(Compressor):
    """TernGrad: x_i becomes max|x| * sign(x_i) with probability |x_i| / max|x|, else 0; sent as 2
    bits per element (non-zero, negative) and the scale. Unbiased; |x_i - x'_i| <= max|x|."""

    def compress(self, x: torch.Tensor) -> Payload:
        flat = x.reshape(-1)
        scale = flat.aminmax() if flat.numel() else (torch.zeros(()), torch.zeros(()))
        scale = torch.maximum(-scale[0], scale[1]).reshape(1)
        prob = flat.abs().div_(scale) if scale.item() > 0 else torch.zeros_like(flat)
        keep = self.uniform(flat.numel()) < prob
        return Payload((scale, bits.pack(keep, flat < 0)), flat.numel())

    def decompress(self, parts: tuple, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        scale, packed = parts            # codes: 0b10 = +scale, 0b11 = -scale, 0b0x = 0
        return bits.decode(packed, numel, torch.cat([torch.zeros(2), scale, -scale]), out)

    def payload_bytes(self, numel: int, shape=None) -> int:
        return 4 + bits.packed_bytes(numel, width=2)
