"""The engine: runs a communicator's collectives one at a time, in the order the rank submitted them.

Each runs on the sparse AllReduce or on gloo's ring, as the chooser says (algorithm.py); what it
learns from a result (and from times the ranks average in a ring round) decides later collectives of
the same kind, identically on every rank, because all of it is complete before the next collective
starts.

Only one collective is in flight, so a worker's memory and the aggregators' stay bounded. Ranks must
call collectives in one order; each gets the next id. Three ways a collective runs:
  - a blocking call with nothing queued before it runs on the caller's thread (two thread hand-offs
    less: about 1 ms of a 12 ms sparse allreduce on 2 busy cores);
  - anything else is queued for the engine thread;
  - a blocking call made from a done-callback on the engine thread serves the queue itself, in
    order, up to its own collective (nobody else would).

Whatever a collective raises (a bug, a tensor the scan cannot read, a failing callback), the engine
fails that collective with a SparcollError whose cause is the original, tells every aggregator so the
peers raise too, poisons the communicator, and goes on: no exception ends the engine thread. Every
Work's wait() has a deadline.

The communicator moves through named states, changed only here:
  OPEN -> POISONED   a collective failed: every later one fails at once (PoisonedError)
  OPEN | POISONED -> CLOSED
"""
from __future__ import annotations

import enum
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import densified, wire
from .algorithm import Algorithm, Chooser
from .collective import WorkerCollective
from .errors import CollectiveTimeout, PoisonedError, SparcollError
from .lifecycle import Lifecycle
from .ring import Ring
from .worker import WorkerJob

log = logging.getLogger("sparcoll")
GRACE = 5.0     # seconds a Work may take beyond the deadlines of the collectives it waits for


class Work:
    """Handle of an asynchronous allreduce. `deadline` (time.monotonic()) bounds wait() without a
    timeout: the collective and every one queued before it must have ended by then. `owner` (its
    Communicator) is kept alive until it is done, as torch's Work keeps its group: a communicator
    dropped with only its Work kept failed it ("closed before the collective ran"; a review)."""

    def __init__(self, tensor: torch.Tensor, cid: int, deadline: float,
                 expired: Callable[[BaseException], None] = lambda error: None, owner: object = None):
        self.tensor = tensor
        self._owner = owner
        self.id = cid
        self.deadline = deadline
        self._expired = expired     # told when wait() gives up at the deadline
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Work"], None]] = []
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until done (at most `timeout` seconds, else until the deadline); return the tensor
        or raise the collective's error."""
        at_deadline = timeout is None
        if at_deadline:
            timeout = max(0.0, self.deadline - time.monotonic())
        elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ValueError(f"wait's timeout must be a finite number of seconds >= 0, got {timeout!r}")
        if not self._event.wait(timeout):
            error = CollectiveTimeout(f"allreduce {self.id} not finished after {timeout:g} s")
            if at_deadline:     # not to run later, writing the tensor after this error
                self._expired(error)
            raise error
        if self._error is not None:
            raise self._error
        return self.tensor

    def is_completed(self) -> bool:
        return self._event.is_set()

    def give_up(self, error: BaseException) -> None:
        """A caller gave up waiting at the deadline with `error`: the collective must not run (and
        write the tensor) after that, so the communicator is poisoned, as wait() at its deadline does."""
        if not self.is_completed():
            self._expired(error)

    def exception(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """Call fn(work) once done and after every callback added before it; used to complete torch
        futures. One added while the finishing thread still runs earlier ones is left to that
        thread: sparse.allreduce_coo's first callback copies the sum into the caller's tensor, and a
        later one completes the future the caller waits on (run at once, it once let a rank read its
        own input back as the sum)."""
        with self._lock:
            if not self._event.is_set():        # set once every callback added so far has run
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None) -> None:
        """Done: run the callbacks in order (those added meanwhile too), then let wait() return, so
        that what a callback writes (the COO sum into the caller's tensor) is there when it does. A
        callback that raises fails the Work for the callbacks after it and for wait(), unless it
        had failed already."""
        with self._lock:
            self._error = error
        interrupted = None
        while True:
            with self._lock:
                callbacks, self._callbacks = self._callbacks, []
                if not callbacks:
                    self._event.set()
                    self._owner = None
                    break
            for fn in callbacks:
                try:
                    fn(self)
                except BaseException as exc:    # a caller's callback must not take the engine thread
                    # down (not even by SystemExit); Ctrl-C on the caller's own thread goes on up
                    # once the Work is finished
                    log.exception("a done-callback of allreduce %d raised", self.id)
                    if not isinstance(exc, Exception) and threading.current_thread() is threading.main_thread():
                        interrupted = interrupted or exc
                    with self._lock:
                        if self._error is None:
                            self._error = SparcollError(f"allreduce {self.id}: a done-callback raised "
                                                        f"{type(exc).__name__}: {exc}")
                            self._error.__cause__ = exc
        if interrupted is not None:
            raise interrupted


