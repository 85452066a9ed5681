"""The worker side of a job: drives one WorkerStream per (aggregator, stream) range of a collective.

The mirror of `aggregator.AggregatorJob`. `WorkerJob.run` scans the tensor, sends each range's first
contributions, then waits; results arrive on receiver threads (one per remote aggregator) and on the
local thread (results of this process's own colocated aggregator, no socket), which place them in the
tensor and send the next contributions that the freed credits allow. A collective's own state (and
its named states) lives in `collective`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import numpy as np
import torch

from . import transport, wire
from .aggregator import AggregatorJob
from .blocks import as_bytes, block_count, runs
from .collective import CollectiveState, WorkerCollective
from .errors import (REPORT_GRACE, SETTLE_S, CollectiveTimeout, MismatchError, PeerError, ProtocolError,
                     SparcollError)
from .lease import Lease, give_back
from .message_size import MessageSizePolicy
from .protocol import Geometry, WorkerStream
from .server import AggregatorServer

log = logging.getLogger("sparcoll")
RUN_LIMIT = 32          # more runs than this in a message: gather/scatter through one buffer instead
RUN_BYTES = 64 << 10    # ... and more than one run per this many bytes of it: each run costs a view,
                        # a system call and their Python (tens of us), as much as copying this much
                        # through the buffer (2 ranks on loopback, 64K floats at 10%, 13 runs of one
                        # block a message: 1.9-2.2 ms a call in place, 1.6-2.0 through the buffer)
EARLY_ERRORS = 64       # peers' reports kept for collectives this rank has not run yet: the lowest ids,
                        # those that come next (a peer holding the secret could name any number)
DISCARD_BYTES = 1 << 20  # results of a collective this rank gave up are read through this much
FROM_AGGREGATORS = frozenset({wire.Kind.RESULT, wire.Kind.ERROR})
THREADS_JOIN_S = 5.0    # close() waits this long, at most, for the receiving threads to end


class WorkerJob:
    """This rank's side of a job: its connections to the aggregators, the collective in progress,
    and the threads that receive results. `on_poison(error)` is told of failures that end the
    communicator (a broken connection)."""

    def __init__(self, rank: int, job: int, config: wire.JobConfig, block_size: int,
                 addresses: list[str], on_poison: Callable[[BaseException], None],
                 server: AggregatorServer | None = None, local_job: AggregatorJob | None = None):
        self.rank, self.job, self.config, self.block_size = rank, job, config, block_size
        self.addresses = addresses
        self.server = server                  # the colocated aggregator, if any
        self.local_job = local_job
        self.local_index = rank if local_job is not None else None
        self.message_size = MessageSizePolicy(config.message_blocks)
        self.connections: dict[int, transport.Connection] = {}
        self._on_poison = on_poison
        self._threads: list[threading.Thread] = []
        self._local_messages: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._active: WorkerCollective | None = None
        self._finished_through = 0     # the last collective this rank ran to its end, on any path
        self._early_errors: dict[int, BaseException] = {}  # reported before this rank ran it
        self._early_reported = threading.Condition(self._lock)     # one was added
        self._report_due = 0.0      # until when a lost connection's report of why may still come
        self._lost: BaseException | None = None     # the first connection to an aggregator that broke
        self._closed = False

    def lost(self) -> BaseException | None:
        """The error of the first connection to an aggregator that broke, if one did."""
        return self._lost

    def local_inbox(self) -> Callable[[wire.LocalResult | wire.Failure], None]:
        """Where the own aggregator delivers; starts the thread that reads it."""
        self._spawn(self._local_loop, "sparcoll-local")
        return self._local_messages.put

    def add_connection(self, index: int, sock) -> None:
        conn = transport.Connection(sock, f"aggregator {index} at {self.addresses[index]}",
                                    lambda exc: self.broken(index, exc))
        self.connections[index] = conn
        self._spawn(lambda: self._receive_results(index, conn), f"sparcoll-recv-{index}")

    def _spawn(self, target: Callable, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def bytes_received(self) -> int:
        """Bytes this process read from the network so far, for its worker and its aggregator."""
        total = sum(conn.stats.bytes_received for conn in self.connections.values())
        return total + (self.server.traffic().bytes_received if self.server else 0)

    # ---- one collective -------------------------------------------------------------------------
    def take_early_error(self, cid: int) -> BaseException | None:
        with self._lock:
            return self._early_errors.pop(cid, None)

    def report_may_come(self) -> bool:
        """Whether a peer's report of why a connection was lost may still come (REPORT_GRACE after
        the last lost connection)."""
        with self._lock:
            return time.monotonic() < self._report_due

    def early_error_soon(self, cid: int) -> bool:
        """Whether a peer reported collective `cid` before this rank started it, waiting for that
        report until REPORT_GRACE after the last lost connection: a peer that refused its input
        reports it, then closes, and its closed connection may be seen first (see broken)."""
        with self._lock:
            return self._early_reported.wait_for(lambda: cid in self._early_errors,
                                                 max(0.0, self._report_due - time.monotonic()))

    def run(self, coll: WorkerCollective, block_size: int) -> BaseException | None:
        """Run one collective to its end with blocks of `block_size` (at most the job's); returns
        its error (None: done)."""
        start, received = time.monotonic(), self.bytes_received()
        geometry = Geometry(block_count(coll.kind[0], block_size),
                            self.config.num_aggs, self.config.streams)
        # Remote ranges first, the own aggregator's last: a range's messages travel while the next
        # range is scanned, and peers' aggregators get this rank's blocks as early as possible.
        ranges = sorted(geometry.ranges(), key=lambda r: r[0] == self.local_index)
        coll.start(block_size, ranges)
        with self._lock:
            self._active = coll
            # arrived since the engine took it; or a connection broke after the engine looked for
            # the poison and before this collective was active, where broken() could not fail it
            early = self._early_errors.pop(coll.id, None) or self._lost
        if early is not None:
            coll.fail(early)
        try:
            self._stream(coll, ranges)
        finally:
            with self._lock:
                self._active = None
            if not coll.state.is_(CollectiveState.DONE):   # failed, or left by an exception
                self._take_back(coll)
        if coll.error is None:
            self.message_size.observe(self.bytes_received() - received, time.monotonic() - start)
        return coll.error

    def _stream(self, coll: WorkerCollective, ranges: list) -> None:
        """Send the first contributions of every range, then wait for the results or the deadline."""
        message_blocks = self.message_size.blocks(coll.descriptor[1] * coll.tensor.element_size())
        try:
            for agg, stream, lo, hi in ranges:
                coll.streams[agg, stream] = WorkerStream(lo, hi, coll.blocks.nonzero(lo, hi),
                                                         message_blocks, self.config.credits)
                self._advance(coll, agg, stream)
        except SparcollError as exc:
            coll.fail(exc)
        deadline = time.monotonic() + coll.timeout
        if not coll.settled.wait(coll.timeout):
            coll.fail(CollectiveTimeout(self._describe_stall(coll)))
        coll.drain(deadline, self.rank)

    def _take_back(self, coll: WorkerCollective) -> None:
        """After a failure (or an exception, Ctrl-C in a blocking call), before the caller gets the
        error and its tensor back: results still being placed land first, the own aggregator lets go
        of the contributions it still holds (AggregatorJob.release), and messages still queued from
        the tensor are written or dropped, within SETTLE_S; past that, what still uses the tensor is
        logged. A result's data still being received after SETTLE_S (its aggregator stalled half-way
        through a message) would land in the tensor once the caller has it back, whenever the
        aggregator resumes: its connection is cut (the communicator is poisoned by the failure)."""
        deadline = time.monotonic() + SETTLE_S
        written = coll.writes.wait(SETTLE_S)
        if not written:
            for agg in coll.waiting_for():
                conn = self.connections.get(agg)    # (none to the own aggregator)
                if conn is not None:
                    conn.cut()
            written = coll.writes.wait(SETTLE_S)
        if self.local_job is not None:
            self.local_job.release(self.rank, coll.id)
        sent = coll.loans.wait(max(0.0, deadline - time.monotonic()))
        if not (written and sent):
            log.warning("rank %d: allreduce %d failed, and %g s later its tensor was still being %s",
                        self.rank, coll.id, SETTLE_S, "sent (a stalled peer?)" if written else "written")

    def _writer(self, cid: int) -> tuple[WorkerCollective | None, Lease | None]:
        """Collective `cid` if this rank still runs it, with a lease on its tensor that the caller
        gives back once it no longer writes there (after a failure, _take_back waits for it)."""
        with self._lock:
            coll = self._current(cid)
            return (None, None) if coll is None else (coll, coll.writes.lend())

    def _describe_stall(self, coll: WorkerCollective) -> str:
        """What the collective waits for; with colocated aggregators also the ranks it waits for,
        as this rank's own aggregator knows them (every rank sends a part of every collective to
        every aggregator, so a rank that never made the call is missing here too)."""
        who = ", ".join(f"aggregator {a} at {self.addresses[a]}" for a in coll.waiting_for())
        late = self.local_job.holding_back(coll.id) if self.local_job is not None else {}
        silent = sorted(rank for rank, nothing in late.items() if nothing)
        partial = sorted(rank for rank, nothing in late.items() if not nothing)
        ranks = "; ".join(f"{_ranks(group)} {verb} to this rank's aggregator" for group, verb in
                          ((silent, "sent nothing of it"), (partial, "sent only part of it")) if group)
        return (f"rank {self.rank}: allreduce {coll.id} not finished after {coll.timeout:g} s; "
                + (f"{ranks}; " if ranks else "")
                + f"still waiting for {who} (a peer may be dead, stuck, or calling other collectives)")

    def _advance(self, coll: WorkerCollective, agg: int, stream: int, result=None) -> None:
        """Accept a result's metadata (if any), then send what the credits allow. Serialized per
        stream: the engine's first sends and a receiver's next ones must not interleave."""
        ws = coll.streams[agg, stream]
        with coll.stream_locks[agg, stream]:
            if result is not None:
                ws.on_result(*result)
            self._transmit(coll, agg, stream, ws.next_sends())

    def _transmit(self, coll: WorkerCollective, agg: int, stream: int, sends) -> None:
        """Send contributions: direct calls to the local aggregator, zero-copy views to remote ones."""
        ws = coll.streams[agg, stream]
        for send in sends:
            indices = ws.indices[send.start:send.stop]
            if agg == self.local_index:
                # In place, the own aggregator may sum straight into the tensor (its result
                # then needs no copy, and is sent to the peers from there).
                header = wire.Header(wire.Kind.CONTRIBUTE, stream, self.job, coll.id, send.seq,
                                     indices.size, send.progress, *coll.descriptor)
                self.local_job.contribute(self.rank, header, indices,
                                          coll.blocks.rows_of(indices), coll.loans.lend(),
                                          reuse=2 if coll.blocks.direct else 0)
                continue
            header = wire.data_header(wire.Kind.CONTRIBUTE, stream=stream, job=self.job,
                                      collective=coll.id, seq=send.seq, count=indices.size,
                                      progress=send.progress, descriptor=coll.descriptor)
            blocks = coll.blocks    # a compact tensor's rows of one message are one view already
            nbytes = indices.size * blocks.block_size * blocks.dtype.itemsize
            spans = runs(indices, run_limit(nbytes)) if blocks.direct else None
            if spans is None:
                payload, lease = [as_bytes(blocks.gather(indices))], None
            else:   # views of the tensor: lent until written
                payload = [as_bytes(v) for start, stop in spans for v in blocks.views(start, stop)]
                lease = coll.loans.lend()
            try:
                self.connections[agg].send([header, as_bytes(indices.astype(wire.INDEX_DTYPE)),
                                            *payload], blocks=indices.size, lease=lease)
            except BaseException:
                give_back(lease)
                raise

    # ---- results --------------------------------------------------------------------------------
    def _current(self, cid: int) -> WorkerCollective | None:
        coll = self._active
        return coll if coll is not None and coll.id == cid else None

    def _receive_results(self, agg: int, conn: transport.Connection) -> None:
        """Receiver thread of one remote aggregator's results, placed straight in the tensor. It
        ends with the connection: closed, broken, or unusable after anything else went wrong
        (the stream's position is then unknown)."""
        placement = _ResultPlacement(self, agg, conn)
        max_blocks = self.config.world * self.config.credits * self.config.message_blocks
        try:
            try:
                while True:
                    h = conn.recv_header(max_blocks, self.job)
                    message = wire.read_body(h, conn.recv_into, FROM_AGGREGATORS, placement.place)
                    if isinstance(message, wire.Failure):
                        if message.collective == wire.CONNECTION:   # why the aggregator closes it
                            raise message.exception()
                        self.collective_error(message)
                        continue
                    placement.finish(message)
            finally:
                placement.abandon()     # a message left half read: no more of it lands in the tensor
        except (SparcollError, OSError) as exc:
            if not self._closed:
                self.broken(agg, exc)
        except BaseException as exc:
            if not self._closed:
                self._internal_error(f"receiving results from aggregator {agg}", exc)
                conn.close()
                self.broken(agg, exc)

    def _local_loop(self) -> None:
        """Results and errors from this process's own aggregator (delivered without sockets).
        Whatever one message raises fails its collective; the loop goes on."""
        while True:
            message = self._local_messages.get()
            if message is None:
                return
            try:
                if isinstance(message, wire.Failure):
                    self.collective_error(message)
                else:
                    self._on_local_result(message)
            except BaseException as exc:
                self._internal_error("handling a result of its own aggregator", exc)
            finally:
                if isinstance(message, wire.LocalResult):
                    give_back(message.lease)    # the aggregator may reuse the result's memory now

    def _on_local_result(self, message: wire.LocalResult) -> None:
        coll, writing = self._writer(message.collective)
        if coll is None:
            return
        result = message.result
        try:
            ws = coll.streams[self.local_index, message.stream]
            self._advance(coll, self.local_index, message.stream,
                          (result.seq, result.progress, result.indices))
            coll.blocks.scatter(result.indices, result.rows)   # no copy when summed in place
            if ws.done:
                coll.stream_done((self.local_index, message.stream))
        except SparcollError as exc:
            coll.fail(exc)
        finally:
            give_back(writing)

    # ---- failures -------------------------------------------------------------------------------
    def collective_error(self, failure: wire.Failure) -> None:
        """A peer or an aggregator failed collective `failure.collective`."""
        error = failure.exception()
        with self._lock:
            coll = self._current(failure.collective)
            if coll is None and failure.collective > self._finished_through:
                # A peer failed a collective this rank has queued but not started yet (or runs on
                # gloo's ring, whose waits look here).
                self._keep_early(failure.collective, error)
        if coll is not None:
            coll.fail(error)

    def _keep_early(self, cid: int, error: BaseException) -> None:
        """Keep a peer's report of collective `cid` until this rank runs it; at most EARLY_ERRORS,
        the lowest ids (the first of them poisons the communicator anyway). Holds the lock."""
        if cid not in self._early_errors and len(self._early_errors) >= EARLY_ERRORS:
            highest = max(self._early_errors)
            if cid > highest:
                return
            del self._early_errors[highest]
        self._early_errors[cid] = error
        self._early_reported.notify_all()

    def finished(self, cid: int) -> None:
        """This rank ran collective `cid` to its end (on any path): reports of it and of every
        earlier one can no longer be used."""
        with self._lock:
            self._finished_through = max(self._finished_through, cid)
            if self._early_errors:
                for stale in [c for c in self._early_errors if c <= cid]:
                    del self._early_errors[stale]

    def broken(self, agg: int, exc: BaseException) -> None:
        """A connection to an aggregator failed: every later collective fails, and so does the
        current one if it still needs that aggregator (a peer that finished first may leave),
        unless a report of why it failed arrives within REPORT_GRACE (that one is the better
        error). Runs on the connection's own thread, which ends after it."""
        error = exc if isinstance(exc, PeerError) else PeerError(
            f"connection to aggregator {agg} at {self.addresses[agg]} failed: {exc}")
        with self._lock:        # before the poison: a call that sees it waits for the report
            self._report_due = time.monotonic() + REPORT_GRACE
            self._lost = self._lost or error
            coll = self._active     # (one that becomes active after this sees _lost in run)
        self._on_poison(error)
        if coll is not None and agg in coll.waiting_for():
            coll.settled.wait(REPORT_GRACE)
            coll.fail(error)

    def internal_failure(self, coll: WorkerCollective | None, what: str,
                         exc: BaseException) -> SparcollError:
        """`exc` (anything, ours or not) broke `what` on this rank: the SparcollError to raise, with
        `exc` as its cause. Collective `coll`, if any, fails with it, and every aggregator hears of
        it, so no peer waits for this rank."""
        error = SparcollError(f"rank {self.rank}: {what} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        log.error("%s", error, exc_info=exc)
        if coll is not None:
            coll.fail(error)
            try:
                self.abort(coll.id, str(error))
            except Exception:
                log.exception("rank %d could not announce the failure of allreduce %d", self.rank,
                              coll.id)
        return error

    def _internal_error(self, what: str, exc: BaseException) -> None:
        """A receiving thread failed unexpectedly: the collective in progress fails (see
        internal_failure) and the communicator is poisoned."""
        self._on_poison(self.internal_failure(self._active, what, exc))

    def fail_active(self, error: BaseException) -> None:
        coll = self._active
        if coll is not None:
            coll.fail(error)

    def abort(self, cid: int, text: str, code: wire.ErrorCode = wire.ErrorCode.GENERIC) -> None:
        """Tell every aggregator that this rank gives up collective `cid`, so no peer waits for it
        (peers raise the exception type of `code`)."""
        if not text.startswith(f"rank {self.rank}:"):
            text = f"rank {self.rank}: {text}"
        for index in range(self.config.num_aggs):
            if index == self.local_index:
                self.local_job.fail(cid, code, text)
            else:
                self.connections[index].send(wire.error_message(self.job, cid, text, code))

    def sparse_peer(self, cid: int) -> MismatchError | None:
        """While this rank runs collective `cid` on gloo's ring: a MismatchError if a peer sent its
        part to the sparse path instead (its own aggregator has it; every worker sends to every
        aggregator), i.e. the ranks' calls differ. Only seen with colocated aggregators."""
        descriptor = None if self.local_job is None else self.local_job.descriptor_of(cid)
        if descriptor is None:
            return None
        numel, _, dtype, op, tag = descriptor
        return MismatchError(
            f"rank {self.rank}: ranks called allreduce {cid} with different tensors or ops: this "
            f"rank's call went to gloo's ring, a peer's ({numel} elements of "
            f"{wire.DTYPES[dtype][0]}, op {wire.op_name(op)}{wire.tagged(tag)}) to the "
            f"sparse AllReduce")

    def close(self, poison: BaseException | None) -> None:
        """Leave the job: BYE to every aggregator, then stop every thread. After an error
        (`poison`) the BYE says which, and the collectives this rank leaves behind fail with it:
        peers still waiting on any aggregator learn the root cause (a cascade names the peer that
        failed first; a mismatch stays a MismatchError), not that this rank left."""
        self._closed = True
        reason = None if poison is None else (
            wire.ErrorCode.MISMATCH if isinstance(poison, MismatchError) else wire.ErrorCode.PEER,
            f"rank {self.rank} left the job after an error: {poison}")
        for conn in self.connections.values():
            conn.send([wire.bye_message(self.job, reason)])
        transport.close_all(self.connections.values())
        if self.local_job is not None:      # before its connections close
            self.local_job.detach(self.rank, reason)
        if self.server is not None:
            self.server.close()
        self._local_messages.put(None)
        deadline = time.monotonic() + THREADS_JOIN_S
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))


