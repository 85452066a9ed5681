"""A collective's state on the worker: its tensor seen as blocks, its streams, and where it is.

A collective moves through named states, changed only by `WorkerCollective`'s methods:
  QUEUED -> STREAMING    the engine starts it: scan, first sends
  STREAMING -> DRAINING  every range has its results; the own aggregator may still be sending peers
                         sums from the tensor (leases out on it, see lease.py)
  DRAINING -> DONE       every lease on the tensor is back
  QUEUED | STREAMING | DRAINING -> FAILED   an error, a peer's report, or the deadline
"""
from __future__ import annotations

import enum
import threading
import time

import torch

from . import wire
from .blocks import BlockTensor, CompactBlocks, SparseBlocks, StagedBlocks
from .errors import CollectiveTimeout
from .lease import Loans
from .lifecycle import Lifecycle
from .protocol import WorkerStream


class CollectiveState(enum.Enum):
    QUEUED = "queued"
    STREAMING = "streaming"
    DRAINING = "draining"
    DONE = "done"
    FAILED = "failed"


_MOVES = {
    CollectiveState.QUEUED: frozenset({CollectiveState.STREAMING, CollectiveState.FAILED}),
    CollectiveState.STREAMING: frozenset({CollectiveState.DRAINING, CollectiveState.FAILED}),
    CollectiveState.DRAINING: frozenset({CollectiveState.DONE, CollectiveState.FAILED}),
}


class WorkerCollective:
    """Worker-side state of one allreduce: of a dense tensor (in place) or of a sparse COO tensor."""

    def __init__(self, cid: int, tensor: torch.Tensor, kind: tuple, timeout: float, tag: int = 0):
        self.id = cid
        self.tensor = tensor            # the input; for a COO tensor, replaced by the result
        self.sparse = tensor.layout == torch.sparse_coo
        self.kind = kind                # (numel, dtype code, op code): what every rank must agree on,
        self.tag = tag                  # and the caller's tag (which tensor of that kind it is)
        self.descriptor: tuple | None = None    # the kind, its block size and the tag, set by start()
        self.timeout = timeout
        self.streams: dict[tuple[int, int], WorkerStream | None] = {}   # None: not started yet
        self.stream_locks: dict[tuple[int, int], threading.Lock] = {}
        self.blocks: BlockTensor | CompactBlocks | None = None
        self.lock = threading.Lock()
        self.state = Lifecycle(f"allreduce {cid}", CollectiveState.QUEUED, _MOVES)
        self.remaining = 0              # ranges still waiting for results
        self._finished: set[tuple[int, int]] = set()  # ranges whose last result's data is in
        self.settled: threading.Event | None = None    # left STREAMING; made by start()
        self.error: BaseException | None = None
        # The tensor lent to the own aggregator (it may read or sum into it, and send peers sums
        # from it) and to messages queued from it: the collective is DONE only once every lease is
        # back. And the tensor lent to the threads that place results in it (only waited for
        # after a failure: WorkerJob._take_back). Made by start(), as `settled`: only the sparse
        # path lends the tensor or waits, and a tiny call on gloo's paths paid for making them.
        self.loans: Loans | None = None
        self.writes: Loans | None = None

    def start(self, block_size: int, ranges: list) -> None:
        """QUEUED -> STREAMING with blocks of `block_size` (chosen for this collective): find the
        non-zero blocks (the stored entries of a COO tensor; a scan in place for a contiguous CPU
        tensor; a scan where it lives, then a copy of the non-zero blocks, otherwise) and make room
        for every range's stream."""
        numel, dtype, op = self.kind
        self.loans, self.writes, self.settled = Loans(), Loans(), threading.Event()
        with self.lock:
            self.descriptor = (numel, block_size, dtype, op | (wire.COO_OP if self.sparse else 0), self.tag)
            self.state.move(CollectiveState.STREAMING)
        # Read and written through a view outside autograd (as gloo does): same memory, so the
        # result still lands in the caller's tensor, also when it requires grad.
        t = self.tensor.detach()
        if self.sparse:
            self.blocks = SparseBlocks(t, block_size)
        elif t.device.type == "cpu" and t.is_contiguous():
            self.blocks = BlockTensor(t.view(-1), block_size)
        else:
            self.blocks = StagedBlocks(t, block_size)
        for agg, stream, _, _ in ranges:    # every key now: other threads iterate this dict
            self.streams[agg, stream] = None
            self.stream_locks[agg, stream] = threading.Lock()
        self.remaining = len(ranges)

    def fail(self, error: BaseException) -> None:
        """Fail it with `error`, unless it already has all its results (a late report changes
        nothing) or failed before."""
        with self.lock:
            if self.state.is_(CollectiveState.QUEUED, CollectiveState.STREAMING):
                self.error = error
                self.state.move(CollectiveState.FAILED)
        if self.settled is not None:
            self.settled.set()

    def stream_done(self, key: tuple[int, int]) -> None:
        """Range `key` (aggregator, stream) has all its results, data included; after the last,
        STREAMING -> DRAINING."""
        with self.lock:
            self._finished.add(key)
            self.remaining -= 1
            if self.remaining or not self.state.is_(CollectiveState.STREAMING):
                return
            result = self.blocks.finish()
            if self.sparse:
                self.tensor = result
            self.state.move(CollectiveState.DRAINING)
        self.settled.set()

    def drain(self, deadline: float, rank: int) -> None:
        """DRAINING -> DONE once every lease on the tensor is back, or FAILED at the deadline.
        (After a failure the aggregator dropped the collective and its peers fail it too.)"""
        if not self.state.is_(CollectiveState.DRAINING):
            return
        back = self.loans.wait(max(0.0, deadline - time.monotonic()))
        with self.lock:
            if back:
                self.state.move(CollectiveState.DONE)
            else:
                self.error = CollectiveTimeout(
                    f"rank {rank}: allreduce {self.id}: its aggregator could not send the "
                    f"results to every peer within {self.timeout:g} s")
                self.state.move(CollectiveState.FAILED)

    def waiting_for(self) -> list[int]:
        """The aggregators with a range still waiting for results (or for the data of its last
        one: a stream is done once it accepted a result's header, before the data arrived)."""
        with self.lock:
            return sorted({agg for agg, stream in self.streams
                           if (agg, stream) not in self._finished})
