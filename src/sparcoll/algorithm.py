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
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

TINY_NUMEL = 1024       # at most this many elements: one ring round (ring.py) beats any protocol
RING_DENSITY = 0.75     # colocated, a result at least this dense sends its kind through the ring
HYSTERESIS = 0.8        # ... and one below RING_DENSITY * HYSTERESIS sends it back
SAMPLE_BLOCKS = 512     # blocks of a result looked at to estimate its density


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
    block_size: int
    dedicated: bool
    ring_density: float = RING_DENSITY
    _dense: dict[Kind, bool] = field(default_factory=dict)      # kind -> its last result was dense
    _samples: dict[Kind, torch.Tensor] = field(default_factory=dict)

    def choose(self, kind: Kind, coo: bool) -> Algorithm:
        """SPARSE or RING for the next collective of `kind`."""
        if coo or self.mode is Algorithm.SPARSE:
            return Algorithm.SPARSE
        if self.mode is Algorithm.RING or kind[0] <= TINY_NUMEL or self._dense.get(kind, False):
            return Algorithm.RING
        return Algorithm.SPARSE

    def learn(self, kind: Kind, result: torch.Tensor) -> None:
        """Note how dense the result of a collective of `kind` was (only where it can matter)."""
        if self.mode is not Algorithm.AUTO or self.dedicated or kind[0] <= TINY_NUMEL \
                or result.layout != torch.strided:
            return
        density = self.density(kind, result)
        was_dense = self._dense.get(kind, False)
        self._dense[kind] = density >= self.ring_density * (HYSTERESIS if was_dense else 1.0)

    def density(self, kind: Kind, result: torch.Tensor) -> float:
        """Share of non-zero blocks among SAMPLE_BLOCKS drawn once per kind from a generator seeded
        by the kind: the same blocks, hence the same estimate, on every rank."""
        flat = result.detach().reshape(-1)
        full = flat.numel() // self.block_size
        if full == 0:
            return float(bool(flat.count_nonzero()))
        blocks = flat[:full * self.block_size].view(full, self.block_size)
        if full > SAMPLE_BLOCKS:
            sample = self._samples.get(kind)
            if sample is None:
                seed = (kind[0] * 31 + kind[1]) * 31 + kind[2]
                generator = torch.Generator().manual_seed(seed)
                sample = torch.randperm(full, generator=generator)[:SAMPLE_BLOCKS]
                self._samples[kind] = sample
            blocks = blocks[sample]
        return blocks.ne(0).any(dim=1).float().mean().item()
