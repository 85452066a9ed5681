"""The allreduce algorithms under test, as a registry: (name, input kind) -> Algorithm.

Every algorithm is an in-place sum over the default torch.distributed (gloo) group, split in three so the
harness times only the collective:
- prepare(ctx, inputs): outside the timed region, a fresh payload for one repetition (from the worker's
  untouched input: every allreduce here overwrites its payload);
- run(ctx, payload): the timed allreduce;
- result(ctx, payload): outside, the payload's sum as a flat dense tensor, for the correctness check.

`--algos NAME` selects every variant registered under NAME, e.g. agsparse from a dense tensor and from a
COO tensor. A new variant (e.g. sparcoll from COO) is one more `register(Algorithm(...))`.

"sparcoll" is what a user gets by default (algorithm "auto": a dense or tiny tensor may go through gloo's
ring, see sparcoll.algorithm); "sparse" is sparcoll forced onto its sparse AllReduce
(SPARCOLL_ALGORITHM=sparse), so the two are never mistaken for one another.

Parameter server ("ps"): sparcoll.torch.ps, the sharded parameter server colocated with the workers
(as Poseidon's) that sparcoll.torch.DataParallel also offers, with its receive buffers reused here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from sparcoll.algorithm import LOOK_EVERY, TRIALS
from sparcoll.blocks import nonzero_mask
from sparcoll.compress.channel import block_rows
from sparcoll.torch import ps



@dataclass(frozen=True)
class Inputs:
    """One worker's input. Never modified: payloads are copies."""
    dense: torch.Tensor    # flat float32
    indices: torch.Tensor  # sorted int64 ids of the non-zero blocks
    values: torch.Tensor   # (len(indices), block_size)


@dataclass
class Context:
    """What an algorithm may use besides its payload: the group, geometry, reusable buffers."""
    rank: int
    world: int
    numel: int
    block_size: int
    comms: dict = field(default_factory=dict)   # sparcoll Communicators by algorithm mode ("auto", ...)
    outputs: dict = field(default_factory=dict)   # results of algorithms that are not in place
    _buffers: dict = field(default_factory=dict)

    @property
    def nblocks(self) -> int:
        return self.numel // self.block_size

    def buffer(self, name: str, numel: int) -> torch.Tensor:
        """A float32 buffer reused across repetitions (a fresh 64 MB allocation costs page faults)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=torch.float32)
        return buf


DEFAULT_WARMUP = 2
# sparcoll's automatic choice after a change of density (the bench's next point): up to LOOK_EVERY - 1
# collectives before it looks at a result's density again, then TRIALS timed on each path (the look's
# own collective the first) and the one that shares the times. Fewer warm-ups leave its sparse-path
# trials in the timed repetitions (2 workers on loopback, 16M floats at 100% after 1%, 7 warm-ups, three
# runs: the first 3 of 10 took 68-108 ms, 8 of the 9 over 86; the other 7 took 46-73).
SETTLING_WARMUP = LOOK_EVERY + 2 * TRIALS


@dataclass(frozen=True)
class Algorithm:
    name: str
    input: str  # "dense" or "coo": what the timed region starts from (and ends with)
    prepare: Callable[[Context, Inputs], Any]
    run: Callable[[Context, Any], None]
    result: Callable[[Context, Any], torch.Tensor]
    # Cumulative (bytes sent, bytes received) by this algorithm's own transport, when it counts them.
    counters: Callable[[Context], tuple[int, int]] | None = None
    communicator: str | None = None     # the sparcoll algorithm mode of the Communicator it runs on

    @property
    def needs_communicator(self) -> bool:
        return self.communicator is not None

    @property
    def label(self) -> str:
        return self.name if self.input == "dense" else f"{self.name} ({self.input})"

    def warmup(self, given: int | None) -> int:
        """Untimed repetitions at each point: as given, else enough for what the algorithm adapts."""
        if given is not None:
            return given
        return SETTLING_WARMUP if self.communicator == "auto" else DEFAULT_WARMUP


REGISTRY: dict[tuple[str, str], Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    REGISTRY[(algo.name, algo.input)] = algo
    return algo


def select(names: list[str]) -> list[Algorithm]:
    """Every registered variant of each name, in the order given."""
    known = list(dict.fromkeys(name for name, _ in REGISTRY))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [a for n in names for a in REGISTRY.values() if a.name == n]


# ---- payloads -----------------------------------------------------------------------------------

def dense_payload(ctx: Context, inputs: Inputs) -> torch.Tensor:
    work = ctx.buffer("dense", ctx.numel)
    work.copy_(inputs.dense)
    return work


def dense_result(ctx: Context, payload: torch.Tensor) -> torch.Tensor:
    return payload


def coo_payload(ctx: Context, inputs: Inputs) -> torch.Tensor:
    """Row-sparse COO: rows are blocks, shape (nblocks, block_size), one index per non-zero block."""
    return torch.sparse_coo_tensor(inputs.indices.unsqueeze(0).clone(), inputs.values.clone(),
                                   (ctx.nblocks, ctx.block_size), is_coalesced=True,
                                   check_invariants=False)


def coo_result(ctx: Context, payload: torch.Tensor) -> torch.Tensor:
    return payload.to_dense().view(-1)


# ---- algorithms ---------------------------------------------------------------------------------

def ring_allreduce(ctx: Context, tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def agsparse_from_dense(ctx: Context, tensor: torch.Tensor) -> None:
    """Dense in, dense out: the block scan, the COO build and the scatter back are part of the cost.
    The result's rows cover every block this rank had non-zero, so no block needs zeroing."""
    rows = tensor.view(ctx.nblocks, ctx.block_size)
    indices = torch.from_numpy(np.flatnonzero(nonzero_mask(rows)))
    coo = block_rows(indices, rows.index_select(0, indices), ctx.nblocks)
    dist.all_reduce(coo)
    rows.index_copy_(0, coo._indices()[0], coo._values())


