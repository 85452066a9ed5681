"""Bit packing for sign and ternary payloads: `width` bits per element on the wire (numpy.packbits
is one vectorized pass; torch has no packbits), and decoding straight from the packed bytes through a
256-entry table (one numpy.take: 5-10x faster over 25M elements than unpacking, then mapping codes
to values), into a caller's tensor where it has one."""
from __future__ import annotations

import numpy as np
import torch

_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)).reshape(256, 8)   # most significant first
# per code width in bits (1 or 2), each byte's codes, first element first: made once, where building
# them in every decode took about 20 us, a third of efsignsgd's compression of a 384-element tensor
_CODES = {width: (_BYTE_BITS.reshape(256, 8 // width, width) * (1 << np.arange(width)[::-1])).sum(axis=2)
          for width in (1, 2)}


def pack(*planes: torch.Tensor) -> torch.Tensor:
    """Bool tensors of one length as uint8: element i's code is its bits in the planes, the first
    plane most significant; 8 / len(planes) elements per byte, the last byte zero-padded."""
    if len(planes) == 1:
        return torch.from_numpy(np.packbits(planes[0].reshape(-1).numpy()))
    interleaved = np.empty(len(planes) * planes[0].numel(), dtype=np.bool_)
    for i, plane in enumerate(planes):     # strided numpy copies: 2x faster than torch.stack
        interleaved[i::len(planes)] = plane.reshape(-1).numpy()
    return torch.from_numpy(np.packbits(interleaved))


def decode(packed: torch.Tensor, count: int, levels: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values of the first `count` elements packed by `pack`: element i is levels[code i];
    len(levels) is 2 (one plane) or 4 (two planes). Written into `out` (flat float32, `count`
    elements) when given: no temporary, and the last byte's padding is left out."""
    width = {2: 1, 4: 2}[levels.numel()]
    per = 8 // width                        # elements per byte
    table = levels.to(torch.float32).numpy()[_CODES[width]]
    if out is None:
        return torch.from_numpy(np.take(table, packed.numpy(), axis=0).reshape(-1)[:count])
    whole, values, data = count // per, out.numpy(), packed.numpy()
    # mode="clip" (no byte is out of the table's range): the default "raise" buffers `out`
    np.take(table, data[:whole], axis=0, out=values[:whole * per].reshape(whole, per), mode="clip")
    values[whole * per:] = table[data[whole], :count - whole * per] if count > whole * per else 0
    return out


def packed_bytes(count: int, width: int = 1) -> int:
    return (count * width + 7) // 8
