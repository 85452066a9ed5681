"""The batched OmniReduce protocol as sans-IO state machines: messages in, messages out.

No sockets, threads or clocks live here, so tests can drive workers and aggregators in memory through
any delivery order. The block index space of a tensor is split into (aggregator, stream) ranges; for
each range every worker runs a `WorkerStream` and the owning aggregator an `AggregatorStream`.

A worker streams its non-zero blocks in index order, at most `message_blocks` per message, each message
carrying p: "I have sent every non-zero block below p". The aggregator keeps p per worker; every block
below c = min_w p[w] is final, so it sums those blocks and sends (indices, sums, c) to every worker.
A worker may have at most `credits` messages not yet covered by a result, which bounds the aggregator's
pending blocks by workers x credits x message_blocks, whatever the tensor size.

The machines assume a reliable, ordered transport (TCP): anything out of sequence is a protocol
error. `lossy.py` extends them for a transport that may lose, duplicate or reorder messages.

Block indices are numpy int64 arrays: the per-message bookkeeping is many small operations, and numpy's
per-call cost is a fraction of torch's. Block data are torch tensors (any dtype, any device).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
import numpy as np
import torch

from .errors import MismatchError, ProtocolError
from .lease import Lease
from .wire import DTYPES, op_name


@dataclass(frozen=True)
class Geometry:
    """How a tensor's blocks are split over aggregators (contiguous shards) and streams within a shard."""
    nblocks: int
    num_aggs: int
    streams: int

    def range(self, agg: int, stream: int) -> tuple[int, int]:
        shard_lo = agg * self.nblocks // self.num_aggs
        shard_hi = (agg + 1) * self.nblocks // self.num_aggs
        width = shard_hi - shard_lo
        return (shard_lo + stream * width // self.streams,
                shard_lo + (stream + 1) * width // self.streams)

    def ranges(self) -> list[tuple[int, int, int, int]]:
        """(aggregator, stream, lo, hi) for every range, also the empty ones: every worker sends to every
        range at least once per collective, so every aggregator sees every rank's descriptor."""
        return [(a, s, *self.range(a, s)) for a in range(self.num_aggs) for s in range(self.streams)]


@dataclass(frozen=True)
class Send:
    """A contribution the worker should send: its non-zero blocks indices[start:stop], and p."""
    seq: int
    start: int
    stop: int
    progress: int


@dataclass
class Result:
    """Final sums of the blocks `indices` (sorted), every block below `progress` (c) being final.
    `lease`: of the contribution the sums were accumulated in (its memory is `rows`): the driver
    gives it back only once every worker has been given the result."""
    seq: int
    progress: int
    indices: np.ndarray
    rows: torch.Tensor
    lease: Lease | None = None


def check_indices(indices: np.ndarray, floor: int, ceiling: int, what: str) -> None:
    """Block indices must be strictly increasing and inside [floor, ceiling)."""
    if indices.size == 0:
        return
    first, last = int(indices[0]), int(indices[-1])
    if first < floor or last >= ceiling:
        raise ProtocolError(f"{what}: block indices [{first}, {last}] outside [{floor}, {ceiling})")
    if indices.size > 1 and not (np.diff(indices) > 0).all():
        raise ProtocolError(f"{what}: block indices not strictly increasing")


class WorkerStream:
    """One worker's side of one (aggregator, stream) range: what to send next, what results to accept."""

    def __init__(self, lo: int, hi: int, indices: np.ndarray, message_blocks: int, credits: int):
        self.lo, self.hi = lo, hi
        self.indices = indices
        self.message_blocks = message_blocks
        self.credits = credits
        self.progress = lo - 1          # c of the last accepted result
        self.next_result = 0            # seq of the next result to accept; sent back as the ack
        self._sent = 0                  # how many of `indices` were handed out
        self._seq = 0
        self._unacked: deque[Send] = deque()   # messages not yet covered by a result

    @property
    def done(self) -> bool:
        return self.progress == self.hi

    def next_sends(self) -> list[Send]:
        """Contributions that credits allow now; the first call always yields at least one."""
        sends = []
        n = self.indices.size
        while len(self._unacked) < self.credits and (self._sent < n or self._seq == 0):
            stop = min(self._sent + self.message_blocks, n)
            progress = int(self.indices[stop]) if stop < n else self.hi
            sends.append(Send(self._seq, self._sent, stop, progress))
            self._unacked.append(sends[-1])
            self._sent = stop
            self._seq += 1
        return sends

    def on_result(self, seq: int, progress: int, indices: np.ndarray) -> bool:
        """Accept a result's metadata (before its data is written anywhere): True if its data is to be
        written. A result that breaks the rules raises ProtocolError."""
        if seq != self.next_result:
            return self._out_of_sequence(seq)
        reported = self._unacked[-1].progress if self._unacked else self.progress
        if not self.progress < progress <= min(reported, self.hi):
            raise ProtocolError(f"result progress {progress} not in ({self.progress}, "
                                f"{min(reported, self.hi)}]")
        floor = max(self.progress, self.lo)
        check_indices(indices, floor, progress, "result")
        mine = self.indices[np.searchsorted(self.indices, floor):np.searchsorted(self.indices, progress)]
        if mine.size and (mine.size > indices.size or
                          not np.array_equal(indices[np.searchsorted(indices, mine).clip(
                              max=indices.size - 1)], mine)):
            raise ProtocolError("result omits blocks this worker contributed")
        self.next_result += 1
        self.progress = progress
        while self._unacked and self._unacked[0].progress <= progress:
            self._unacked.popleft()
        return True

    def _out_of_sequence(self, seq: int) -> bool:
        raise ProtocolError(f"result seq {seq}, expected {self.next_result}")


@dataclass
class _Pending:
    indices: np.ndarray
    rows: torch.Tensor
    lease: Lease | None
    reuse: int


@dataclass
class Step:
    """What an aggregator's input produced: a result to send to every worker (or None), the leases
    of contributions whose memory is no longer needed (for the driver to give back), whether the
    message was taken (a lossy transport's duplicates are not), and results to send again to its
    sender only (lossy transports)."""
    result: Result | None = None
    released: list[Lease | None] = field(default_factory=list)
    accepted: bool = True
    resend: list[Result] = field(default_factory=list)


class AggregatorStream:
    """The aggregator's side of one range for one collective: accumulate, finalize below c, emit."""

    def __init__(self, lo: int, hi: int, workers: int, descriptor: tuple[int, int, int, int, int],
                 dtype: torch.dtype, acc_dtype: torch.dtype, average: bool, message_blocks: int,
                 credits: int):
        self.lo, self.hi = lo, hi
        self.workers = workers
        self.descriptor = descriptor
        self.block_size = descriptor[1]
        self.dtype, self.acc_dtype, self.average = dtype, acc_dtype, average
        self.message_blocks, self.credits = message_blocks, credits
        self.progress = lo - 1
        self._reported = [lo - 1] * workers        # p per worker
        self._seq = [0] * workers
        # a worker's queues are made at its first message here: made for every worker of every stream
        # at a collective's first message, they took about 400 MB at 4,096 workers and 64 streams
        self._inflight: list[deque[int] | None] = [None] * workers   # p of messages not yet covered by c
        self._pending: list[deque[_Pending] | None] = [None] * workers
        self._result_seq = 0

    @property
    def done(self) -> bool:
        return self.progress == self.hi

    @property
    def pending_blocks(self) -> int:
        return sum(p.indices.size for q in self._pending if q for p in q)

    def holding_back(self) -> list[int]:
        """The workers whose next message this range's next result waits for (the lowest progress):
        who a stalled collective waits for."""
        return [] if self.done else [w for w, p in enumerate(self._reported) if p == self.progress]

    def heard_from(self, worker: int) -> bool:
        """Whether `worker` has sent any message for this range."""
        return self._reported[worker] >= self.lo

    def on_contribution(self, worker: int, seq: int, progress: int, descriptor: tuple,
                        indices: np.ndarray, rows: torch.Tensor, lease: Lease | None = None,
                        reuse: int = 0) -> Step:
        """Take a worker's message (indices int64, rows (m, block) in the tensor dtype); `lease`
        covers the memory of `rows`. `reuse` > 0: the sums may be accumulated in `rows` (then the
        result carries `lease`); the highest `reuse` among a result's contributions is chosen (a
        worker's own tensor, whose result then needs no copy, before a receive buffer)."""
        self._check_sender(worker, descriptor)
        if seq != self._seq[worker]:
            raise ProtocolError(f"worker {worker}: message seq {seq}, expected {self._seq[worker]}")
        return self._take(worker, progress, indices, rows, lease, reuse)

    def release(self, worker: int) -> list[Lease | None]:
        """Worker `worker` takes back the memory of its contributions still waiting here (it gave
        up the collective: its caller owns the tensor again). They are copied, so the others may
        still complete with them, and their leases are returned, for the driver to give back."""
        released = []
        for p in self._pending[worker] or ():
            released.append(p.lease)
            p.rows, p.lease, p.reuse = p.rows.clone(), None, 1  # now this stream's, as a receive buffer
        return released

    def drop(self) -> list[Lease | None]:
        """The collective is dropped here: every contribution still waiting is let go; their leases
        are returned, for the driver to give back."""
        released = [p.lease for queue in self._pending if queue for p in queue]
        for queue in self._pending:
            if queue:
                queue.clear()
        return released

    def _check_sender(self, worker: int, descriptor: tuple) -> None:
        if not 0 <= worker < self.workers:
            raise ProtocolError(f"contribution from unknown worker {worker}")
        if descriptor != self.descriptor:
            raise MismatchError(_describe_mismatch(worker, descriptor, self.descriptor))

    def _take(self, worker: int, progress: int, indices: np.ndarray, rows: torch.Tensor,
              lease: Lease | None, reuse: int) -> Step:
        """Accept the worker's next message in sequence; finalize what became final."""
        previous = self._reported[worker]
        if not previous < progress <= self.hi:
            raise ProtocolError(f"worker {worker}: progress {progress} not in ({previous}, {self.hi}]")
        if self._inflight[worker] is None:
            self._inflight[worker], self._pending[worker] = deque(), deque()
        if len(self._inflight[worker]) >= self.credits:
            raise ProtocolError(f"worker {worker} exceeded its {self.credits} credits")
        count = indices.size
        if count > self.message_blocks:
            raise ProtocolError(f"worker {worker}: {count} blocks in a message, limit "
                                f"{self.message_blocks}")
        check_indices(indices, max(previous, self.lo), progress, f"worker {worker}")
        if rows.shape != (count, self.block_size) or rows.dtype != self.dtype:
            raise ProtocolError(f"worker {worker}: data of shape {tuple(rows.shape)} {rows.dtype}, "
                                f"expected ({count}, {self.block_size}) {self.dtype}")
        self._seq[worker] += 1
        self._reported[worker] = progress
        self._inflight[worker].append(progress)
        step = Step()
        if count:
            self._pending[worker].append(_Pending(indices, rows, lease, reuse))
        else:
            step.released.append(lease)
        final = min(self._reported)
        if final > self.progress:
            step.result = self._finalize(final, step.released)
        return step

    def _finalize(self, final: int, released: list) -> Result:
        chunks = []
        whole = []      # (chunk index, pending) of the messages taken whole now
        for queue in self._pending:
            while queue:        # (None for a worker that has not sent here)
                head = queue[0]
                cut = int(np.searchsorted(head.indices, final))
                if cut == 0:
                    break
                chunks.append((head.indices[:cut], head.rows[:cut]))
                if cut < head.indices.size:
                    head.indices, head.rows = head.indices[cut:], head.rows[cut:]
                    break
                queue.popleft()
                whole.append((len(chunks) - 1, head))
        for inflight in self._inflight:
            while inflight and inflight[0] <= final:
                inflight.popleft()
        # The sums may go into the memory of a whole message that allows it (the highest reuse).
        spare = max(((i, p) for i, p in whole if p.reuse and p.rows.dtype == self.acc_dtype),
                    key=lambda entry: entry[1].reuse, default=None)
        indices, sums, used = self._sum(chunks, None if spare is None else spare[0])
        kept = spare[1] if used else None
        released.extend(p.lease for _, p in whole if p is not kept)
        result = Result(self._result_seq, final, indices, sums,
                        None if kept is None else kept.lease)
        self._result_seq += 1
        self.progress = final
        return result

    def _sum(self, chunks: list[tuple[np.ndarray, torch.Tensor]],
             spare: int | None) -> tuple[np.ndarray, torch.Tensor, bool]:
        """(indices, sums, whether the sums were accumulated in chunk `spare`'s own rows)."""
        if not chunks:
            return (np.empty(0, dtype=np.int64),
                    torch.empty(0, self.block_size, dtype=self.dtype), False)
        first_idx = chunks[0][0]
        in_place = False
        if all(np.array_equal(idx, first_idx) for idx, _ in chunks[1:]):
            # Every contributor sent the same blocks (the dense case): plain adds, no index work.
            # Into a writable contribution when there is one (no new buffer, no copy pass), else
            # the first add writes a new buffer.
            indices = first_idx
            rows = [r for _, r in chunks]
            if spare is not None:
                sums, in_place = rows.pop(spare), True
            elif len(rows) == 1:
                sums = rows.pop().to(self.acc_dtype, copy=True)
            else:
                sums = torch.add(rows.pop(0).to(self.acc_dtype), rows.pop(0))
            for r in rows:
                sums.add_(r)
        elif (span := _gapless_span(chunks)) is not None:
            # Every chunk is a run of consecutive blocks and together they cover [lo, hi) (dense
            # data cut into messages at different points): add slices, no index work either.
            lo, hi = span
            indices = np.arange(lo, hi, dtype=np.int64)
            sums = torch.zeros(hi - lo, self.block_size, dtype=self.acc_dtype)
            for idx, rows in chunks:
                start = int(idx[0]) - lo
                sums[start:start + idx.size].add_(rows)
        else:
            indices, inverse = np.unique(np.concatenate([idx for idx, _ in chunks]),
                                         return_inverse=True)
            inverse = torch.from_numpy(inverse)
            sums = torch.zeros(indices.size, self.block_size, dtype=self.acc_dtype)
            offset = 0
            for idx, rows in chunks:
                sums.index_add_(0, inverse[offset:offset + idx.size], rows.to(self.acc_dtype))
                offset += idx.size
        if self.average:
            sums.div_(self.workers)
        return indices, sums.to(self.dtype), in_place


def _gapless_span(chunks: list[tuple[np.ndarray, torch.Tensor]]) -> tuple[int, int] | None:
    """[lo, hi) if every chunk's indices are one run of consecutive blocks and the runs leave no
    gap between lo and hi; else None. One step per chunk, none per block."""
    spans = []
    for idx, _ in chunks:
        if idx.size == 0 or int(idx[-1]) - int(idx[0]) + 1 != idx.size:
            return None
        spans.append((int(idx[0]), int(idx[-1]) + 1))
    spans.sort()
    lo, hi = spans[0]
    for start, stop in spans[1:]:
        if start > hi:
            return None
        hi = max(hi, stop)
    return lo, hi


def _describe_mismatch(worker: int, got: tuple, expected: tuple) -> str:
    def show(name, value):
        if name == "dtype":
            return str(DTYPES[value][0]) if value in DTYPES else f"code {value}"
        if name == "op":
            return op_name(value)
        return str(value)
    names = ("numel", "block_size", "dtype", "op", "tag")
    diffs = ", ".join(f"{n} {show(n, g)} where another rank has {n} {show(n, e)}"
                      for n, g, e in zip(names, got, expected) if g != e)
    return f"ranks disagree on the collective: rank {worker} has {diffs}"
