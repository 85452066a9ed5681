"""Which algorithm runs a collective: the sparse AllReduce, or gloo's ring where it is faster.

The sparse AllReduce wins when blocks are zero; on dense data its scan and per-block bookkeeping cost
CPU the ring does not spend (it loses on loopback), while on a slow link it may still win (with
dedicated aggregators no worker link carries more than its tensor each way). So with "auto" (the
default) the choice is measured, per kind of collective ("kind": the same number of elements, dtype
and op, as a DDP bucket each step):
  - a tiny tensor (at most TINY_NUMEL elements) goes through the ring, in one round (ring.py);
  - a larger kind's collectives go the sparse way while its last result was sparse (less than
    CANDIDATE_DENSITY of its blocks non-zero): there the sparse path wins everywhere we measured
    (once a kind is settled on gloo, or clearly sparse, "last" is the last of every LOOK_EVERY
    results);
  - once a result is dense, or whatever its density if the kind is small enough to gather (there
    the sparse path's fixed cost, a message to every aggregator and back, can exceed what zero
    blocks save: 64K floats at 10% took 2.2 ms on the sparse path where gloo's ring took 0.7, on
    2 ranks on loopback), the kind is timed on each path: TRIALS collectives on the sparse path,
    TRIALS on the ring; a kind small enough to gather (at most GATHER_ELEMENTS elements over all
    ranks) SMALL_TRIALS on each of those and on GATHER, the data sent to rank 0 in the call's
    check round and summed there (ring.py: one round through the star where gloo's ring takes
    2 (world - 1) steps, for world - 1 times the bytes at rank 0: it wins where steps cost more
    than bytes, as on a busy machine or a fast link). Then one more on the
    last of them, whose check round (ring.py) carries every rank's best time on each path, so
    every rank learns the same averages; the faster of ring and gather keeps the kind while it
    stays dense (a small kind: at any density) unless the sparse path was clearly faster (by
    SPARSE_MARGIN: on dense data the sparse path's scan and bookkeeping take CPU from the training
    around it, and on loopback the two are within noise of each other).
    The best of a path's trials discounts a kind's slower first collectives; a small kind's take
    their median, which discounts its first too: one short collective may fall in a lucky moment
    whole (4 workers at 1 Gbit/s under a 128 KiB token bucket, 64K floats at 1%: gloo's ring took
    3.8 ms at its 10th percentile and 8.1 at its median, the sparse path 4.0 and 4.7, and the best
    of 4 trials kept a gloo path). After RETRY_EVERY
    collectives on the path chosen, the kind is timed anew: a wrong choice (a few trials on busy
    cores can make one) does not last.
COO tensors go the sparse way, but for those small enough to gather as one dense buffer (their
values and a mark per entry, densified.py): their kind is the buffer's, timed on every path like a
small dense kind's (the sparse path takes the COO tensor itself). Every rank must choose alike
without a message of its own:
the choice depends only on the ranks' calls, on earlier results (identical on every rank), and on
times averaged in a ring round (identical too). The engine runs one collective at a time, so what a
choice depends on is complete before the next collective starts.

"sparse" and "ring" force one algorithm (a COO tensor then goes the sparse way); gather is
never forced (it is the ring's variant for small kinds).

The sparse path's block size is chosen per collective too, at most the communicator's (256 by
default): a block whose one row is touched ships all its rows, so an embedding table of 32-wide rows
sent in 256-element blocks moves up to 8 times what it must. A COO tensor's blocks are its entries
(`entry_block_size`: its rows, or a divisor of a row wider than a block). A dense tensor's kind takes the block size
that would have cost the least for its last result, looked at in 16, 32, ... element pieces of the
same sample (of every LOOK_EVERY results once it is clearly sparse): its non-zero blocks' data plus
BLOCK_COST bytes a block (the index, and the work of handling one more block); the largest within
SLACK of the best, and then the same while it stays
within SLACK (the estimate moves with the rows a sample holds). Identical results give identical
choices here too.
"""
from __future__ import annotations

import enum
import functools
import statistics
from dataclasses import dataclass, field

import numpy as np
import torch

from . import wire
from .blocks import entry_width, nonzero_mask

