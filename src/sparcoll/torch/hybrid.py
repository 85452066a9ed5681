"""Poseidon's hybrid communication choice, per tensor, by the bytes each worker sends per step.

For an M x N fully connected layer with P workers (Zhang et al., ATC 2017), a ring allreduce or a
sharded parameter server moves 2 MN (P - 1) / P floats out of each worker; sufficient-factor
broadcasting (SFB) sends the layer's factors, K (M + N) floats for a batch of K rows (batch x tokens),
to each of the P - 1 others. SFB wins when K P (M + N) < 2 M N (the paper's rule; a 4096 x 21841
layer with P = 4 crosses over at K ~ 1724). The counts here are our collectives' own: gloo's ring
allreduce, gloo's ring allgather for SFB's factors (after a gather of their lengths), and sparcoll's
sparse AllReduce, which sends a worker's non-zero blocks to their aggregators and the union's blocks of
its own shard back, each block with a 4-byte index.

Bytes alone would give a small layer SFB for a few kilobytes saved, a collective of its own where its
ring gradient would have shared a bucket with others; so the choice also charges each strategy
COLLECTIVE_BYTES for every collective it needs of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

ITEMSIZE = 4            # float32
LENGTH_BYTES = 8        # one int64 length per part in a variable-size allgather
COLLECTIVE_BYTES = 256 << 10    # a collective's fixed cost, as the bytes a link moves meanwhile: 2 ms
                        # at 1 Gbit/s (a 4 KB gloo allreduce took 5 ms among 4 processes on 2 cores
                        # there). Bytes alone gave gpt tiny's 16 x 64 layers SFB: DataParallel ran
                        # 0.26-0.33x DDP on loopback, 0.53-0.74x with this charge
RING, PS, SPARSE, SFB = "ring", "ps", "sparse", "sfb"


@dataclass(frozen=True)
class Tensor:
    """What the model needs of one gradient: its shape as the (M, N) matrix of a linear layer (or
    numel elements otherwise), whether SFB applies, and the density its blocks had last step."""
    numel: int
    linear: tuple[int, int] | None = None     # (M, N) = (out_features, in_features)
    bias: bool = False                         # the layer's bias travels with SFB's factors
    density: float = 1.0                       # block density of the reduced gradient, last step


def sent_bytes(strategy: str, t: Tensor, workers: int, rows: int = 0, block_size: int = 256) -> float:
    """Bytes one worker sends per step for `t` under `strategy` (rows: K, for SFB)."""
    p = workers
    if p == 1:
        return 0.0
    if strategy in (RING, PS):
        return 2 * t.numel * (p - 1) / p * ITEMSIZE
    if strategy == SPARSE:
        blocks = -(-t.numel // block_size)
        local = min(1.0, t.density)
        union = 1 - (1 - local) ** p if local < 1 else 1.0
        return (local + union) * blocks * (p - 1) / p * (block_size * ITEMSIZE + 4)
    if strategy == SFB:
        if t.linear is None:
            raise ValueError("SFB applies to linear layers only")
        m, n = t.linear
        return (p - 1) * (rows * (m + n) * ITEMSIZE + 2 * LENGTH_BYTES)
    raise ValueError(f"unknown strategy {strategy!r}")


def own_collectives(strategy: str, ring_shared: bool) -> int:
    """Collectives a tensor needs of its own under `strategy`: SFB two (the factors' lengths, then the
    factors), the sparse AllReduce one, the ring none where the gradient shares a bucket."""
    if strategy == RING:
        return 0 if ring_shared else 1
    return 2 if strategy == SFB else 1


def choose(t: Tensor, workers: int, rows: float, sparse: bool, block_size: int = 256,
           ring_shared: bool = False) -> str:
    """The cheapest strategy among those that apply (SFB for linear layers, the sparse AllReduce when
    a communicator is there): the bytes it sends, and COLLECTIVE_BYTES for each collective of its
    own (ring_shared: the ring's gradient would share a bucket); ties go to the ring."""
    options = [RING] + ([SFB] if t.linear is not None and rows > 0 else []) + ([SPARSE] if sparse else [])
    return min(options, key=lambda s: (sent_bytes(s, t, workers, rows, block_size)
                                       + COLLECTIVE_BYTES * own_collectives(s, ring_shared), s != RING))


def may_beat_ring(strategy: str, t: Tensor, workers: int, ring_shared: bool = False,
                  block_size: int = 256) -> bool:
    """Whether `strategy` (SFB or the sparse AllReduce) would beat the ring for `t` at some batch (K
    rows) or some density. Its bytes grow with both, so it is enough that they, at no rows and no
    non-zero block (SFB's lengths alone; nothing), and its collectives' charges cost less than the
    ring. Where they do not (a small tensor: its ring gradient saves the charges), neither the rows
    nor the density of `t` ever change its choice."""
    if workers < 2 or (strategy == SFB and t.linear is None):
        return False
    best = Tensor(t.numel, t.linear, t.bias, density=0.0)
    at_best = sent_bytes(strategy, best, workers, 0, block_size) \
        + COLLECTIVE_BYTES * own_collectives(strategy, ring_shared)
    return at_best < sent_bytes(RING, t, workers) + COLLECTIVE_BYTES * own_collectives(RING, ring_shared)


def sfb_crossover(m: int, n: int, workers: int) -> float:
    """The K below which SFB sends fewer floats than a ring or parameter server: 2MN / (P (M + N))."""
    return 2 * m * n / (workers * (m + n))
