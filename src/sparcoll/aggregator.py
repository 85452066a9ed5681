"""Aggregators: sum one shard of every collective of a job and stream the results back to its workers.

An `AggregatorJob` drives the sans-IO `AggregatorStream`s of one job's collectives and sends results
and errors to its workers: remote ones over their connections (see `server`, which accepts them), and
in a colocated aggregator also the worker of its own process (`LocalWorker`: direct calls, no socket).
"""
from __future__ import annotations

import hmac
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from . import wire
from .blocks import block_count
from .errors import MismatchError, ProtocolError
from .lease import Lease, give_back
from .protocol import AggregatorStream, Geometry, Result
from .throttled import Throttled

log = logging.getLogger("sparcoll.aggregator")

FAILED_MEMORY = 64          # failed collective ids remembered per job, to drop their late messages
# Collectives of one job in progress at once. Honest ranks have at most two here (a rank can start
# collective k+1 only once every aggregator finished k), plus a few that timed out and were abandoned;
# without a cap one client could open collective ids without end, each holding its buffered blocks.
MAX_ACTIVE_COLLECTIVES = 16


class Worker(Protocol):
    """Where an AggregatorJob sends a worker's results and errors."""

    def send_result(self, h: wire.Header, header: bytes, indices: np.ndarray, result: Result,
                    lease: Lease | None) -> None: ...

    def send_error(self, job: int, collective: int, code: wire.ErrorCode, text: str) -> None: ...


class LocalWorker:
    """The worker living in the aggregator's own process: messages go to its queue, no bytes move."""

    def __init__(self, deliver: Callable[[wire.LocalResult | wire.Failure], None]):
        self.deliver = deliver

    def send_result(self, h: wire.Header, header: bytes, indices: np.ndarray, result: Result,
                    lease: Lease | None) -> None:
        self.deliver(wire.LocalResult(h.collective, h.stream, result, lease))

    def send_error(self, job: int, collective: int, code: wire.ErrorCode, text: str) -> None:
        self.deliver(wire.Failure(collective, code, text))


@dataclass
class Failed:
    """A failed collective, remembered to drop its late messages; `told`: the ranks that were sent
    its error (a rank attached after the failure is told at its first late message instead)."""
    code: wire.ErrorCode
    text: str
    told: set[int] = field(default_factory=set)
    holding_back: dict[int, bool] = field(default_factory=dict)   # CollectiveShard.holding_back's


class CollectiveShard:
    """This aggregator's part of one collective: the AggregatorStream of each of its ranges."""

    def __init__(self, descriptor: tuple[int, int, int, int, int], job: "AggregatorJob"):
        numel, block_size, dtype_code, op, _ = descriptor
        dtype, acc = wire.DTYPES[dtype_code]
        config = job.config
        geometry = Geometry(block_count(numel, block_size), config.num_aggs, config.streams)
        self.descriptor = descriptor
        self.lock = threading.RLock()   # AggregatorJob.fail takes it, also from inside contribute
        self.dropped = False            # failed: contributions that come after are let go
        self.streams = [AggregatorStream(*geometry.range(job.agg_index, s), config.world, descriptor,
                                         dtype, acc, wire.base_op(op) == wire.Op.AVG, config.message_blocks,
                                         config.credits)
                        for s in range(config.streams)]
        self.finished = 0

    def holding_back(self) -> dict[int, bool]:
        """The ranks some stream waits for, each with whether it has sent nothing to any stream."""
        late = {rank for stream in self.streams for rank in stream.holding_back()}
        return {rank: not any(stream.heard_from(rank) for stream in self.streams) for rank in sorted(late)}


