"""Bit packing for sign and ternary payloads: `width` bits per element on the wire (numpy.packbits
is one vectorized pass; torch has no packbits), and decoding straight from the packed bytes through a
256-entry table (one numpy.take: 5-10x faster over 25M elements than unpacking, then mapping codes
to values)."""
from __future__ import annotations

import numpy as np
import torch

_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)).reshape(256, 8)   # most significant first


def pack(*planes: torch.Tensor) -> torch.Tensor:
    """Bool tensors of one length as uint8: element i's code is its bits in the planes, the first
    plane most significant; 8 / len(planes) elements per byte, the last byte zero-padded."""
    if len(planes) == 1:
        return torch.from_numpy(np.packbits(planes[0].reshape(-1).numpy()))
    interleaved = np.empty(len(planes) * planes[0].numel(), dtype=np.bool_)
    for i, plane in enumerate(planes):     # strided numpy copies: 2x faster than torch.stack
        interleaved[i::len(planes)] = plane.reshape(-1).numpy()
    return torch.from_numpy(np.packbits(interleaved))


def unpack(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` bits of `packed` (one plane) as a bool tensor."""
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=count).view(np.bool_))


def decode(packed: torch.Tensor, count: int, levels: torch.Tensor) -> torch.Tensor:
    """float32 values of the first `count` elements packed by `pack`: element i is levels[code i];
    len(levels) is 2 (one plane) or 4 (two planes)."""
    width = {2: 1, 4: 2}[levels.numel()]
    codes = (_BYTE_BITS.reshape(256, 8 // width, width) * (1 << np.arange(width)[::-1])).sum(axis=2)
    table = levels.to(torch.float32).numpy()[codes]
    return torch.from_numpy(np.take(table, packed.numpy(), axis=0).reshape(-1)[:count])


def packed_bytes(count: int, width: int = 1) -> int:
    return (count * width + 7) // 8
