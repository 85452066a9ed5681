"""Which algorithm runs a collective: the sparse AllReduce, or gloo's ring for what it does better.

The sparse AllReduce wins when blocks are zero; a dense tensor gains nothing from its scan and
per-block bookkeeping, and a tiny one pays its round trip through the aggregators' threads. With
algorithm "auto" (the default) a rank sends
  - a tiny tensor (at most TINY_NUMEL elements) through the ring, in one round;
  - a tensor whose last result of the same kind was dense (at least `ring_density` of its blocks
    non-zero) through the ring, with colocated aggregators only: dedicated ones beat the ring even
    on dense data, since no worker's link carries more than its own tensor each way;
  - everything else, COO tensors and a kind's first collective included, through the sparse path.
"Of the same kind": the same number of elements, dtype and op (a DDP bucket each step). Every rank
must choose the same, without a message to agree: the choice depends only on the ranks' calls and
on earlier results, which are identical on every rank. The engine runs one collective at a time,
so the result a choice depends on is always complete. A kind switches back to the sparse path once
its result's density falls below `ring_density` * HYSTERESIS.

"sparse" and "ring" force one algorithm (a COO tensor always goes the sparse way).

The sparse path's block size is chosen per collective too, at most the communicator's (256 by
default): a block whose one row is touched ships all its rows, so an embedding table of 32-wide rows
sent in 256-element blocks moves up to 8 times what it must. A COO tensor's blocks are its entries
(`entry_block_size`: its rows, when narrower than a block). A dense tensor's kind takes the block size
that would have moved the fewest bytes (data and a 4-byte index per block) for its last result,
looked at in 16, 32, ... element pieces of the same sample; the largest within SLACK of the best, since
smaller blocks cost CPU per block. Identical results give identical choices here too.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

TINY_NUMEL = 1024       # at most this many elements: one ring round (ring.py) beats any protocol
RING_DENSITY = 0.75     # colocated, a result at least this dense sends its kind through the ring
HYSTERESIS = 0.8        # ... and one below RING_DENSITY * HYSTERESIS sends it back
SAMPLE_BLOCKS = 512     # blocks of a result looked at to estimate its density
MIN_BLOCK = 16          # the smallest block size chosen: below it, indices outweigh the data
SLACK = 0.1             # a smaller block size must save more than this share of the bytes
INDEX_BYTES = 4         # per block on the wire (wire.INDEX_BYTES)


class Algorithm(enum.Enum):
    AUTO = "auto"
    SPARSE = "sparse"
    RING = "ring"

    @classmethod
    def parse(cls, value, name: str = "algorithm") -> "Algorithm":
        try:
            return value if isinstance(value, cls) else cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"{name} must be one of {', '.join(a.value for a in cls)}, "
                             f"got {value!r}") from None


Kind = tuple[int, int, int]     # (numel, dtype code, op code)


@dataclass
class Chooser:
    """The choice for every collective of one communicator, and what it learned from results."""
    mode: Algorithm
    largest_block: int              # the communicator's block size
    dedicated: bool
    ring_density: float = RING_DENSITY
    _dense: dict[Kind, bool] = field(default_factory=dict)      # kind -> its last result was dense
    _samples: dict[Kind, torch.Tensor] = field(default_factory=dict)
    _blocks: dict[Kind, int] = field(default_factory=dict)      # kind -> its block size

    def choose(self, kind: Kind, coo: bool) -> Algorithm:
        """SPARSE or RING for the next collective of `kind`."""
        if coo or self.mode is Algorithm.SPARSE:
            return Algorithm.SPARSE
        if self.mode is Algorithm.RING or kind[0] <= TINY_NUMEL or self._dense.get(kind, False):
            return Algorithm.RING
        return Algorithm.SPARSE

    def block_size(self, kind: Kind, tensor: torch.Tensor) -> int:
        """Elements per block for the next sparse-path collective of `kind` on `tensor`."""
        if tensor.layout == torch.sparse_coo:
            return entry_block_size(math.prod(tensor.shape[tensor.sparse_dim():]),
                                    self.largest_block)
        return self._blocks.get(kind, self.largest_block)

    def learn(self, kind: Kind, result: torch.Tensor) -> None:
        """Note how dense the result of a collective of `kind` was, and at which granularity."""
        if self.mode is Algorithm.RING or kind[0] <= TINY_NUMEL or result.layout != torch.strided:
            return
        shares = self.densities(kind, result)
        density = shares[self.largest_block]
        costs = {b: share * (1 + INDEX_BYTES / (b * result.element_size()))
                 for b, share in shares.items()}
        best = min(costs.values())
        self._blocks[kind] = max(b for b, cost in costs.items() if cost <= best * (1 + SLACK))
        if self.mode is Algorithm.AUTO and not self.dedicated:
            was_dense = self._dense.get(kind, False)
            self._dense[kind] = density >= self.ring_density * (HYSTERESIS if was_dense else 1.0)

    def densities(self, kind: Kind, result: torch.Tensor) -> dict[int, float]:
        """Share of non-zero blocks for every candidate block size, among SAMPLE_BLOCKS blocks of
        the communicator's size drawn once per kind from a generator seeded by the kind: the same
        blocks, hence the same estimates, on every rank."""
        flat = result.detach().reshape(-1)
        size = self.largest_block
        full = flat.numel() // size
        if full == 0:
            return {size: float(bool(flat.count_nonzero()))}
        blocks = flat[:full * size].view(full, size)
        if full > SAMPLE_BLOCKS:
            sample = self._samples.get(kind)
            if sample is None:
                seed = (kind[0] * 31 + kind[1]) * 31 + kind[2]
                generator = torch.Generator().manual_seed(seed)
                sample = torch.randperm(full, generator=generator)[:SAMPLE_BLOCKS]
                self._samples[kind] = sample
            blocks = blocks[sample]
        nonzero = blocks.ne(0)
        return {b: nonzero.view(len(nonzero), size // b, b).any(dim=2).float().mean().item()
                for b in candidate_block_sizes(size)}


def candidate_block_sizes(largest: int) -> list[int]:
    """`largest` and its power-of-two divisors down to MIN_BLOCK."""
    sizes, b = [largest], largest
    while b % 2 == 0 and b // 2 >= MIN_BLOCK:
        b //= 2
        sizes.append(b)
    return sizes


def entry_block_size(width: int, largest: int) -> int:
    """Block size for a COO tensor whose entries (rows) have `width` elements: whole entries per
    block, one when it is at least MIN_BLOCK wide, as long as that fits in `largest`."""
    if width >= largest:
        return largest
    return min(largest, width * -(-MIN_BLOCK // width))