def agsparse_from_coo(ctx: Context, coo: torch.Tensor) -> None:
    dist.all_reduce(coo)


def ps_allreduce(ctx: Context, tensor: torch.Tensor) -> None:
    shard = -(-tensor.numel() // ctx.world)
    ps.ps_allreduce(tensor, scratch=[ctx.buffer(f"ps{r}", shard) for r in range(ctx.world - 1)])


def sparcoll_variants(name: str, mode: str) -> None:
    """Register sparcoll on a Communicator of algorithm `mode`, from a dense tensor and from COO (COO
    in, COO out, as nn.Embedding(sparse=True) gradients are: no scan, nothing densified)."""
    def allreduce(ctx: Context, tensor: torch.Tensor) -> None:
        ctx.comms[mode].allreduce(tensor)

    def from_coo(ctx: Context, coo: torch.Tensor) -> None:
        ctx.outputs[name] = ctx.comms[mode].allreduce_coo(coo)

    def coo_result(ctx: Context, payload: torch.Tensor) -> torch.Tensor:
        return ctx.outputs.pop(name).to_dense().view(-1)

    def counters(ctx: Context) -> tuple[int, int]:
        """The worker's traffic plus its colocated aggregator's (both cross this host's link) plus,
        for what ran on the ring's paths, the bytes a ring moves per rank (2 (n-1)/n of the tensor;
        a call summed through the star moves as much on average over the ranks, rank 0 more)."""
        comm = ctx.comms[mode]
        worker, aggregator = comm.stats, comm.aggregator_stats
        ring = int(worker.ring_bytes * 2 * (ctx.world - 1) / ctx.world)
        return (worker.bytes_sent + aggregator.bytes_sent + ring,
                worker.bytes_received + aggregator.bytes_received + ring)

    register(Algorithm(name, "dense", dense_payload, allreduce, dense_result, counters=counters,
                       communicator=mode))
    register(Algorithm(name, "coo", coo_payload, from_coo, coo_result, counters=counters,
                       communicator=mode))


sparcoll_variants("sparcoll", "auto")
sparcoll_variants("sparse", "sparse")
register(Algorithm("ring", "dense", dense_payload, ring_allreduce, dense_result))
register(Algorithm("agsparse", "dense", dense_payload, agsparse_from_dense, dense_result))
register(Algorithm("agsparse", "coo", coo_payload, agsparse_from_coo, coo_result))
register(Algorithm("ps", "dense", dense_payload, ps_allreduce, dense_result))