class AggregatorJob:
    """One job's state on one aggregator: its workers and the collectives in progress."""

    def __init__(self, job: int, agg_index: int, config: wire.JobConfig, job_token: bytes,
                 colocated: bool = False, backlog=None):
        self.job = job
        self.backlog = backlog      # the server's transport.Backlog of the job's connections
        self.agg_index = agg_index
        self.config = config
        self.job_token = job_token   # of its first rank: every later rank must show the same
        self.workers: dict[int, Worker] = {}
        # Ranks admitted whose connection is not attached yet: their handshake has ended, so they
        # may be running collectives; the job is kept for them (see the server's _forget_if_empty).
        self.arriving: set[int] = set()
        self._collectives: dict[int, CollectiveShard] = {}
        self._failed: OrderedDict[int, Failed] = OrderedDict()
        self._broken: tuple[wire.ErrorCode, str] | None = None
        self._lock = threading.Lock()
        # a worker may fail collectives (an ERROR each, 64 KiB of its text) as fast as it can send;
        # colocated, its own process raises the failure: the log says it at INFO only
        self._failures_logged = Throttled(log, logging.INFO if colocated else logging.WARNING)

    def admit(self, hello: wire.Hello, job_token: bytes) -> None:
        if not hmac.compare_digest(job_token, self.job_token):
            raise ProtocolError(f"rank {hello.rank} does not hold the job token of job "
                                f"{self.job:#x}")
        if hello.config != self.config or hello.agg_index != self.agg_index:
            raise MismatchError(f"rank {hello.rank} joins job {self.job:#x} with {hello.config}, "
                                f"aggregator {hello.agg_index}; the job has {self.config}, "
                                f"aggregator {self.agg_index}")
        if hello.rank in self.workers or hello.rank in self.arriving:
            raise ProtocolError(f"rank {hello.rank} of job {self.job:#x} is already connected")
        self.arriving.add(hello.rank)

    @property
    def broken(self) -> tuple[wire.ErrorCode, str] | None:
        """Why every collective of the job fails from now on (a worker left), if one did."""
        return self._broken

    def attach(self, rank: int, worker: Worker) -> None:
        with self._lock:
            self.workers[rank] = worker
            self.arriving.discard(rank)

    def contribute(self, rank: int, header: wire.Header, indices: np.ndarray, rows: torch.Tensor,
                   lease: Lease | None = None, reuse: int = 0) -> None:
        """Feed one contribution to its collective; results and errors go out to every worker.
        `lease` (on the memory of `rows`) goes back once they are no longer needed; with
        `reuse` > 0 the sums may be accumulated in `rows` (see AggregatorStream.on_contribution)."""
        try:
            state = self._state(rank, header)
        except ProtocolError:
            give_back(lease)
            raise
        if state is None:
            give_back(lease)
            return
        if header.stream >= len(state.streams):
            give_back(lease)
            raise ProtocolError(f"rank {rank}: stream {header.stream} of {len(state.streams)}")
        with state.lock:
            if state.dropped:       # failed while this contribution waited for the lock
                give_back(lease)
                return
            stream = state.streams[header.stream]
            try:
                step = stream.on_contribution(rank, header.seq, header.progress, header.descriptor,
                                              indices, rows, lease, reuse=reuse)
            except MismatchError as exc:
                give_back(lease)
                self.fail(header.collective, wire.ErrorCode.MISMATCH, str(exc))
                return
            except ProtocolError as exc:
                give_back(lease)
                self.fail(header.collective, wire.ErrorCode.PROTOCOL, f"rank {rank}: {exc}")
                raise
            for released in step.released:
                give_back(released)
            # Finished before the last result goes out: a worker that has it may leave at once,
            # and its leaving must not fail a collective that is only still being broadcast.
            if stream.done:
                state.finished += 1
                if state.finished == len(state.streams):
                    with self._lock:
                        self._collectives.pop(header.collective, None)
            if step.result is not None:
                self._broadcast(header, step.result)

    def release(self, rank: int, cid: int) -> None:
        """Rank `rank`'s worker gave up collective `cid` (colocated: it lent this aggregator its
        tensor): from now on nothing here reads or sums into the memory of its contributions that
        are still waiting; they are copied, and the collective may go on for the others."""
        with self._lock:
            state = self._collectives.get(cid)
        if state is None:
            return
        with state.lock:
            released = [lease for stream in state.streams for lease in stream.release(rank)]
        for lease in released:
            give_back(lease)

    def descriptor_of(self, cid: int) -> tuple | None:
        """The descriptor of collective `cid` if some worker's part of it is in progress here."""
        with self._lock:
            state = self._collectives.get(cid)
        return None if state is None else state.descriptor

    def holding_back(self, cid: int) -> dict[int, bool]:
        """The ranks collective `cid`'s shard here waits for (or waited for when it failed), each
        with whether it has sent nothing here; none if the collective is neither in progress nor
        remembered as failed here."""
        with self._lock:
            state, failed = self._collectives.get(cid), self._failed.get(cid)
        if state is not None:
            with state.lock:
                return state.holding_back()
        return {} if failed is None else failed.holding_back

    def _state(self, rank: int, header: wire.Header) -> CollectiveShard | None:
        """The shard of `rank`'s contribution, made by the collective's first one; None if the
        collective failed (the rank is told why, if it never was)."""
        with self._lock:
            failed = self._failed.get(header.collective)
            if failed is not None:
                worker = self.workers.get(rank) if rank not in failed.told else None
                failed.told.add(rank)
            state = self._collectives.get(header.collective)
            if failed is None and state is None and self._broken is None:
                if len(self._collectives) >= MAX_ACTIVE_COLLECTIVES:
                    raise ProtocolError(f"collective {header.collective} would be the "
                                        f"{len(self._collectives) + 1}th in progress in job "
                                        f"{self.job:#x}; the limit is {MAX_ACTIVE_COLLECTIVES}")
                state = self._collectives[header.collective] = CollectiveShard(header.descriptor,
                                                                               self)
        if failed is not None:
            if worker is not None:      # attached after the failure went out
                worker.send_error(self.job, header.collective, failed.code, failed.text)
            return None
        if self._broken is not None:
            self.fail(header.collective, *self._broken)
            return None
        return state

    def _broadcast(self, h: wire.Header, result: Result) -> None:
        header = wire.data_header(wire.Kind.RESULT, stream=h.stream, job=self.job,
                                  collective=h.collective, seq=result.seq,
                                  count=result.indices.size, progress=result.progress,
                                  descriptor=h.descriptor)
        indices = result.indices.astype(wire.INDEX_DTYPE)
        # Remote workers first: once the local worker has its last result it may close this
        # aggregator, and every result queued before that is still flushed.
        workers = sorted(self.workers.values(), key=lambda w: isinstance(w, LocalWorker))
        # Sums kept in a contribution's memory: its lease goes back once every worker had them.
        shared = Lease.shared(result.lease, len(workers))
        for worker in workers:
            worker.send_result(h, header, indices, result, shared)

    def fail(self, collective: int, code: wire.ErrorCode, text: str) -> None:
        """Fail one collective on every worker; its late messages are then dropped."""
        with self._lock:
            if collective in self._failed:
                return
            state = self._collectives.get(collective)
        # Who it waits for, kept with the failure: a rank timing out as a peer's failure lands here
        # still names them. Taken before the shard goes (state.lock before self._lock, as contribute
        # takes them), so that holding_back always finds them in one or the other.
        late = {}
        if state is not None:
            with state.lock:
                late = state.holding_back()
        with self._lock:
            if collective in self._failed:
                return
            # kept as long as a refusal carries (a reason may be 64 KiB, and 64 are kept a job)
            self._failed[collective] = Failed(code, text[:wire.MAX_REASON_BYTES], set(self.workers), late)
            while len(self._failed) > FAILED_MEMORY:
                self._failed.popitem(last=False)
            state = self._collectives.pop(collective, None)
            workers = list(self.workers.values())
        if state is not None:
            with state.lock:    # a contribution being summed into a worker's memory ends first
                state.dropped = True
                released = [lease for stream in state.streams for lease in stream.drop()]
            for lease in released:
                give_back(lease)
        self._failures_logged.warn(f"job {self.job:#x} collective {collective} failed: {text}")
        for worker in workers:
            worker.send_error(self.job, collective, code, text)

    def detach(self, rank: int, reason: tuple[wire.ErrorCode, str] | None) -> None:
        """A worker left, for `reason` (the code and text its collectives fail with; None: on
        purpose). Every collective now in progress or started later fails, since it can never
        complete without that worker."""
        with self._lock:
            self.workers.pop(rank, None)
            self._broken = self._broken or reason or (wire.ErrorCode.PEER,
                                                      f"rank {rank} left the job")
            active = list(self._collectives)
        for collective in active:
            self.fail(collective, *self._broken)