class CommunicatorState(enum.Enum):
    OPEN = "open"
    POISONED = "poisoned"
    CLOSED = "closed"


_MOVES = {
    CommunicatorState.OPEN: frozenset({CommunicatorState.POISONED, CommunicatorState.CLOSED}),
    CommunicatorState.POISONED: frozenset({CommunicatorState.CLOSED}),
}


@dataclass(frozen=True)
class Run:
    """Run this collective and complete its Work."""
    coll: WorkerCollective
    work: Work


@dataclass(frozen=True)
class Abort:
    """Tell every aggregator that this rank gives up collective `cid` (its input was refused), then
    poison the communicator with `error`."""
    cid: int
    text: str
    error: BaseException


class Engine:
    """Orders and executes the collectives of one rank."""

    def __init__(self, rank: int, worker: WorkerJob, chooser: Chooser, ring: Ring | None):
        self.rank = rank
        self.worker = worker
        self.chooser = chooser
        self.ring = ring                        # None when the chooser never picks it
        self.state = Lifecycle(f"communicator of rank {rank}", CommunicatorState.OPEN, _MOVES)
        self.poison: BaseException | None = None    # the error that moved it to POISONED
        self.collectives_done = 0
        self._lock = threading.Lock()
        self._next_id = 1
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0                        # requests put and not yet started
        self._ahead_s = 0.0     # the timeouts (plus GRACE) of the collectives submitted, not yet done
        self._running = threading.Lock()        # held by whichever thread runs a collective
        # Held from taking a call's id to its place in line (place): collectives run in id order, as
        # the aggregators pair them. Two threads of one rank calling at once (a metrics thread beside
        # training) ran the later id first on the caller's thread, and the ranks waited for each
        # other until the timeout (a review).
        self.order = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="sparcoll-engine", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        with self._lock:
            if self.state.is_(CommunicatorState.CLOSED):
                raise SparcollError("communicator is closed")
            cid = self._next_id
            self._next_id += 1
        return cid

    def set_poison(self, error: BaseException) -> None:
        with self._lock:
            if self.state.is_(CommunicatorState.OPEN):
                self.poison = error
                self.state.move(CommunicatorState.POISONED)

    def reject(self, cid: int, exc: BaseException) -> None:
        """This rank refused its own input for collective `cid`: peers must not wait for it. The
        communicator is poisoned at the refusal's turn, after the collectives queued before it: poisoned
        at once, those failed here with PoisonedError, unannounced, and the peers waited for them
        until their timeout (a review: 20 s)."""
        self._put(Abort(cid, f"rejected its input: {exc}", exc))

    def check_poison(self, cid: int) -> None:
        """PoisonedError if an earlier collective failed (unless a peer's own report of this
        collective is waiting, or comes soon after a lost connection: that one is the better
        error)."""
        with self._lock:
            poison = self.poison
        if poison is not None and not self.worker.early_error_soon(cid):
            raise _poisoned(poison) from poison

    def on_its_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def place(self, coll: WorkerCollective, tensor: torch.Tensor, async_op: bool,
              owner: object = None) -> Work | None:
        """Put `coll` in line, under `order`: None if the caller blocks and nothing is queued, so that
        it runs `coll` on its own thread (run_here, after letting go of `order`; no Work to make and
        complete, a sixth of a tiny call's own work); else its Work (the caller's handle, `tensor`
        its result), queued. Either counts `coll`'s timeout in the deadline of every Work placed
        after it, until it ends: each waits for those before it too (a wait that gives up at its
        deadline poisons the communicator: the collective must not run after the caller got its
        error)."""
        with self._lock:
            self._ahead_s += coll.timeout + GRACE
        if not async_op and self._running.acquire(blocking=False):
            with self._lock:
                idle = self._queued == 0
            if idle:
                return None
            self._running.release()
        work = Work(tensor, coll.id, time.monotonic() + self._ahead_s, expired=self.set_poison, owner=owner)
        self._put(Run(coll, work))
        return work

    def run_here(self, coll: WorkerCollective) -> BaseException | None:
        """Run `coll`, which place() let this blocking caller run on its own thread; its error, if
        it failed."""
        try:
            return self._execute(coll)
        finally:
            self._running.release()
            self._ended(coll)

    def serve_until(self, coll: WorkerCollective, work: Work) -> None:
        """A blocking call from a done-callback on the engine thread, queued: nobody else would serve
        the queue, so this thread serves it (in order) up to and including this collective."""
        while not work.is_completed():
            if not self._serve(self._requests.get()):
                self._requests.put(None)      # closing: the engine loop stops on it
                self._complete(coll, work, SparcollError("the communicator was closed"))

    def _put(self, request: Run | Abort) -> None:
        with self._lock:
            closed = isinstance(request, Run) and self.state.is_(CommunicatorState.CLOSED)
            if not closed:
                self._queued += 1
                self._requests.put(request)     # in the lock: not after close()'s stop request
        if closed:
            self._complete(request.coll, request.work, SparcollError("the communicator was closed"))

    def _loop(self) -> None:
        while self._serve(self._requests.get()):
            pass

    def _serve(self, request: Run | Abort | None) -> bool:
        """Carry out one queued request; False for the stop request (None). Never raises."""
        if request is None:
            return False
        with self._running:
            with self._lock:
                self._queued -= 1
            if isinstance(request, Abort):
                try:
                    self.worker.abort(request.cid, request.text)
                except BaseException:   # any: the peers then learn it from this rank's poison
                    log.exception("rank %d could not announce its abort of allreduce %d",
                                  self.rank, request.cid)
                self.set_poison(request.error)
                return True
            try:
                error = self._execute(request.coll)
            except BaseException as exc:  # not even SystemExit may leave a Work unfinished
                error = self._failed(request.coll, exc)
        self._complete(request.coll, request.work, error)   # outside the lock: a done-callback
        return True                                         # may start the next one

    def _failed(self, coll: WorkerCollective, exc: BaseException) -> SparcollError:
        """Collective `coll` raised `exc` on this rank: it fails, announced to every aggregator."""
        return self.worker.internal_failure(coll, f"allreduce {coll.id}", exc)

    def _complete(self, coll: WorkerCollective, work: Work, error: BaseException | None) -> None:
        if error is None and coll.sparse:
            work.tensor = coll.tensor      # a COO collective's result is a new tensor
        self._ended(coll)
        work._finish(error)

    def _ended(self, coll: WorkerCollective) -> None:
        """`coll` no longer delays the Works placed after it."""
        with self._lock:
            self._ahead_s -= coll.timeout + GRACE

    def _execute(self, coll: WorkerCollective) -> BaseException | None:
        """Run one collective, in submission order, on the engine or a blocking caller's thread."""
        if self.poison is not None:     # a peer's own report beats our poison, if it comes
            self.worker.early_error_soon(coll.id)
        error = self.worker.take_early_error(coll.id)
        if error is None and self.poison is not None:
            error = _poisoned(self.poison)
        if error is None and self.state.is_(CommunicatorState.CLOSED):
            error = SparcollError("the communicator was closed before the collective ran")
        if error is None:
            try:
                error = self._run(coll)
            except Exception as exc:
                error = self._failed(coll, exc)
            except BaseException as exc:    # e.g. Ctrl-C in a caller's thread: peers must not wait
                self.set_poison(SparcollError(f"allreduce {coll.id} was interrupted ({exc!r})"))
                self.worker.abort(coll.id, f"allreduce {coll.id} was interrupted")
                raise
        self.worker.finished(coll.id)
        if error is not None:
            coll.fail(error)
            self.set_poison(error)
        else:
            self.collectives_done += 1
        return error

    def _run(self, coll: WorkerCollective) -> BaseException | None:
        """Run `coll` with the algorithm (and block size) chosen for it; learn from its result. A
        small COO tensor may densify (densified.py): its kind is then its dense buffer's, and on
        gloo's paths the buffer is what is summed."""
        kind, op = coll.kind, coll.kind[2]
        dense_kind = None
        if coll.sparse:     # its own kinds: a COO tensor's trials and densities are not a dense tensor's
            kind = (kind[0], kind[1], op | wire.COO_OP)
            dense_kind = (densified.buffer_numel(coll.tensor), kind[1], op | wire.COO_OP)
        densifies = dense_kind is not None and self.ring is not None and \
            self.chooser.timed_at_any_density(dense_kind)
        if densifies:
            kind = dense_kind
        algorithm = self.chooser.choose(kind, coll.sparse and not densifies)
        start = time.monotonic()
        if algorithm.on_gloo:
            def peer_report():      # looked at between slices of gloo's and the star's waits
                return self.worker.take_early_error(coll.id) or self.worker.sparse_peer(coll.id) or \
                    self._closed_during()
            data = densified.to_buffer(coll.tensor) if densifies else coll.tensor
            try:
                averages = self.ring.allreduce(coll.id, data, op, coll.timeout, peer_report,
                                               self.chooser.to_share(kind),
                                               gather=algorithm is Algorithm.GATHER,
                                               lost=self._lost_connection, tag=coll.tag,
                                               coo=coll.kind[0] if densifies else 0)
                if averages is not None:
                    self.chooser.shared(kind, averages)
                error = None
            except SparcollError as exc:    # peers on the sparse path (if any) must hear of it
                self.worker.abort(coll.id, str(exc), wire.code_of(exc))
                error = exc
            if densifies and error is None:
                coll.tensor = densified.from_buffer(data, coll.tensor, self.chooser.block_size(kind, coll.tensor))
        else:
            error = self.worker.run(coll, self.chooser.block_size(kind, coll.tensor))
        if error is None and densifies:
            self.chooser.learn_time(kind, algorithm, time.monotonic() - start)
        elif error is None:
            self.chooser.learn(kind, coll.tensor, algorithm, time.monotonic() - start)
        return error

    def _closed_during(self) -> SparcollError | None:
        """close() fails a collective in progress on gloo's ring at once, as the sparse path's (there the
        worker fails it): it used to wait for its peers until close() gave up on the engine thread."""
        if self.state.is_(CommunicatorState.CLOSED):
            return SparcollError("the communicator was closed during the collective")
        return None

    def _lost_connection(self) -> BaseException | None:
        """The error of a connection this rank lost during a collective in progress (nothing else
        poisons the communicator then: _execute), once a peer's report of why can no longer be
        expected (a peer that refused its input reports it, then closes)."""
        poison = self.poison
        return poison if poison is not None and not self.worker.report_may_come() else None

    def close(self) -> bool:
        """Stop taking collectives, fail the one in progress, let the engine send what is queued
        (e.g. an abort) and stop. False if it was closed already."""
        with self._lock:
            if self.state.is_(CommunicatorState.CLOSED):
                return False
            self.state.move(CommunicatorState.CLOSED)
        self._requests.put(None)
        self.worker.fail_active(SparcollError("the communicator was closed during the collective"))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)   # it sends what is queued, e.g. an abort
        if self.ring is not None:
            self.ring.close()
        return True


def _poisoned(poison: BaseException) -> PoisonedError:
    """The error of a call on a failed communicator: a collective failed, or a connection or peer
    was lost between collectives (it said "an earlier collective failed" then too: a review)."""
    return PoisonedError(f"this communicator failed earlier ({poison}); create a new communicator")