def run_limit(nbytes: int) -> int:
    """The most runs of blocks a message of `nbytes` bytes of data is sent from, or received into, in
    place: beyond it the blocks go through one buffer (a gather or a scatter)."""
    return max(1, min(RUN_LIMIT, nbytes // RUN_BYTES))


class _ResultPlacement:
    """Where a remote aggregator's result data lands, for one receiver thread: straight into the
    tensor's runs of blocks; into a compact tensor's receive buffer; else through one staging
    buffer and a scatter. Results of a collective this rank no longer runs are read and dropped."""

    def __init__(self, job: WorkerJob, agg: int, conn: transport.Connection):
        self.job, self.agg, self.conn = job, agg, conn
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.discard = torch.empty(DISCARD_BYTES, dtype=torch.uint8)
        self._coll: WorkerCollective | None = None
        self._after: Callable[[np.ndarray], None] | None = None
        self._writing: Lease | None = None      # on the tensor, while its data is read into it

    def place(self, h: wire.Header, indices: np.ndarray) -> list[memoryview]:
        nbytes = h.payload_sizes()[1]
        job = self.job
        if h.block_size > job.block_size:     # bounds what a dropped collective's results cost
            raise ProtocolError(f"result with block size {h.block_size}, this job uses at most "
                                f"{job.block_size}")
        coll, self._writing = job._writer(h.collective)
        self._coll, self._after = coll, None
        if coll is None:    # a collective that already failed here: drop its results
            return [as_bytes(self.discard)[:min(DISCARD_BYTES, nbytes - offset)]
                    for offset in range(0, nbytes, DISCARD_BYTES)]
        if h.descriptor != coll.descriptor or coll.streams.get((self.agg, h.stream)) is None:
            raise ProtocolError(f"result for stream {h.stream} with descriptor {h.descriptor} does "
                                f"not match collective {coll.id}")
        job._advance(coll, self.agg, h.stream, (h.seq, h.progress, indices))
        blocks = coll.blocks
        spans = runs(indices, run_limit(nbytes)) if blocks.direct else None
        if spans is not None:
            return [as_bytes(view) for start, stop in spans for view in blocks.views(start, stop)]
        if not blocks.direct:
            rows = blocks.receive_buffer(h.count)
            self._after = lambda idx: blocks.keep(idx, rows)
            return [as_bytes(rows)]
        if self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8)
        rows = self.staging[:nbytes].view(blocks.dtype).view(h.count, h.block_size)
        self._after = lambda idx: blocks.scatter(idx, rows)
        return [as_bytes(self.staging)[:nbytes]]

    def finish(self, message: wire.Blocks) -> None:
        """The data is in: scatter or keep it, and count the range done if it is."""
        coll, after = self._coll, self._after
        self._coll = self._after = None
        if coll is None:
            return
        try:
            if after is not None:
                after(message.indices)
            self.conn.count(blocks_received=message.header.count)   # before the collective may end
            if coll.streams[self.agg, message.header.stream].done:
                coll.stream_done((self.agg, message.header.stream))
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Nothing more of this message is written into the tensor."""
        writing, self._writing = self._writing, None
        give_back(writing)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"