TINY_NUMEL = 1024       # at most this many elements: one ring round (ring.py), no trials
CANDIDATE_DENSITY = 0.4  # a result at least this dense (at its block size) has its kind try the ring
TRIALS = 3              # collectives timed on each path before a dense kind's path is chosen: with
                        # 2, a dense 16M kind over 2 ranks on loopback kept the sparse path in 2 of
                        # 37 runs (57.6 ms a call against gloo's 41.4) when a slow patch of the
                        # shared cores fell on the ring's trials
SMALL_TRIALS = 4        # the same for a kind small enough to gather: they cost little, and the
                        # later ones run as the kind's steady state does (ring.py: expected calls)
SPARSE_MARGIN = 0.9     # a dense kind stays sparse only if that was this much faster than the ring
LOOK_EVERY = 8          # a kind settled on gloo, or clearly sparse, has its density looked at every
                        # this many collectives (each while its paths are timed): the look is on
                        # each collective's critical path
                        # (0.6 ms median among 4 ranks on 2 cores after 4M-float ring calls; 0.0-0.5
                        # ms, 0.24 on average, of 8.5 ms sparse calls at 1% with 2 ranks on loopback)
                        # and there only a change far from what it last saw matters
CLEARLY_SPARSE = 0.2    # a kind whose last looked-at result had less than this share of non-zero
                        # blocks is clearly sparse: half the share that would have it try the ring
SAMPLE_BLOCKS = 256     # blocks of a result looked at to estimate its density
MIN_BLOCK = 16          # a dense tensor's smallest block: below it, indices outweigh the data
SLACK = 0.1             # a smaller block size must save more than this share of the cost
BLOCK_COST = 64         # bytes a block costs besides its data: its 4-byte index, and the CPU of
                        # scanning, sending, summing and placing one more block. narrowrec on
                        # loopback, 4 workers: a bucket whose 32-wide rows straddle 32-element
                        # blocks took 16-element ones (25% fewer bytes, 1.5 times the blocks) at
                        # the index's 4 bytes alone, and its steps took 3 ms (8%) more than with 32
GATHER_ELEMENTS = 1 << 18   # a kind of at most this many elements times the world may be gathered
RETRY_EVERY = 256       # a dense kind's paths are timed anew after this many collectives on the one
                        # chosen: 3 trials a path decide wrongly at times on busy cores (4M floats
                        # over 2 ranks on loopback: the sparse path, 1.3x slower there, kept the kind
                        # in 1 of 16 and 2 of 6 one-off runs), and a wrong choice must not last


class Algorithm(enum.Enum):
    AUTO = "auto"
    SPARSE = "sparse"
    RING = "ring"
    GATHER = "gather"           # a path the chooser may take, not a mode a user sets

    @classmethod
    def parse(cls, value, name: str = "algorithm") -> "Algorithm":
        modes = (cls.AUTO, cls.SPARSE, cls.RING)
        try:
            mode = value if isinstance(value, cls) else cls(str(value).strip().lower())
        except ValueError:
            mode = None
        if mode not in modes:
            raise ValueError(f"{name} must be one of {', '.join(a.value for a in modes)}, "
                             f"got {value!r}")
        return mode

    @property
    def on_gloo(self) -> bool:
        """Runs on gloo's groups (ring.py), with a check round."""
        return self in (Algorithm.RING, Algorithm.GATHER)


Kind = tuple[int, int, int]     # (numel, dtype code, op code; the op with wire.COO_OP for a COO tensor)


@dataclass
class KindState:
    block: int                                  # elements per block on the sparse path
    dense: bool = False                         # its last result was at least CANDIDATE_DENSITY
    times: dict = field(default_factory=dict)   # this rank's times per Algorithm since it is timed
    chosen: Algorithm | None = None             # the faster path on average, once known
    settled: int = 0                            # collectives since `chosen` was
    unlooked: int = 0                           # collectives since its density was looked at
    share: float = 1.0                          # the share of non-zero blocks its last look found

    def next_trial(self, paths: tuple[Algorithm, ...], trials: int) -> Algorithm:
        """The path to time next among `paths` (the last also for the collective that shares the
        times)."""
        return next((p for p in paths if len(self.times.get(p, ())) < trials), paths[-1])


