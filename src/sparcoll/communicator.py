"""The worker side: a Communicator runs block-sparse allreduces through colocated or dedicated aggregators.

Data flow of one allreduce (see docs/architecture.md):
  caller thread  validates the tensor; a blocking call with nothing queued then runs the collective
                 itself, as the engine would; anything else is queued (ranks call collectives in one order)
  engine thread  scans the tensor for non-zero blocks, sends each (aggregator, stream) range's first
                 contributions, then waits for completion or the deadline
  receiver threads (one per remote aggregator) read results straight into the tensor and send the
                 next contributions that the freed credits allow
  local thread   does the same for results of this process's own (colocated) aggregator
Only one collective per communicator is in flight, so its memory and the aggregators' stay bounded.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import numpy as np
import torch

from . import errors, transport, wire
from .aggregator import AggregatorJob, AggregatorServer, LocalWorker
from .blocks import BlockTensor, CompactBlocks, SparseBlocks, StagedBlocks, as_bytes, runs
from .errors import (CollectiveTimeout, MismatchError, PeerError, PoisonedError, ProtocolError,
                     SparcollError)
from .protocol import Geometry, WorkerStream

log = logging.getLogger("sparcoll")
RUN_LIMIT = 32          # more runs than this in a message: gather/scatter through one buffer instead
DEFAULT_BLOCK_SIZE = 256
DEFAULT_STREAMS = 1
DEFAULT_MESSAGE_BLOCKS = 2048
DEFAULT_CREDITS = 2     # messages in flight per stream; more only queue up in the links (see docs/benchmarks.md)
# Message size adapts to the link: a message should take about MESSAGE_SECONDS on the wire. On a
# slow link big messages make every aggregator wait longer for the slowest worker's next message
# (measured at 1 Gbit/s: 2 MiB messages 10-15% slower than 256 KiB ones); on a fast one each
# message costs CPU, so big ones win. Collectives that move less than ADAPT_MIN_BYTES say too
# little about the rate and leave the size as it is.
MESSAGE_SECONDS = 0.004
ADAPT_MIN_BYTES = 8 << 20
DISCARD_BYTES = 1 << 20  # results of a collective this rank gave up are read through this much
ERROR_TYPES = {wire.ErrorCode.MISMATCH: MismatchError, wire.ErrorCode.PEER: PeerError,
               wire.ErrorCode.PROTOCOL: ProtocolError, wire.ErrorCode.GENERIC: SparcollError}
OPS = {"sum": wire.Op.SUM, "avg": wire.Op.AVG}


@dataclass
class Stats(transport.TrafficStats):
    """Traffic this process's transport wrote and read on the worker's behalf, and collectives run."""
    collectives: int = 0


class Work:
    """Handle of an asynchronous allreduce."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Work"], None]] = []
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until done; return the tensor or raise the collective's error."""
        if not self._event.wait(timeout):
            raise CollectiveTimeout(f"allreduce not finished after {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self.tensor

    def is_completed(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """Call fn(work) once done (at once if already done); used to complete torch futures."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:   # a caller's callback must not take the engine thread down
                log.exception("a done-callback of an allreduce raised")


class _Collective:
    """Worker-side state of one allreduce: of a dense tensor (in place) or of a sparse COO tensor."""

    def __init__(self, cid: int, tensor: torch.Tensor, descriptor: tuple, work: Work,
                 timeout: float):
        self.id = cid
        self.tensor = tensor
        self.sparse = tensor.layout == torch.sparse_coo
        self.descriptor = descriptor
        self.work = work
        self.timeout = timeout
        self.streams: dict[tuple[int, int], WorkerStream | None] = {}   # None: not started yet
        self.stream_locks: dict[tuple[int, int], threading.Lock] = {}
        self.blocks: BlockTensor | CompactBlocks | None = None
        self.lock = threading.Lock()
        self.remaining = 0
        self.done = threading.Event()
        self.error: BaseException | None = None
        # Contributions to the own aggregator whose memory (the tensor) it may still read or sum
        # into: the collective completes only once it has let go of all of them.
        self._holds = 0
        self.unheld = threading.Event()
        self.unheld.set()

    def hold(self) -> Callable[[], None]:
        """Count one contribution lent to the own aggregator; returns its release."""
        with self.lock:
            self._holds += 1
            self.unheld.clear()
        return self._release

    def _release(self) -> None:
        with self.lock:
            self._holds -= 1
            if self._holds == 0:
                self.unheld.set()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None and not self.done.is_set():
                self.error = error
        self.done.set()

    def stream_done(self) -> None:
        with self.lock:
            self.remaining -= 1
            if self.remaining:
                return
            result = self.blocks.finish()
            if self.sparse:
                self.work.tensor = result
        self.done.set()

    def prepare(self, block_size: int) -> None:
        """Find the non-zero blocks: the stored entries of a COO tensor; a scan in place for a
        contiguous CPU tensor; a scan where it lives, then a copy of the non-zero blocks, otherwise."""
        t = self.tensor
        if self.sparse:
            self.blocks = SparseBlocks(t, block_size)
        elif t.device.type == "cpu" and t.is_contiguous():
            self.blocks = BlockTensor(t.view(-1), block_size)
        else:
            self.blocks = StagedBlocks(t, block_size)


def fit_message_blocks(rate: float, block_bytes: int, limit: int) -> int:
    """Blocks per message for a link that delivered `rate` bytes/s: the largest power of two whose
    message takes at most MESSAGE_SECONDS, kept within [limit / 8, limit] (rounding down to a power
    of two keeps ranks that measure slightly different rates on the same size)."""
    fit = rate * MESSAGE_SECONDS / block_bytes
    size = 1 << math.floor(math.log2(fit)) if fit >= 1 else 1
    return max(1, limit >> 3, min(limit, size))


def _env_default(value, name: str, parse: Callable, default):
    if value is not None:
        return value
    raw = os.environ.get(name)
    return parse(raw) if raw else default


def _parse_aggregators(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        transport.parse_address(address)
    return addresses


def local_host() -> str:
    """The address peers can reach this process at: SPARCOLL_HOST, else the interface that routes
    to MASTER_ADDR (no packet is sent), else loopback."""
    if os.environ.get("SPARCOLL_HOST"):
        return os.environ["SPARCOLL_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Communicator:
    """Block-sparse allreduce for one group of `world` ranks, bootstrapped through `store`."""

    def __init__(self, store, rank: int, world: int, *, block_size: int | None = None,
                 aggregators: list[str] | None = None, streams: int | None = None,
                 message_blocks: int | None = None, credits: int | None = None,
                 timeout: float = 60.0, host: str | None = None):
        self.rank, self.world = rank, world
        self.block_size = int(_env_default(block_size, "SPARCOLL_BLOCK_SIZE", int,
                                           DEFAULT_BLOCK_SIZE))
        streams = _env_default(streams, "SPARCOLL_STREAMS", int, DEFAULT_STREAMS)
        message_blocks = _env_default(message_blocks, "SPARCOLL_MESSAGE_BLOCKS", int,
                                      DEFAULT_MESSAGE_BLOCKS)
        credits = _env_default(credits, "SPARCOLL_CREDITS", int, DEFAULT_CREDITS)
        aggregators = _env_default(aggregators, "SPARCOLL_AGGREGATORS", _parse_aggregators, None)
        if not 1 <= self.block_size <= wire.MAX_BLOCK_SIZE:
            raise ValueError(f"block_size {self.block_size} outside [1, {wire.MAX_BLOCK_SIZE}]")
        if message_blocks * self.block_size * 8 > wire.MAX_MESSAGE_BYTES:
            raise ValueError(f"message_blocks x block_size x 8 bytes exceeds "
                             f"{wire.MAX_MESSAGE_BYTES} bytes")
        self.timeout = float(timeout)
        self.aggregators = list(aggregators) if aggregators else None
        num_aggs = len(self.aggregators) if self.aggregators else world
        self.config = wire.JobConfig(world, num_aggs, streams, credits, message_blocks)
        self.config.check()
        self.message_blocks = message_blocks   # this rank's current message size, <= the limit
        self._closed = False
        self._poison: BaseException | None = None
        self._active: _Collective | None = None
        self._next_id = 1
        self._last_started = 0
        self._early_errors: dict[int, BaseException] = {}
        self._state_lock = threading.Lock()
        self._connections: dict[int, transport.Connection] = {}
        self._threads: list[threading.Thread] = []
        self._server: AggregatorServer | None = None
        self._local_job: AggregatorJob | None = None
        self._local_index: int | None = None
        self._local_events: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0                        # requests put for the engine and not yet started
        self._running = threading.Lock()        # held by whichever thread runs a collective
        self._collectives_done = 0
        self._engine: threading.Thread | None = None
        try:
            self._bootstrap(store, host)
        except BaseException as exc:
            self._announce_init_failure(store, exc)
            self.close()
            raise
        self._engine = self._spawn(self._engine_loop, "sparcoll-engine")

    # ---- set-up --------------------------------------------------------------------------------
    def _bootstrap(self, store, host: str | None) -> None:
        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            store.set("job", secrets.token_bytes(8 + 32))
        self._store_wait(store, ["job"], deadline)
        blob = store.get("job")
        self.job, job_secret = int.from_bytes(blob[:8], "little"), blob[8:]
        token = wire.job_token(job_secret)
        if self.aggregators is None:
            self._server = AggregatorServer(host or local_host(), 0, job_secret, only_job=self.job)
            self._local_index = self.rank
            self._local_job = self._server.add_job(self.job, self.rank, self.config, token)
            self._local_job.attach(self.rank, LocalWorker(self._local_events.put))
            store.set(f"aggregator/{self.rank}", self._server.address)
            keys = [f"aggregator/{r}" for r in range(self.world)]
            self._store_wait(store, keys, deadline)
            addresses = [store.get(k).decode() for k in keys]
            secret = job_secret
            self._spawn(self._local_loop, "sparcoll-local")
        else:
            addresses = self.aggregators
            secret = os.environ.get("SPARCOLL_SECRET", "").encode()
        self.addresses = addresses
        for index, address in enumerate(addresses):
            if index == self._local_index:
                continue
            hello = wire.Hello(self.job, self.rank, index, self.config, os.urandom(wire.NONCE_BYTES))
            try:
                sock = transport.connect(address, hello, secret,
                                         max(0.1, deadline - time.monotonic()), token,
                                         abandon=lambda i=index: self._init_failure_of(store, i))
            except (PeerError, CollectiveTimeout) as exc:
                raise self._init_failure_of(store, index) or exc
            conn = transport.Connection(sock, f"aggregator {index} at {address}",
                                        lambda exc, i=index: self._broken(i, exc))
            self._connections[index] = conn
            self._spawn(lambda i=index, c=conn: self._receive_loop(i, c), f"sparcoll-recv-{index}")
        # No rank leaves init (and so can close its aggregator) before every rank is connected.
        store.set(f"ready/{self.rank}", b"1")
        self._store_wait(store, [f"ready/{r}" for r in range(self.world)], deadline)

    def _announce_init_failure(self, store, exc: BaseException) -> None:
        """Tell the peers why this rank gives up init: its aggregator closes now, and a peer that
        finds it gone should report this reason, not a refused connection or a timeout."""
        try:
            store.set(f"init-failed/{self.rank}", f"{type(exc).__name__}\n{exc}")
        except Exception:   # best effort: the Store itself may be what failed
            pass

    def _init_failure_of(self, store, index: int) -> SparcollError | None:
        """The error rank `index` announced when it gave up init, if it did (colocated aggregators
        only: a dedicated aggregator is not a rank)."""
        if self._local_index is None:
            return None
        key = f"init-failed/{index}"
        try:
            if not store.check([key]):
                return None
            kind, _, text = store.get(key).decode("utf-8", "replace").partition("\n")
        except Exception:
            return None
        cls = getattr(errors, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, SparcollError)):
            cls = PeerError
        return cls(f"rank {index} gave up init: {text}")

    def _store_wait(self, store, keys: list[str], deadline: float) -> None:
        remaining = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(0.1, remaining)))
        except Exception as exc:   # torch raises a plain RuntimeError/DistStoreError on timeout
            raise CollectiveTimeout(f"rank {self.rank}: peers did not publish {keys} in the "
                                    f"store within {self.timeout:g} s ({exc})") from None

    def _spawn(self, target: Callable, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    # ---- public API ----------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                  timeout: float | None = None):
        """Sum (op="sum") or average (op="avg") `tensor` over all ranks, in place.
        Returns the tensor, or a Work handle with async_op=True."""
        return self._submit(tensor, torch.strided, op, async_op, timeout)

    def allreduce_coo(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                      timeout: float | None = None):
        """Sum or average a sparse COO tensor (such as an nn.Embedding(sparse=True) gradient) over all
        ranks without densifying it: only the blocks its entries touch are sent. Returns a new
        coalesced COO tensor (or a Work whose wait() returns it); ranks may store different entries."""
        return self._submit(tensor, torch.sparse_coo, op, async_op, timeout)

    def _submit(self, tensor, layout, op, async_op, timeout):
        with self._state_lock:
            if self._closed:
                raise SparcollError("communicator is closed")
            cid = self._next_id
            self._next_id += 1
        try:    # a bad input is reported as such, poisoned communicator or not
            descriptor = self._describe(tensor, layout, op)
        except (TypeError, ValueError) as exc:
            self._queue(("abort", cid, f"rejected its input: {exc}"))
            self._set_poison(exc)
            raise
        with self._state_lock:   # a peer's own report of this collective beats our poison
            poison = None if cid in self._early_errors else self._poison
        if poison is not None:
            raise PoisonedError(f"an earlier collective failed ({poison}); create a new "
                                f"communicator") from poison
        work = Work(tensor)
        coll = _Collective(cid, tensor, descriptor, work, self.timeout if timeout is None else timeout)
        # A blocking call with nothing queued before it runs on the caller's thread: two thread
        # hand-offs less per collective (about 1 ms of a 12 ms sparse allreduce on 2 busy cores).
        if not async_op and self._running.acquire(blocking=False):
            try:
                with self._state_lock:
                    idle = self._queued == 0
                if idle:
                    work._finish(self._execute(coll))
            finally:
                self._running.release()
        if not work.is_completed():
            self._queue(("run", coll))
            if not async_op and threading.current_thread() is self._engine:
                # Called from a done-callback on the engine thread: nobody else would serve the
                # queue, so this thread serves it (in order) up to and including this collective.
                while not work.is_completed():
                    if not self._serve(self._requests.get()):
                        self._requests.put(None)      # closing: the engine loop stops on it
                        work._finish(SparcollError("the communicator was closed"))
        return work if async_op else work.wait()

    def _queue(self, request: tuple) -> None:
        with self._state_lock:
            self._queued += 1
        self._requests.put(request)

    def _describe(self, tensor, layout, op) -> tuple[int, int, int, int]:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"allreduce takes a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != layout:
            hint = " (use allreduce_coo for sparse COO tensors)" if layout == torch.strided else ""
            raise TypeError(f"expected layout {layout}, got {tensor.layout}{hint}")
        if tensor.dtype not in wire.DTYPE_CODES:
            raise TypeError(f"sparcoll does not support dtype {tensor.dtype}; supported: "
                            + ", ".join(str(d) for d, _ in wire.DTYPES.values()))
        if tensor.device.type == "meta":
            raise ValueError(f"tensor on device {tensor.device} holds no data to reduce")
        op_name = op if isinstance(op, str) else getattr(op, "name", str(op)).lower()
        if op_name not in OPS:
            raise ValueError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
        return (tensor.numel(), self.block_size, wire.DTYPE_CODES[tensor.dtype], OPS[op_name])

    @property
    def stats(self) -> Stats:
        total = Stats(collectives=self._collectives_done)
        for conn in self._connections.values():
            total.add(conn.stats)
        return total

    def _bytes_received(self) -> int:
        """Bytes this process read from the network so far, for its worker and its aggregator."""
        return self.stats.bytes_received + self.aggregator_stats.bytes_received

    @property
    def aggregator_stats(self) -> transport.TrafficStats:
        """Traffic of this process's colocated aggregator (zero with dedicated aggregators)."""
        return self._server.traffic() if self._server else transport.TrafficStats()

    def close(self) -> None:
        """Leave the job and stop every thread; always returns."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        self._requests.put(None)
        coll = self._active
        if coll is not None:
            coll.fail(SparcollError("the communicator was closed during the collective"))
        if self._engine is not None and self._engine is not threading.current_thread():
            self._engine.join(timeout=5.0)   # it sends what is queued, e.g. an abort
        for conn in self._connections.values():
            conn.send([wire.bye_message(self.job)])
            conn.close()
        if self._local_job is not None:
            # Peers still waiting on this aggregator learn why it leaves (a cascade then names the
            # peer that failed first) before its connections close.
            with self._state_lock:
                poison = self._poison
            self._local_job.detach(self.rank, None if poison is None else
                                   f"rank {self.rank} left the job after an error: {poison}")
        if self._server is not None:
            self._server.close()
        self._local_events.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- engine --------------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        while self._serve(self._requests.get()):
            pass

    def _serve(self, request: tuple | None) -> bool:
        """Carry out one queued request; False for the stop request (None)."""
        if request is None:
            return False
        with self._running:
            with self._state_lock:
                self._queued -= 1
            if request[0] == "abort":
                self._abort(request[1], request[2])
                return True
            coll = request[1]
            error = self._execute(coll)
        coll.work._finish(error)    # outside the lock: a done-callback may start the next one
        return True

    def _execute(self, coll: _Collective) -> BaseException | None:
        """Run one collective, in submission order, on the engine or a blocking caller's thread."""
        with self._state_lock:   # a peer's own report of this collective beats our poison
            error = self._early_errors.pop(coll.id, None)
        if error is None and self._poison is not None:
            error = PoisonedError(f"an earlier collective failed ({self._poison})")
        if error is None:
            try:
                error = self._run(coll)
            except BaseException as exc:    # e.g. Ctrl-C in a caller's thread: peers must not wait
                self._set_poison(SparcollError(f"allreduce {coll.id} was interrupted ({exc!r})"))
                self._abort(coll.id, f"allreduce {coll.id} was interrupted")
                raise
        if error is not None:
            self._set_poison(error)
        else:
            self._collectives_done += 1
        return error

    def _run(self, coll: _Collective) -> BaseException | None:
        start, received = time.monotonic(), self._bytes_received()
        coll.prepare(self.block_size)
        geometry = Geometry(coll.blocks.nblocks, self.config.num_aggs, self.config.streams)
        # Remote ranges first, the own aggregator's last: a range's messages travel while the next
        # range is scanned, and peers' aggregators get this rank's blocks as early as possible.
        ranges = sorted(geometry.ranges(), key=lambda r: r[0] == self._local_index)
        for agg, stream, _, _ in ranges:    # every key now: other threads iterate this dict
            coll.streams[agg, stream] = None
            coll.stream_locks[agg, stream] = threading.Lock()
        coll.remaining = len(ranges)
        with self._state_lock:
            self._active = coll
            self._last_started = coll.id
            early = self._early_errors.pop(coll.id, None)   # arrived since the engine took it
        if early is not None:
            coll.fail(early)
        try:
            self._drive(coll, ranges)
        finally:
            with self._state_lock:
                self._active = None
        received = self._bytes_received() - received
        if coll.error is None and received >= ADAPT_MIN_BYTES:
            rate = received / max(time.monotonic() - start, 1e-6)
            block_bytes = self.block_size * coll.tensor.element_size()
            self.message_blocks = fit_message_blocks(rate, block_bytes, self.config.message_blocks)
        return coll.error

    def _drive(self, coll: _Collective, ranges: list) -> None:
        """Send the first contributions of every range, then wait for the results or the deadline."""
        try:
            for agg, stream, lo, hi in ranges:
                coll.streams[agg, stream] = WorkerStream(lo, hi, coll.blocks.nonzero(lo, hi),
                                                         self.message_blocks,
                                                         self.config.credits)
                self._advance(coll, agg, stream)
        except SparcollError as exc:
            coll.fail(exc)
        deadline = time.monotonic() + coll.timeout
        if not coll.done.wait(coll.timeout):
            coll.fail(CollectiveTimeout(self._describe_stall(coll)))
        # Peers may still be sent the own shard's sums from the tensor: finish after that. (Not
        # after a failure: the aggregator then dropped the collective and its peers fail it too.)
        if coll.error is None and not coll.unheld.wait(max(0.0, deadline - time.monotonic())):
            with coll.lock:
                coll.error = CollectiveTimeout(
                    f"rank {self.rank}: allreduce {coll.id}: its aggregator could not send the "
                    f"results to every peer within {coll.timeout:g} s")

    def _describe_stall(self, coll: _Collective) -> str:
        waiting = sorted({agg for (agg, _), ws in coll.streams.items() if ws is None or not ws.done})
        who = ", ".join(f"aggregator {a} at {self.addresses[a]}" for a in waiting)
        return (f"rank {self.rank}: allreduce {coll.id} not finished after {coll.timeout:g} s; "
                f"still waiting for {who} (a peer may be dead, stuck, or calling other collectives)")

    def _advance(self, coll: _Collective, agg: int, stream: int, result=None) -> None:
        """Accept a result's metadata (if any), then send what the credits allow. Serialized per
        stream: the engine's first sends and a receiver's next ones must not interleave."""
        ws = coll.streams[agg, stream]
        with coll.stream_locks[agg, stream]:
            if result is not None:
                ws.on_result(*result)
            self._transmit(coll, agg, stream, ws.next_sends())

    def _transmit(self, coll: _Collective, agg: int, stream: int, sends) -> None:
        """Send contributions: direct calls to the local aggregator, zero-copy views to remote ones."""
        ws = coll.streams[agg, stream]
        for send in sends:
            indices = ws.indices[send.start:send.stop]
            if agg == self._local_index:
                # In place, the own aggregator may sum straight into the tensor (its result
                # then needs no copy, and is sent to the peers from there).
                header = wire.Header(wire.Kind.CONTRIBUTE, stream, self.job, coll.id, send.seq,
                                     indices.size, send.progress, *coll.descriptor)
                self._local_job.contribute(self.rank, header, indices,
                                           coll.blocks.rows_of(indices), coll.hold(),
                                           reuse=2 if coll.blocks.direct else 0)
                continue
            header = wire.data_header(wire.Kind.CONTRIBUTE, stream=stream, job=self.job,
                                      collective=coll.id, seq=send.seq, count=indices.size,
                                      progress=send.progress, descriptor=coll.descriptor)
            spans = runs(indices, RUN_LIMIT)
            if spans is None:
                payload = [as_bytes(coll.blocks.gather(indices))]
            else:
                payload = [as_bytes(v) for start, stop in spans
                           for v in coll.blocks.views(start, stop)]
            self._connections[agg].send([header, as_bytes(indices.astype(wire.INDEX_DTYPE)), *payload],
                                        blocks=indices.size)

    # ---- results -------------------------------------------------------------------------------
    def _current(self, cid: int) -> _Collective | None:
        coll = self._active
        return coll if coll is not None and coll.id == cid else None

    def _receive_loop(self, agg: int, conn: transport.Connection) -> None:
        max_blocks = self.world * self.config.credits * self.config.message_blocks
        staging = torch.empty(0, dtype=torch.uint8)
        discard = torch.empty(DISCARD_BYTES, dtype=torch.uint8)
        try:
            while True:
                h = conn.recv_header(max_blocks, self.job)
                if h.kind is wire.Kind.ERROR:
                    text = bytearray(h.count)
                    conn.recv_into(memoryview(text))
                    self._collective_error(h.collective, h.op, text.decode("utf-8", "replace"))
                    continue
                if h.kind is not wire.Kind.RESULT:
                    raise ProtocolError(f"unexpected {h.kind.name} message from an aggregator")
                indices = np.empty(h.count, dtype=wire.INDEX_DTYPE)
                conn.recv_into(as_bytes(indices))
                nbytes = h.payload_sizes()[1]
                if h.block_size != self.block_size:
                    raise ProtocolError(f"result with block size {h.block_size}, this job uses "
                                        f"{self.block_size}")
                coll = self._current(h.collective)
                if coll is None:    # a collective that already failed here: drop its results
                    for offset in range(0, nbytes, DISCARD_BYTES):
                        conn.recv_into(as_bytes(discard)[:min(DISCARD_BYTES, nbytes - offset)])
                    continue
                staging = self._on_result(coll, agg, conn, h, indices.astype(np.int64), staging)
        except (SparcollError, OSError) as exc:
            if not self._closed:
                self._broken(agg, exc)

    def _on_result(self, coll: _Collective, agg: int, conn: transport.Connection, h: wire.Header,
                   indices: np.ndarray, staging: torch.Tensor) -> torch.Tensor:
        if h.descriptor != coll.descriptor or coll.streams.get((agg, h.stream)) is None:
            raise ProtocolError(f"result for stream {h.stream} with descriptor {h.descriptor} does "
                                f"not match collective {coll.id}")
        ws = coll.streams[agg, h.stream]
        self._advance(coll, agg, h.stream, (h.seq, h.progress, indices))
        spans = runs(indices, RUN_LIMIT) if coll.blocks.direct else None
        if spans is not None:
            for start, stop in spans:
                for view in coll.blocks.views(start, stop):
                    conn.recv_into(as_bytes(view))
        elif not coll.blocks.direct:
            rows = coll.blocks.receive_buffer(h.count)
            conn.recv_into(as_bytes(rows))
            coll.blocks.keep(indices, rows)
        else:
            nbytes = h.payload_sizes()[1]
            if staging.numel() < nbytes:
                staging = torch.empty(nbytes, dtype=torch.uint8)
            conn.recv_into(as_bytes(staging)[:nbytes])
            rows = staging[:nbytes].view(coll.blocks.dtype).view(h.count, self.block_size)
            coll.blocks.scatter(indices, rows)
        conn.count(blocks_received=h.count)
        if ws.done:
            coll.stream_done()
        return staging

    def _local_loop(self) -> None:
        """Results and errors from this process's own aggregator (delivered without sockets)."""
        while True:
            event = self._local_events.get()
            if event is None:
                return
            if event[0] == "error":
                _, cid, code, text = event
                self._collective_error(cid, code, text)
                continue
            _, cid, stream, result, taken = event
            try:
                self._on_local_result(cid, stream, result)
            finally:
                transport.release(taken)    # the aggregator may reuse the result's memory now

    def _on_local_result(self, cid: int, stream: int, result) -> None:
        coll = self._current(cid)
        if coll is None:
            return
        try:
            ws = coll.streams[self._local_index, stream]
            self._advance(coll, self._local_index, stream,
                          (result.seq, result.progress, result.indices))
            coll.blocks.scatter(result.indices, result.rows)   # no copy when summed in place
            if ws.done:
                coll.stream_done()
        except SparcollError as exc:
            coll.fail(exc)

    # ---- failures ------------------------------------------------------------------------------
    def _collective_error(self, cid: int, code: int, text: str) -> None:
        error = ERROR_TYPES.get(code, SparcollError)(text)
        with self._state_lock:
            coll = self._current(cid)
            if coll is None and cid > self._last_started:
                # A peer failed a collective this rank has queued but not started yet.
                self._early_errors[cid] = error
        if coll is not None:
            coll.fail(error)

    def _broken(self, agg: int, exc: BaseException) -> None:
        """A connection to an aggregator failed: every later collective fails, and so does the
        current one if it still needs that aggregator (a peer that finished first may leave)."""
        error = exc if isinstance(exc, PeerError) else PeerError(
            f"connection to aggregator {agg} at {self.addresses[agg]} failed: {exc}")
        self._set_poison(error)
        coll = self._active
        if coll is not None and any(ws is None or not ws.done
                                    for (a, _), ws in coll.streams.items() if a == agg):
            coll.fail(error)

    def _set_poison(self, error: BaseException) -> None:
        with self._state_lock:
            if self._poison is None:
                self._poison = error

    def _abort(self, cid: int, text: str) -> None:
        """Tell every aggregator that this rank gives up collective `cid`, so no peer waits for it."""
        for index in range(self.config.num_aggs):
            if index == self._local_index:
                self._local_job.fail(cid, wire.ErrorCode.GENERIC, f"rank {self.rank}: {text}")
            else:
                self._connections[index].send(wire.error_message(self.job, cid, text,
                                                                 wire.ErrorCode.GENERIC))
