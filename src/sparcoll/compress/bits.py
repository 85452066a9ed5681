"""Bit packing for sign and ternary payloads: one bit per element on the wire (numpy.packbits is one
vectorized pass; torch has no packbits)."""
from __future__ import annotations

import numpy as np
import torch


def pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, 8 elements per byte (the last byte zero-padded)."""
    return torch.from_numpy(np.packbits(mask.reshape(-1).numpy()))


def unpack(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` bits of `packed` as a bool tensor."""
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=count).view(np.bool_))


def packed_bytes(count: int) -> int:
    return (count + 7) // 8