@dataclass
class Chooser:
    """The choice for every collective of one communicator, and what it learned from results."""
    mode: Algorithm
    largest_block: int              # the communicator's block size
    world: int
    _kinds: dict[Kind, KindState] = field(default_factory=dict)
    _samples: dict[Kind, torch.Tensor] = field(default_factory=dict)

    def choose(self, kind: Kind, coo: bool) -> Algorithm:
        """SPARSE, RING or GATHER for the next collective of `kind`."""
        if coo or self.mode is Algorithm.SPARSE:
            return Algorithm.SPARSE
        if self.mode is Algorithm.RING or kind[0] <= TINY_NUMEL:
            return Algorithm.RING
        state = self._kinds.get(kind)
        if state is None or not self._timed(kind, state):
            return Algorithm.SPARSE
        return state.chosen or state.next_trial(*self.paths(kind))

    def _timed(self, kind: Kind, state: KindState) -> bool:
        """Whether a kind's paths are timed: its last result was dense, or it is small enough to
        gather (then at any density)."""
        return state.dense or self.timed_at_any_density(kind)

    def gatherable(self, kind: Kind) -> bool:
        """Whether a kind is small enough to gather (at most GATHER_ELEMENTS over all ranks)."""
        return kind[0] * self.world <= GATHER_ELEMENTS

    def paths(self, kind: Kind) -> tuple[tuple[Algorithm, ...], int]:
        """The paths a timed kind is timed on, in order, and how many times each."""
        if self.gatherable(kind):
            return (Algorithm.SPARSE, Algorithm.RING, Algorithm.GATHER), SMALL_TRIALS
        return (Algorithm.SPARSE, Algorithm.RING), TRIALS

    def block_size(self, kind: Kind, tensor: torch.Tensor) -> int:
        """Elements per block for the next sparse-path collective of `kind` on `tensor`."""
        if tensor.layout == torch.sparse_coo:
            return entry_block_size(entry_width(tensor), self.largest_block, tensor.numel())
        state = self._kinds.get(kind)
        return self.largest_block if state is None else state.block

    def to_share(self, kind: Kind) -> list[float] | None:
        """For a collective on gloo of `kind` that should end its trials: this rank's best times on
        the sparse path, the ring and gather (0 where not timed), to be averaged over the ranks;
        else None."""
        state = self._kinds.get(kind)
        if state is None or not self._timed(kind, state) or state.chosen is not None:
            return None
        paths, trials = self.paths(kind)
        if any(len(state.times.get(p, ())) < trials for p in paths):
            return None
        typical = statistics.median if self.gatherable(kind) else min
        return [typical(state.times[p]) if p in paths else 0.0
                for p in (Algorithm.SPARSE, Algorithm.RING, Algorithm.GATHER)]

    def shared(self, kind: Kind, averages: list[float]) -> None:
        """Every rank's averages of what `to_share` gave: the path that keeps the kind."""
        sparse_s, ring_s, gather_s = averages
        gloo, gloo_s = Algorithm.RING, ring_s
        if Algorithm.GATHER in self.paths(kind)[0] and gather_s < ring_s:
            gloo, gloo_s = Algorithm.GATHER, gather_s
        clearly_faster = sparse_s < gloo_s * SPARSE_MARGIN
        self._kinds[kind].chosen = Algorithm.SPARSE if clearly_faster else gloo

    def learn(self, kind: Kind, result: torch.Tensor, algorithm: Algorithm,
              seconds: float) -> None:
        """Note how long a collective of `kind` took on `algorithm`, how dense its result was and
        at which granularity."""
        if self.mode is Algorithm.RING or kind[0] <= TINY_NUMEL or result.layout != torch.strided:
            return
        state = self._kinds.get(kind)
        if state is not None:
            self._settle(state)
        in_trials = state is not None and state.chosen is None and self._timed(kind, state)
        if state is not None and not in_trials and (state.chosen is not None and state.chosen.on_gloo
                                                    or state.share < CLEARLY_SPARSE):
            state.unlooked += 1                 # the same count on every rank
            if state.unlooked < LOOK_EVERY:
                return
            state.unlooked = 0
        shares = self.densities(kind, result)
        costs = {b: share * (1 + BLOCK_COST / (b * result.element_size()))
                 for b, share in shares.items()}
        near_best = {b for b, cost in costs.items() if cost <= min(costs.values()) * (1 + SLACK)}
        state = self._kinds.get(kind)
        if state is None:
            state = self._kinds[kind] = KindState(max(near_best))
        elif state.block not in near_best:  # else it stays: the estimates move with the sample
            state.block = max(near_best)
        block = state.block
        state.share = shares[block]
        dense = self.mode is Algorithm.AUTO and shares[block] >= CANDIDATE_DENSITY
        if dense != state.dense:
            state.dense = dense
            if not self.gatherable(kind):   # times measured on other data say nothing about this;
                # a small kind's paths are timed at any density (a density near CANDIDATE_DENSITY
                # would otherwise start its trials over and over)
                state.times, state.chosen, state.settled, state.unlooked = {}, None, 0, 0
        if self._timed(kind, state) and state.chosen is None:
            state.times.setdefault(algorithm, []).append(seconds)

    def timed_at_any_density(self, kind: Kind) -> bool:
        """Whether a kind's paths are timed whatever its density: with "auto", where it is small
        enough to gather. A COO collective whose dense buffer (densified.py) has such a kind
        densifies: the buffer takes gloo's paths."""
        return self.mode is Algorithm.AUTO and self.gatherable(kind)

    def learn_time(self, kind: Kind, algorithm: Algorithm, seconds: float) -> None:
        """Note how long a COO collective that densifies (its buffer's `kind`) took on `algorithm`:
        its paths are timed whatever its density, so there is no density to learn."""
        if kind[0] <= TINY_NUMEL:       # always the ring, in one round: nothing to time
            return
        state = self._kinds.get(kind)
        if state is None:
            state = self._kinds[kind] = KindState(self.largest_block)
        else:
            self._settle(state)
        if state.chosen is None:
            state.times.setdefault(algorithm, []).append(seconds)

    @staticmethod
    def _settle(state: KindState) -> None:
        """Count one more collective on a chosen path: after RETRY_EVERY the paths are timed anew."""
        if state.chosen is not None:
            state.settled += 1                  # the same count on every rank
            if state.settled >= RETRY_EVERY:
                state.times, state.chosen, state.settled = {}, None, 0

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
        sizes = candidate_block_sizes(size)         # largest first, each half the one before
        # Sub-blocks are marked only in the blocks that hold something (the scan's one pass finds
        # them): a sparse result has few, and each mark below is a small numpy step.
        nonzero = nonzero_mask(blocks)
        touched = blocks if nonzero.all() else blocks[torch.from_numpy(nonzero).to(blocks.device)]
        marks = touched.ne(0).cpu().numpy().reshape(len(touched), size // sizes[-1], sizes[-1]).any(axis=2)
        shares = {}
        for b in reversed(sizes):                   # pairs of marks of b are the marks of 2b
            shares[b] = int(np.count_nonzero(marks)) / (len(blocks) * (size // b))
            if b != size:
                marks = marks.reshape(len(marks), marks.shape[1] // 2, 2).any(axis=2)
        return shares


def candidate_block_sizes(largest: int) -> list[int]:
    """`largest` and its power-of-two divisors down to MIN_BLOCK."""
    sizes, b = [largest], largest
    while b % 2 == 0 and b // 2 >= MIN_BLOCK:
        b //= 2
        sizes.append(b)
    return sizes


@functools.lru_cache(maxsize=256)
def entry_block_size(width: int, largest: int, numel: int = 0) -> int:
    """Block size for a COO tensor of `numel` elements whose entries (rows) have `width`: blocks and
    entries tile, so that the result lists every entry some rank stored, as gloo's sum does. A block
    shared by entries cannot tell a stored entry whose sum is zero (a masked loss's row) from one
    nobody stored: it was not listed, and SparseAdam, which moves every listed row, trained apart from
    gloo (a review). The width itself, even below MIN_BLOCK (rows as blocks ran level with rows
    sharing blocks of 16, on ncf and deeplight); a wider entry in blocks of its largest divisor that
    fits in `largest` (down to 1: a prime width). Only a table that would take more blocks than the
    wire's block indices number has its rows share blocks: as few as fit, or blocks of `largest` for
    a wide row (2^35 one-wide rows were summed before, and must still be)."""
    block = max(width, 1) if width <= largest else next(b for b in range(largest, 0, -1) if width % b == 0)
    if -(-numel // block) <= wire.MAX_BLOCKS:
        return block
    if width >= largest:        # a wide row's small divisor (a prime width's 1) in a tall table
        return largest
    return min(largest // width, -(-numel // (width * wire.MAX_BLOCKS))) * width
