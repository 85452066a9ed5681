"""The public worker-side API: a Communicator runs block-sparse allreduces for one group of ranks.

It assembles the roles (docs/architecture.md): `options` (arguments, environment, checks),
`bootstrap` (Store rendezvous and connections), `worker` (the job's side of every collective:
streams, results, failures), `engine` (order and execution of collectives, the communicator's
state). Here: validating a call's input, and the handles the caller sees (Work, Stats).
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from . import transport, wire
from .aggregator import LocalWorker
from .algorithm import MIN_BLOCK, Algorithm, Chooser, entry_block_size
from .blocks import entry_width, may_overlap
from .bootstrap import Rendezvous
from .hosts import local_host
from .collective import WorkerCollective
from .engine import Engine, Work
from .errors import SparcollError
from .options import DEFAULT_TIMEOUT, Options, check_tag, check_timeout
from .server import AggregatorServer
from .star import Credentials
from .weak import weak_method
from .worker import WorkerJob

__all__ = ["Communicator", "Stats", "Work"]


CLOSE_WAIT_S = 30.0     # a second close() waits this long at most for the first to finish


@dataclass
class Stats(transport.TrafficStats):
    """Traffic this process's transport wrote and read on the worker's behalf, and collectives run
    (of which `ring_collectives` on the ring's paths, gloo's ring or the star, for `ring_bytes` of
    tensors: see algorithm.py; `ring_checked_first` of them larger ones whose allreduce waited for
    their check round, `ring_gathered` larger ones whose data travelled in their check round and was
    summed there instead of allreduced: see ring.py)."""
    collectives: int = 0
    ring_collectives: int = 0
    ring_bytes: int = 0
    ring_checked_first: int = 0
    ring_gathered: int = 0


class Communicator:
    """Block-sparse allreduce for one group of `world` ranks, bootstrapped through `store`.
    Options (see sparcoll.init): block_size, aggregators, streams, message_blocks, credits,
    timeout, host, algorithm."""

    def __init__(self, store, rank: int, world: int, **options):
        self.rank, self.world = rank, world
        self._pid = os.getpid()                 # a forked child shares its sockets: see _submit
        self._closed = threading.Event()      # the first close() has finished
        self._worker: WorkerJob | None = None
        self._engine: Engine | None = None
        # Joined before the options are read, so that a rank whose options are refused says so to its
        # peers at once: they waited for its aggregator until the timeout (the backend's group's: 30
        # minutes by default), and then could not say which rank or why.
        rendezvous = Rendezvous(store, rank, world, _usable_timeout(options.get("timeout", DEFAULT_TIMEOUT)))
        try:
            self.options = Options.resolve(**options)
            self.block_size = self.options.block_size
            self.timeout = float(self.options.timeout)
            self.aggregators = list(self.options.aggregators) if self.options.aggregators else None
            self.config = self.options.job_config(world)
            self._bootstrap(rendezvous)
        except BaseException as exc:
            rendezvous.announce_failure(exc)
            self.close()
            raise

    def _bootstrap(self, rendezvous: Rendezvous) -> None:
        self.job, job_secret = rendezvous.job()
        rendezvous.same_layout(self.aggregators, self.block_size)
        job_token = wire.job_token(job_secret)
        server = local_job = None
        if self.aggregators is None:
            host = self.options.host or local_host()
            try:
                server = AggregatorServer(host, 0, job_secret, only_job=self.job)
            except OSError as exc:      # a name that does not resolve, an address not this host's
                if self.options.host is None:
                    raise
                raise ValueError(f"host {host!r} (host= or $SPARCOLL_HOST): this rank cannot listen "
                                 f"there ({exc})") from exc
            local_job = server.add_job(self.job, self.rank, self.config, job_token)
            try:
                addresses = rendezvous.colocated_addresses(server.address)
            except BaseException:
                server.close()
                raise
            secret = job_secret
        else:
            addresses = self.aggregators
            secret = self.options.secret
        self._worker = WorkerJob(self.rank, self.job, self.config, self.block_size, addresses,
                                 weak_method(self._poisoned), server, local_job)
        chooser = Chooser(self.options.algorithm, self.block_size, self.world)
        self._engine = Engine(self.rank, self._worker, chooser, ring=None)
        # One dropped without close() is closed when it is collected: its threads held it (through
        # the poison callback, now weak) and kept it, its sockets and its port until the process
        # exited. Not at interpreter exit, where a process leaves as it did.
        weakref.finalize(self, _shut, self._engine, self._worker, self._closed, self._pid).atexit = False
        if local_job is not None:
            local_job.attach(self.rank, LocalWorker(self._worker.local_inbox()))
        for index, address in enumerate(addresses):
            if index != self._worker.local_index:
                hello = wire.Hello(self.job, self.rank, index, self.config,
                                   os.urandom(wire.NONCE_BYTES))
                sock = rendezvous.connect(index, address, hello, secret, job_token,
                                          colocated=local_job is not None)
                self._worker.add_connection(index, sock)
        rendezvous.ready(lost=self._worker.lost)
        if self.options.algorithm is not Algorithm.SPARSE:
            # After ready(): every rank is alive and connected, so every rank builds it too.
            self._engine.ring = rendezvous.ring(self.options.host or local_host(),
                                                Credentials(self.job, self.config, job_secret))
            rendezvous.ready("ring", lost=self._worker.lost)

    def _poisoned(self, error: BaseException) -> None:
        self._engine.set_poison(error)

    # ---- public API -----------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                  timeout: float | None = None, tag: int = 0):
        """Sum (op="sum") or average (op="avg") `tensor` over all ranks, in place.
        Returns the tensor, or a Work handle with async_op=True (leave the tensor alone until its
        wait() returns: as under gloo, a change meanwhile may or may not be in the sum).
        `tag` (0 to 65535) says which tensor this is, and every rank must give the same for the
        same call: ranks whose calls differ only in their tensors' contents (two gradients of one
        size in different orders) would otherwise sum different tensors without an error. Calls
        whose tags differ fail with MismatchError on every rank."""
        return self._submit(tensor, torch.strided, op, async_op, timeout, tag)

    def allreduce_coo(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                      timeout: float | None = None, tag: int = 0):
        """Sum or average a sparse COO tensor (such as an nn.Embedding(sparse=True) gradient) over all
        ranks without densifying it: only the blocks its entries touch are sent (a tensor small
        enough to gather may go through gloo's paths as one dense buffer where that was faster in
        its trials: algorithm.py, densified.py; the result is the same). Returns a new
        coalesced COO tensor (or a Work whose wait() returns it); ranks may store different entries.
        The result lists the entries some rank stored, as gloo's sum does (an optimizer such as
        SparseAdam updates every listed row); only where entries share blocks (a table of more rows
        than the wire's block indices number: algorithm.entry_block_size), an entry whose sum is
        exactly zero is not listed. `tag`: as allreduce's."""
        return self._submit(tensor, torch.sparse_coo, op, async_op, timeout, tag)

    def _submit(self, tensor, layout, op, async_op, timeout, tag):
        if self._engine is None:
            raise SparcollError("communicator is closed")
        self._check_process()
        with self._engine.order:
            coll, result, work = self._place(tensor, layout, op, async_op, timeout, tag)
        # Outside inference mode: the views a blocking call makes on its own thread would be
        # inference tensors, which the threads that write results may not update.
        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
            if work is None:        # a blocking call, run here
                error = self._engine.run_here(coll)
                if error is not None:
                    raise error
                return coll.tensor if coll.sparse else result   # (a COO collective's is a new tensor)
            if not async_op and self._engine.on_its_thread():
                self._engine.serve_until(coll, work)
            return work if async_op else work.wait()

    def _place(self, tensor, layout, op, async_op, timeout, tag):
        """The call's collective, its result tensor and its Work (None: the caller runs it, see
        Engine.place), from its id on: under the engine's order."""
        cid = self._engine.next_id()
        try:    # a bad input is reported as such, poisoned communicator or not
            if timeout is not None:
                check_timeout(timeout)
            check_tag(tag)
            if not isinstance(async_op, bool):
                raise TypeError(f"async_op must be True or False, got {async_op!r}")
            kind = self._describe(tensor, layout, op)
        except (TypeError, ValueError) as exc:
            self._engine.reject(cid, exc)
            exc.add_note("sparcoll: its peers were told, and this communicator takes no more collectives "
                         "(each would raise PoisonedError); create a new one with sparcoll.init()")
            raise
        self._engine.check_poison(cid)
        result = tensor
        if layout == torch.sparse_coo and tensor.numel() == 0:
            # no element to sum (no rows, or rows of none): the collective of an empty dense tensor,
            # its kind still checked against the peers', and no entry back
            result = torch.sparse_coo_tensor(torch.zeros((tensor.sparse_dim(), 0), dtype=torch.long),
                                             torch.zeros((0, *tensor.shape[tensor.sparse_dim():]), dtype=tensor.dtype),
                                             tensor.shape, is_coalesced=True, check_invariants=True)
            tensor = torch.empty(0, dtype=tensor.dtype)
        coll = WorkerCollective(cid, _writable(tensor), kind, self.timeout if timeout is None else timeout, tag)
        return coll, result, self._engine.place(coll, result, async_op, owner=self)

    def _describe(self, tensor, layout, op) -> tuple[int, int, int]:
        """The call's kind, (numel, dtype code, op code), once its input is checked."""
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
        if tensor.layout == torch.strided and may_overlap(tensor):
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} and strides "
                             f"{tuple(tensor.stride())} has elements that share memory (e.g. from "
                             f"expand()); reduce a copy made with .contiguous() instead")
        too_many = self.too_many_blocks(tensor)
        if too_many:
            raise ValueError(f"{too_many}; reduce it through gloo")
        op_name = op if isinstance(op, str) else getattr(op, "name", str(op)).lower()
        if op_name not in wire.OPS:
            raise ValueError(f"unsupported op {op!r}; supported: {', '.join(wire.OPS)}")
        return (tensor.numel(), wire.DTYPE_CODES[tensor.dtype], wire.OPS[op_name])

    def too_many_blocks(self, tensor: torch.Tensor) -> str | None:
        """Why `tensor` may need more blocks than the wire's block indices number, or None. The fewest
        elements a block of it can hold: a COO tensor's entry_block_size; a dense one's MIN_BLOCK (narrow
        rows). A sparse tensor of 2^40 rows once had its indices wrap: one rank's sum right, another's
        an error."""
        if tensor.numel() <= wire.MAX_BLOCKS:   # no more blocks than elements (and a COO tensor's
            return None                         # entries may be 0 wide)
        smallest = entry_block_size(entry_width(tensor), self.block_size, tensor.numel()) \
            if tensor.layout == torch.sparse_coo else min(MIN_BLOCK, self.block_size)
        blocks = -(-tensor.numel() // smallest)
        if blocks <= wire.MAX_BLOCKS:
            return None
        return (f"tensor of shape {tuple(tensor.shape)} may take {blocks} blocks of {smallest} elements, more than "
                f"sparcoll's {wire.INDEX_DTYPE.__name__} block indices number ({wire.MAX_BLOCKS})")

    @property
    def stats(self) -> Stats:
        total = Stats(collectives=self._engine.collectives_done if self._engine else 0)
        ring = self._engine.ring if self._engine else None
        if ring is not None:
            total.ring_collectives, total.ring_bytes = ring.collectives, ring.bytes
            total.ring_checked_first, total.ring_gathered = ring.checked_first, ring.gathered
        if self._worker is not None:
            for conn in self._worker.connections.values():
                total.add(conn.stats)
        return total

    def on_callback_thread(self) -> bool:
        """Whether the caller is the thread that runs this communicator's Work done-callbacks (and the
        torch futures they complete): there a collective must run at once, since no other thread
        would serve it while that one waits for it."""
        return self._engine is not None and self._engine.on_its_thread()

    @property
    def aggregator_stats(self) -> transport.TrafficStats:
        """Traffic of this process's colocated aggregator (zero with dedicated aggregators)."""
        server = self._worker.server if self._worker else None
        return server.traffic() if server else transport.TrafficStats()

    def close(self) -> None:
        """Leave the job and stop every thread; always returns. A second call (another thread, an
        exit hook) returns once the first has finished, within CLOSE_WAIT_S: it returned at once,
        while the first still tore the threads and sockets down. In a forked child it does nothing:
        the connections are the parent's."""
        _shut(self._engine, self._worker, self._closed, self._pid)

    def _check_process(self) -> None:
        """A forked child (a DataLoader worker, say) has the parent's sockets but none of its
        threads: its collectives went out on the parent's connections, and a child's alone poisoned
        both parents with an error that blamed the other rank (a review)."""
        if os.getpid() != self._pid:
            raise SparcollError(f"this communicator belongs to process {self._pid}; process {os.getpid()} "
                                f"is a fork of it and cannot use its connections (make the child's own, or "
                                f"call from the parent)")

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _usable_timeout(timeout) -> float:
    """`timeout` where it is one, else the default: init still bounds its waits, and a timeout that
    is not one is the error this rank announces."""
    try:
        check_timeout(timeout)
    except ValueError:
        return DEFAULT_TIMEOUT
    return float(timeout)


def _shut(engine: Engine | None, worker: WorkerJob | None, closed: threading.Event, pid: int) -> None:
    """Leave the job and stop every thread (close(), or the finalizer of a Communicator dropped
    without it); a second call returns once the first has finished. Nothing in a process forked
    from `pid`, the one that made them: the connections are the parent's."""
    if os.getpid() != pid:
        return
    if engine is not None and not engine.close():
        closed.wait(CLOSE_WAIT_S)
        return
    try:
        if worker is not None:
            worker.close(engine.poison if engine else None)
    finally:
        closed.set()


def _writable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or for a dense inference tensor (made under torch.inference_mode) a plain tensor on
    the same memory: the result is written in place by threads outside inference mode, where an
    inference tensor refuses in-place updates (the sparse path failed with "Inplace update to
    inference tensor outside InferenceMode" and poisoned the communicator: a validation loop's metric
    reduced under inference_mode, a review)."""
    if tensor.layout != torch.strided or not tensor.is_inference():
        return tensor
    with torch.inference_mode(False):   # (made inside it, the alias would be an inference tensor too)
        alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
