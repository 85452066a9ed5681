"""Poseidon's data parallelism: a wrapper that goes where DDP would, synchronizes each parameter the
moment autograd has produced its gradient (wait-free backpropagation: communication overlaps the rest
of backward), and picks per tensor how: gloo's ring allreduce, sparcoll's sparse AllReduce, a sharded
parameter server, sufficient-factor broadcasting for linear layers, or a compressor from
sparcoll.compress.

    model = sparcoll.torch.DataParallel(model, comm=sparcoll.init())   # after init_process_group
    loss_fn(model(x), y).backward()      # returns with every gradient averaged over ranks
    optimizer.step()

Per tensor the strategy is the user's (`strategy=`: a dict or a JSON file, tensor name -> strategy)
or Poseidon's hybrid choice (sparcoll.torch.hybrid): the fewest bytes per step among the ring, SFB
for nn.Linear weights (by the rows K the ranks fed the layer and the world size) and, with a
communicator, the sparse AllReduce (by the block density of the tensor's previous averaged gradient,
which every rank knows alike), each collective a tensor needs of its own charged
hybrid.COLLECTIVE_BYTES (a ring gradient in a bucket needs none); a sparse COO gradient
(`nn.Embedding(sparse=True)`) takes the sparse AllReduce when there is a communicator: it sends each
rank's touched rows and brings back their union, never more than the group's sparse all_reduce,
which gathers every rank's rows to every rank (ncf's four embeddings, 4 workers on loopback:
32.5-34.9 ms a step against 50.7-54.8 through the group). Every rank takes the same decisions from
the same facts, so ranks need the same model; their batches may differ in size, as under DDP: K is
the ranks' mean of the rows each layer was fed the step before (so a layer's first step never takes
SFB), which a small allreduce at the start of each step's synchronization tells every rank, left
running while the step's other collectives start (SFB gathers each rank's own rows). A linear layer
whose weight another module owns too (a tied softmax) never takes SFB: its factors would miss the
other module's part of the gradient. (A weight that gets gradient outside its layer's call, as in
`F.linear(x, layer.weight)` elsewhere or a penalty in the loss, keeps that part under every strategy
but SFB; under SFB the part is lost and the wrapper warns, once per layer: give such a layer strategy
"ring", or put the penalty in the optimizer's weight_decay.) Every rank must
produce a gradient for the same parameters each step, as under DDP without find_unused_parameters:
where a rank skips a branch the others take, their buckets differ in size, and gloo aborts the
process whose collective disagrees (docs/reliability.md, "Known gaps"; sparcoll's own collectives,
tagged with their first parameter, fail on every rank instead, naming the parameters, and so do
gloo's where their sizes agree: the ring's buckets carry a check of what gloo reduced); a rank whose
step lacks gradients the last step had warns at the end of its backward, naming them and the flag
below, once (its earlier buckets may have gone already: the warning can come too late). For models
whose data decides which parameters a step uses, find_unused_parameters=True does what DDP's does:
each rank hands its gradients on in one order (the parameters' reverse order, backward's usual one,
in the first step; from the second on, the order rank 0's gradients came in the first, as DDP
rebuilds its buckets: gradients that come in that order go while backward runs), a parameter it did
not use at the end of backward, with the gradient it holds (a second backward without zero_grad), else
zeros, so every rank forms the same buckets; one small allreduce a
step counts the ranks that used each parameter (and tells every rank rank 0's order, in the first
step), and one no rank used keeps its gradient as it was (None, as under DDP).

Gradients are synchronized on one thread, in the order backward produces them (the same on every
rank); backward waits for the last of them before it returns. The group's own allreduces (the ring's,
and gloo's sparse all_reduce of a COO gradient) are left running on the group's threads, as DDP
leaves its buckets': the next collective starts while they travel, and a second thread waits for
them in order and puts their results in place. Small dense gradients of the ring or of
one compressor travel in buckets, as DDP's: one collective for several (each gradient compressed on
its own, their payloads sent together), instead of a collective's cost each (without a plan, the ring's
gradients below 1 MB too, a bucket going once it holds 1 MB, DDP's first bucket); a compressed weight
takes its own bias along when the bias came just before it (as `sparcoll plan` prices a layer). A
plan's unit of several COO gradients under the sparse AllReduce is one collective of their rows
(sparse.concatenate); without a plan, so are such gradients ready one after another (until their
tables hold COO_BUCKET_BYTES). An embedding declared with dense gradients (nn.Embedding, or
nn.EmbeddingBag unless in "max" mode) whose weight takes the sparse AllReduce (by the strategy given,
not the hybrid choice) looks its rows up with sparse=True while DataParallel runs it: its gradient
comes as COO rows, goes through the sparse AllReduce without a scan of the dense table, and is made
dense again for the optimizer, in a table kept from step to step (sparse.Lookups; do not hold such a
gradient across steps, as under DDP's gradient_as_bucket_view). Where anything else contributed to the
weight's gradient (a regularizer, a tied use) autograd sums it dense, and it goes the dense way, scanned.
Under `no_sync()` gradients
accumulate locally; the next synchronized step reduces the accumulated gradients (SFB layers then take
the ring: their factors cover one step only). `trace` records, for the last step, when each tensor
was ready and when its synchronization started and ended, and when backward finished computing.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import json
import queue
import re
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Union

import torch
import torch.distributed as dist
from torch import nn

from sparcoll import wire
from sparcoll.algorithm import entry_block_size
from sparcoll.blocks import BlockTensor, entries_of
from sparcoll.communicator import Communicator
from sparcoll.compress import Reducer, parse
from sparcoll.compress.channel import (Channel, LabelMismatch, destroy_group, gloo_lost_a_peer, gloo_timed_out,
                                       wait_within)
from sparcoll.errors import CollectiveTimeout, DivergedError, MismatchError, PeerError
from sparcoll.weak import weak_method

from . import hybrid, sparse
from .dropped import RESTART, DroppedSteps
from .ps import ps_allreduce
from .sfb import END, Call, LinearState, eligible_layers, end_of_step, gather_factors

AUTO = "auto"
ROWS = "rows"           # the per-step allreduce of the rows the ranks fed their linear layers
USED = "used"           # find_unused_parameters: the allreduce of which parameters each rank used
BUCKET = "bucket"       # small dense gradients that take the ring, averaged in one allreduce
CHECK = "check"         # the step's last check of what gloo reduced after its last bucket, if anything
COMPRESSED = "compressed"   # gradients of one compressor, their payloads in one collective
COO_UNIT = "coo unit"       # a plan's unit of sparse COO gradients: one sparse AllReduce of them all
SPARSE_BUCKET = "sparse bucket"     # dense gradients under the sparse AllReduce, concatenated: one of it
SFB_END = "sfb end"         # the step's last gather on SFB's channel (sfb.end_of_step)
FAILED = "failed"           # an error of the training thread, in queue order: the items after it are skipped
CHANNEL, THREAD, OFFLOAD = "channel", "thread", "offload"     # where a compressor runs
SMALL_BYTES = 256 << 10     # a gradient this small joins the bucket (without a plan, any smaller than
                            # BUCKET_BYTES on the ring) ...
BUCKET_BYTES = 1 << 20      # ... which goes when it holds this much (as DDP's first bucket)
BUCKET_CHECK_MOST = 250     # a ring bucket's check value t is 1 to this, and with at most
BUCKET_CHECK_WORLD = 256    # ... this many ranks the sum of t * t stays below 2^24, exact in float32
COO_BUCKET_BYTES = 25 << 20     # COO gradients under the sparse AllReduce share one until their
                                # tables (dense) hold this much (DDP's bucket_cap_mb): the same on
                                # every rank, where their rows are not
STRATEGIES = (hybrid.RING, hybrid.PS, hybrid.SPARSE, hybrid.SFB)
WATCH_EVERY_S = 1.0     # backward waiting longer for its synchronizations looks whether a peer dropped the step
AGREE_S = 10.0          # ranks whose step's synchronization failed alike say so within this
# The wrapper synchronizing on each process group and communicator in the backward under way, by
# (kind, id): two at once would issue their collectives from two threads, in an order that differs
# by rank, and gloo would pair one's with the other's (silently wrong sums where sizes agree: a review
# trained a GAN-like pair of wrappers on the default group).
_SYNCHRONIZING: weakref.WeakValueDictionary[tuple[str, int], "DataParallel"] = weakref.WeakValueDictionary()
_SYNCHRONIZING_LOCK = threading.Lock()


class Resources:
    """What a DataParallel holds outside itself: hooks on the user's module, its two threads and their
    queues, SFB's gloo group, the offload thread. Released by close(), or when a wrapper dropped
    without it is collected; a second release does nothing more."""

    def __init__(self, items: queue.SimpleQueue, running: queue.SimpleQueue):
        self.handles: list = []
        self.items, self.running = items, running
        self.threads: list[threading.Thread] = []
        self.group = None
        self.offload: concurrent.futures.ThreadPoolExecutor | None = None

    def release(self, join_s: float = 0.0) -> None:
        """`join_s`: how long to wait for each thread (none from the finalizer, which may run on one)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.items.put(None)
        if join_s and self.threads:
            self.threads[0].join(timeout=join_s)
        self.running.put(None)         # after the last collective the synchronization thread could start
        if join_s and self.threads:
            self.threads[1].join(timeout=join_s)
        group, self.group = self.group, None
        destroy_group(group)
        if self.offload is not None:
            self.offload.shutdown(wait=False, cancel_futures=True)


def _each_item(wrapper_ref: weakref.ref, items: queue.SimpleQueue, work: Callable) -> None:
    """A DataParallel thread: work(wrapper, item) for each item until None, holding the wrapper only
    while it works on one, so that a wrapper dropped without close() is collected (its finalizer's
    None then ends the loop)."""
    while True:
        item = items.get()
        wrapper = wrapper_ref()
        if item is None or wrapper is None:
            return
        work(wrapper, item)
        wrapper = item = None       # (an item may hold the wrapper too)


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a module's output: itself, or those in its tuples, lists and dicts, at any depth."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    return [t for item in items for t in tensors_in(item)]


def _linear_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """nn.Linear's input, passed by position or as `input=`."""
    return args[0] if args else kwargs["input"]


def _ends_the_job(error: BaseException) -> bool:
    """An error after which no step runs (DataParallel._break_on), so the ranks need not agree on how
    much of the step each ran. (A peer whose connection broke cannot agree to drop the step: waiting
    AGREE_S for it made a dead peer's failure take 11-17 s to reach backward.)"""
    return isinstance(error, (CollectiveTimeout, DivergedError, MismatchError, PeerError)) or gloo_timed_out(error) \
        or gloo_lost_a_peer(error)


def takes_average_in_place(grad: torch.Tensor) -> bool:
    """Whether a compressed gradient's average is decompressed into the gradient itself (a flat
    float32 view of it); else into a tensor of its own, then copied in."""
    return grad.dtype == torch.float32 and grad.is_contiguous()


@dataclass
class Started:
    """A collective left running on the group's threads, as DDP leaves its buckets', so that the
    next tensor's collective need not wait for it: on deeplight with sparse embeddings gloo's
    gathers of the embeddings' rows overlap the dense gradients' allreduce. (Not sparcoll's sparse
    AllReduce: on its engine thread, beside this one and the completion thread, deeplight's dense
    steps took 5-10% longer than when the synchronization thread runs it itself; nor compressed
    payloads, whose gathers left running measured no faster.) The completion thread waits for
    `work` (bounded), then `finish` puts the result in place."""
    work: object
    finish: Callable[[], None]
    events: list


@dataclass
class Event:
    """One tensor's synchronization in a step (perf_counter seconds)."""
    name: str
    strategy: str
    ready: float
    start: float = float("nan")
    end: float = float("nan")


class DataParallel(nn.Module):
    """module: the model (same on every rank; parameters are broadcast from rank 0). comm: a sparcoll
    Communicator (needed for the "sparse" strategy). group: the torch.distributed group of the ring,
    the parameter server, SFB's gathers and compressors (default: the whole job). strategy: "auto", a
    strategy for every tensor, or per tensor name a dict / JSON file path (names as in
    module.named_parameters(); unnamed ones take "auto"): "ring", "ps", "sparse", "sfb" (nn.Linear
    weights), "auto", or a sparcoll.compress spec; or a plan of `sparcoll plan` (its JSON file or
    dict), which also says where each compressor runs: on the training thread as the gradient is
    ready ("thread"), on a worker thread of its own ("offload"), or (unplanned) on the
    synchronization thread before its collective. timeout: seconds backward waits for the last
    synchronization. wait_free=False holds every synchronization until backward has finished (as
    without Poseidon's overlap; for comparison). broadcast_buffers: as DDP's, rank 0's buffers (a
    BatchNorm's running statistics) replace every rank's, in one broadcast per dtype, at the start of
    the first forward and of each forward after one that will be synchronized, whatever its own mode:
    an evaluation after training sees rank 0's statistics on every rank (so evaluate on every rank, or
    through `.module` on one, as under DDP). find_unused_parameters: as DDP's, for models whose
    data decides which parameters a step uses (a branch one rank takes and another does not): a
    parameter without a gradient of this step on a rank contributes the gradient it holds there
    (zeros if none), and one no rank used keeps its
    gradient as it was; SFB is not used (its factors need every rank's call of the layer). A backward
    that raised on every rank at the same point (caught by the caller) is dropped at the next
    forward, its gradients cleared; where the ranks' backward did not all raise alike, every rank
    raises sparcoll.errors.DivergedError instead (sparcoll.torch.dropped). After a DivergedError or a
    step whose synchronizations timed out, every later forward raises DivergedError. Build wrappers
    in the same order on every rank; a loss through two wrapped models (a GAN's) needs a group (and
    a communicator) for each, or backward raises."""

    def __init__(self, module: nn.Module, comm: Communicator | None = None, group=None,
                 strategy: Union[str, Mapping, Path] = AUTO, timeout: float = 300.0,
                 wait_free: bool = True, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False):
        super().__init__()
        self.module = module
        self.comm, self.group, self.timeout, self.wait_free = comm, group, timeout, wait_free
        self.broadcast_buffers = broadcast_buffers
        self._buffers_due = True          # the first forward, and each after a synchronized one
        self.find_unused_parameters = find_unused_parameters
        self._held: list = []
        self._bucket: list = []           # (parameter, event, payload) of small gradients, in ready order
        self._bucket_bytes = 0            # their gradients' bytes
        self._bucket_kind: tuple = ()     # the bucket's (strategy, placement): one collective for all
        self._unit_buckets: dict = {}     # a plan's unit -> [kind, members gathered (as in _bucket), count]
        self.world = dist.get_world_size(group)
        # the gloo collectives the synchronization thread waits for give up at the wrapper's timeout
        self.channel = Channel(group, comm, timeout)
        self._group_channel = Channel(group, timeout=timeout)     # the group's own collectives, without sparcoll
        try:
            loaded = _load(strategy)
            if loaded.workers is not None and loaded.workers != self.world:
                raise ValueError(f"the plan was made for {loaded.workers} workers, this job has {self.world}: "
                                 f"every choice in it was priced for that many; plan again for {self.world}")
            check_names(module, loaded)
        except (ValueError, TypeError) as exc:
            if self.world > 1:      # the peers, waiting in the check below, hear why (a stale file on one host)
                self._check_alike_on_every_rank(refused=exc)
            raise
        self._explicit, self._placement, self._unit = loaded.strategy, loaded.placement, loaded.units
        if self.world > 1:
            self._check_alike_on_every_rank()
        self._planned = bool(self._placement)      # a plan gives every tensor's placement
        self._unit_size = collections.Counter(self._unit.values())
        self._unit_bytes = collections.Counter()        # a plan's unit -> its gradients' bytes (dense)
        for name, p in module.named_parameters():
            if name in self._unit:
                self._unit_bytes[self._unit[name]] += p.numel() * p.element_size()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._running: queue.SimpleQueue = queue.SimpleQueue()     # Started, in the order they started
        self._resources = Resources(self._queue, self._running)
        # A wrapper dropped without close() lets go of the module and stops its threads when it is
        # collected: its hooks on the module and its threads kept it (and them, and SFB's group) alive
        # for good, and re-wrapping the module made both wrappers synchronize in one backward.
        weakref.finalize(self, self._resources.release).atexit = False
        wanted = self._explicit.values() if isinstance(self._explicit, dict) else [self._explicit]
        if hybrid.SPARSE in wanted and comm is None:
            raise ValueError("the sparse strategy needs a sparcoll Communicator (comm=)")
        if hybrid.SFB in wanted and find_unused_parameters:
            raise ValueError("the sfb strategy needs every rank to call the layer each step: it "
                             "cannot serve a model with find_unused_parameters=True")
        self._handles = self._resources.handles
        self._names = {id(p): name for name, p in module.named_parameters()}
        # each parameter's tag on sparcoll's collectives (Communicator.allreduce; a unit's, its first
        # parameter's): a rank whose collective is another parameter's than its peers' (a skipped
        # branch) fails it on every rank where the sum would otherwise be of different tensors of
        # one size
        self._tags = {id(p): 1 + i % wire.MAX_TAG for i, p in enumerate(module.parameters())}
        self._unchecked: list[int] = []     # tags of gradients gloo reduced alone since the last bucket
        self._params = [p for p in module.parameters() if p.requires_grad]
        sizes = collections.Counter(p.numel() for p in self._params)
        # the tags of parameters that another one's gradient could pass for (the same size): only
        # those, reduced after a step's last bucket, need a check of their own
        self._ambiguous = {self._tags[id(p)] for p in self._params if sizes[p.numel()] > 1}
        # find_unused_parameters: gradients are handed on in this order on every rank, so that ranks
        # that skip different parameters still form the same buckets: backward's usual order in the
        # first synchronized step, then the order rank 0's gradients came in that step (as DDP
        # rebuilds its buckets once), so that a model used in another order than it was built in
        # still hands its first gradients on while backward runs
        self._order = self._params[::-1]
        self._arrivals: list[int] | None = []   # ids in the order this step's gradients came, until
                                                # the order is rebuilt (then None)
        self._handed = 0                        # how many of _order this step has handed on
        self._got: set[int] = set()             # parameters whose gradient this backward produced
        self._accumulated_ids: set[int] = set()     # ... or one under no_sync since the last step
        # without find_unused_parameters: the ids of the parameters whose gradients (or SFB factors)
        # came this step and in the last, to warn when one stops coming (a skipped branch), before
        # the step's last bucket goes
        self._came: set[int] = set()
        self._came_last: set[int] = set()
        self._warned_missing = False
        self._warned_outside: set[int] = set()      # SFB weights warned of a gradient from elsewhere
        self._coo = sparse.sparse_weights(module)
        self._lookups = sparse.Lookups(module, lambda w: self.world > 1 and comm is not None and w.requires_grad
                                       and self._requested(w) == hybrid.SPARSE)
        self._handles += self._lookups.handles
        self._linear: dict[int, LinearState] = {}    # weight id -> its layer's step
        self._weight_of: dict[int, nn.Parameter] = {}  # bias id -> its layer's weight
        for layer in eligible_layers(module):      # a tied weight never takes SFB
            if layer.bias is not None:          # a layer's bias goes with its weight (SFB, compressed)
                self._weight_of[id(layer.bias)] = layer.weight
            if not self._may_take_sfb(layer):
                continue
            state = LinearState(layer, self._names.get(id(layer.weight), "?"))
            self._handles.append(layer.register_forward_pre_hook(weak_method(self._before_linear, state),
                                                                 with_kwargs=True))
            self._handles.append(layer.register_forward_hook(weak_method(self._after_linear, state),
                                                             with_kwargs=True, always_call=True))
            self._linear[id(layer.weight)] = state
        # SFB's gathers on a group of their own, each labelled with its call (sfb.gather_factors): ranks
        # that called a layer a different number of times meet another label there, never another kind
        # of collective, and raise instead of pairing one call's factors with another's. Made by every
        # rank of the job, as dist.new_group wants, unless the wrapper's group is a part of it (torch's
        # local synchronization then: wrappers made again and again on the whole job's ranks that way
        # failed to connect, "Connection refused", 22 times in this project's tests)
        self._sfb_channel = None if not self._linear or self.world == 1 else Channel(dist.new_group(
            dist.get_process_group_ranks(group or dist.group.WORLD), timeout=timedelta(seconds=timeout),
            backend="gloo", use_local_synchronization=self.world < dist.get_world_size()), timeout=timeout)
        self._resources.group = self._sfb_channel.group if self._sfb_channel is not None else None
        self._density: dict[int, float] = {}
        # the tensors whose block density the hybrid choice reads (_learn_density): chosen by it, with
        # a communicator, and sent through the sparse AllReduce at some density
        self._density_decides = {id(p) for p in self._params if comm is not None
                                 and self._requested(p) == AUTO and self._may_beat_ring(hybrid.SPARSE, p)}
        self._reducers: dict[tuple[str, str], Reducer] = {}
        self._reducers_lock = threading.Lock()     # _reducer is called on the training and synchronization threads
        self._scratch: dict[int, list] = {}
        self._sync = True
        self._accumulated = False
        self._rows: dict[int, float] = {}     # weight id -> the ranks' mean rows last step (ROWS)
        self._own_rows: dict[int, int] = {}   # weight id -> this rank's rows last step (strategy() reports by it)
        # what this step learns for the hybrid choice (rows, densities), kept only if the step succeeds:
        # after a failed step, which of its collectives finished differs by rank, and ranks that
        # learned different facts would choose different collectives in the next step
        self._learned_rows: dict[int, float] = {}
        self._learned_density: dict[int, float] = {}
        # linear weights some rank's step called their layer more than once (ROWS): never SFB by the
        # hybrid choice, which would need every rank to call them as often in every step (sfb.py)
        self._repeated: set[int] = set()
        self._learned_repeated: set[int] = set()
        self._pass: tuple[int, bool] = (-1, False)  # (graph task, whether it accumulates gradients)
        self._pending = 0
        self._idle = threading.Condition()
        self._error: BaseException | None = None     # the step's first error, from any thread
        # what makes the synchronization thread skip the rest of the step: set at a position in its
        # queue (its own errors, the training thread's as FAILED items, alike on every rank that failed
        # alike), not at the moment another thread's error lands, so every such rank runs as many items
        # and the ranks can agree to drop the step (a review: the skipped count differed by timing)
        self._skipping: BaseException | None = None
        self._armed = False
        self._step = -1             # the synchronized steps' count (the one armed, or the last)
        self._started = 0           # the items this step queued (collectives, most of them)
        self._ran = 0               # ... and those the synchronization thread ran (not skipped)
        self._dropped = DroppedSteps(group, dist.get_rank(group), self.world) if self.world > 1 else None
        self._broken: BaseException | None = None      # why no later step may run (_breaking)
        self.trace: list[Event] = []
        self.backward_end = float("nan")
        me = weakref.ref(self)
        self._resources.threads = [
            threading.Thread(target=_each_item, args=(me, self._queue, DataParallel._serve),
                             name="sparcoll-dataparallel", daemon=True),
            threading.Thread(target=_each_item, args=(me, self._running, DataParallel._complete),
                             name="sparcoll-dataparallel-done", daemon=True)]
        for thread in self._resources.threads:
            thread.start()
        self._broadcast_from_rank0()
        self._handles += [p.register_post_accumulate_grad_hook(weak_method(self._ready)) for p in self._params]

    # ---- the user's side --------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._broken is not None:
            raise DivergedError(f"DataParallel runs no step after {type(self._broken).__name__}: "
                                f"{self._broken}{'' if RESTART in str(self._broken) else RESTART}") \
                from self._broken
        if self._armed and torch._C._current_graph_task_id() == -1:    # not a recomputation in backward
            with self._breaking():
                self._drop_failed_step()
        if self.broadcast_buffers and self._buffers_due and self.world > 1:
            self._broadcast_buffers()
        self._buffers_due = self._sync and torch.is_grad_enabled()
        out = self.module(*args, **kwargs)
        # The graph keeps the wrapper alive until its backward (or until the graph is dropped): its
        # hooks hold it weakly, and a wrapper dropped between forward and backward (a helper that
        # returns only the loss) was collected, its hooks removed, and backward returned each rank's
        # own gradients without a word (a review).
        node = next((t.grad_fn for t in tensors_in(out) if t.grad_fn is not None), None)
        if node is not None:
            node.metadata["sparcoll.DataParallel"] = self
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block synchronizes them."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before
            self._accumulated = True

    def strategy(self, rows: int | None = None) -> dict[str, dict]:
        """Each tensor's strategy and predicted bytes sent per step by this worker, for a batch of
        `rows` rows per linear layer (default: the ranks' mean of what each layer saw last step); a
        dense tensor given the sparse strategy explicitly is counted whole (its density is learned
        only where the hybrid choice needs it), a COO gradient (or a dense-declared embedding's, sent as
        its rows: sparse.Lookups) by the rows this worker's last batch touched."""
        out = {}
        for p in self._params:
            weight = self._weight_of.get(id(p))
            if weight is not None and self._choose(weight, self._rows_of(weight, rows)) == hybrid.SFB:
                continue                    # travels with its weight's factors
            k = self._rows_of(p, rows)
            chosen = self._choose(p, k)
            entry = {"strategy": chosen, "numel": p.numel()}
            if chosen in STRATEGIES:
                # a COO gradient's blocks are its rows (a row's share is its density, _note_rows)
                as_rows = id(p) in self._coo or (id(p) in self._lookups and id(p) in self._density)
                block = entry_block_size(p[0].numel(), self._block_size(), p.numel()) if as_rows else self._block_size()
                entry["predicted_bytes"] = hybrid.sent_bytes(chosen, self._model_of(p), self.world, k, block)
            out[self._names.get(id(p), str(id(p)))] = entry
        return out

    def close(self) -> None:
        """Remove the hooks and stop the synchronization threads (the communicator stays the
        caller's)."""
        self._release_channels()
        self._resources.release(join_s=5)
        self._sfb_channel = None

    # ---- decisions --------------------------------------------------------------------------------
    def _rows_of(self, p: torch.Tensor, rows: float | None) -> float:
        """`rows`, else the ranks' mean of the rows weight `p`'s layer saw last step where they share
        them (its strategy auto: _share_rows), else this rank's own (SFB asked for, as by a plan)."""
        if rows is not None:
            return rows
        return self._rows.get(id(p), self._own_rows.get(id(p), 0))

    def _may_take_sfb(self, layer: nn.Linear) -> bool:
        """Whether SFB may serve this layer: asked for, or chosen by the hybrid model at some batch
        (hybrid.may_beat_ring). Only such layers get forward hooks and a share of the rows each step
        (_share_rows); the others are tensors like any other, whose choice no batch changes. None
        with find_unused_parameters: a rank that skips the layer would have no factors to send."""
        if self.find_unused_parameters:
            return False
        requested = self._requested(layer.weight)
        if requested != AUTO:
            return requested == hybrid.SFB
        return self._may_beat_ring(hybrid.SFB, layer.weight)

    def _may_beat_ring(self, strategy: str, p: torch.Tensor) -> bool:
        t = hybrid.Tensor(p.numel(), tuple(p.shape) if p.dim() == 2 else None)
        shared = self._ring_bucketed(p.numel() * p.element_size())
        return hybrid.may_beat_ring(strategy, t, self.world, shared, self._block_size())

    def _ring_bucketed(self, size: int) -> bool:
        """Whether a dense gradient of `size` bytes on the ring joins a bucket (_add_to_bucket)."""
        return size <= SMALL_BYTES or (size < BUCKET_BYTES and not self._planned)

    def _block_size(self) -> int:
        return self.comm.block_size if self.comm is not None else 256

    def _model_of(self, p: torch.Tensor) -> hybrid.Tensor:
        state = self._linear.get(id(p))
        linear = tuple(p.shape) if state is not None and id(p) not in self._repeated else None
        bias = state is not None and state.bias is not None
        return hybrid.Tensor(p.numel(), linear, bias, self._density.get(id(p), 1.0))

    def _choose(self, p: torch.Tensor, rows: float) -> str:
        chosen = self._requested(p)
        if chosen == AUTO and id(p) in self._coo and self.comm is not None:
            return hybrid.SPARSE
        if chosen == AUTO:
            chosen = hybrid.choose(self._model_of(p), self.world, rows, self.comm is not None,
                                   self._block_size(), self._ring_bucketed(p.numel() * p.element_size()))
        if chosen == hybrid.SFB and (id(p) not in self._linear or self._accumulated):
            chosen = hybrid.RING            # not a linear weight, or gradients accumulated
        return chosen

    # ---- a linear layer's call ----------------------------------------------------------------------
    def _before_linear(self, state: LinearState, layer: nn.Linear, args, kwargs) -> None:
        """Choose the layer's strategy at its first call of a step, from the rows the ranks fed it
        last step (the same on every rank); under SFB, keep autograd from computing the local weight
        gradient that SFB replaces."""
        if not (self._sync and self.world > 1 and torch.is_grad_enabled() and layer.weight.requires_grad):
            return
        x = _linear_input(args, kwargs)
        if state.strategy is None or not (state.calls or self._armed):
            # a new step (calls of a forward that never got a backward have vanished with its graph)
            state.reset()
            state.rows = x.numel() // layer.in_features
            state.strategy = self._choose(layer.weight, self._rows.get(id(layer.weight), 0))
        if state.strategy != hybrid.SFB:
            return
        if x.requires_grad or state.bias is not None:
            layer.weight.requires_grad_(False)     # the output still gets a gradient, SFB takes u
            state.skipping = True
        else:
            state.local_grad = True                # nothing else makes the output differentiable

    def _after_linear(self, state: LinearState, layer: nn.Linear, args, kwargs, output) -> None:
        if state.skipping:
            layer.weight.requires_grad_(True)
            state.skipping = False
        if state.strategy is None or not (self._sync and torch.is_grad_enabled() and output.requires_grad):
            return
        call = Call(_linear_input(args, kwargs).detach() if state.strategy == hybrid.SFB else None)
        state.calls.add(call)
        output.grad_fn.metadata["sparcoll call"] = call      # alive as long as the graph
        if state.strategy == hybrid.SFB:
            output.register_hook(functools.partial(self._factors_ready, state, call))

    def _factors_ready(self, state: LinearState, call: Call, grad: torch.Tensor) -> None:
        """The gradient of one call's output has arrived: queue the call's SFB, in a pass that
        accumulates gradients (a backward), not in one that only computes some; there the call is
        forgotten, so that a backward through its graph after that (a penalty on the gradient, with
        create_graph) is refused below, where it lost the penalty's part of the weight's gradient."""
        if not self._accumulating(state):
            state.calls.discard(call)
            return
        self._arm()
        if call not in state.calls:      # the step this call belonged to is over
            self._fail_in_order(RuntimeError(
                f"SFB cannot rebuild {state.name}'s gradient from a second backward through the "
                f"same graph; give it another strategy"))
            return
        state.calls.discard(call)
        if call.inputs._version != call.version:
            self._fail_in_order(RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: the input of {state.name}, whose gradient SFB builds from it at backward"))
            return
        self._came.add(id(state.layer.weight))      # its weight's gradient comes as these factors
        if not state.started:
            state.start()
        dtype, layer = state.layer.weight.dtype, state.layer
        u = grad.detach().reshape(-1, layer.out_features).to(dtype).contiguous()
        v = call.inputs.reshape(-1, layer.in_features).to(dtype).contiguous()
        call.inputs = None
        state.gathers += 1
        self._enqueue(state.layer.weight, hybrid.SFB, (state, u, v, (self._tags[id(layer.weight)], state.gathers)))

    def _accumulating(self, state: LinearState) -> bool:
        """Whether the backward pass under way accumulates into the model's gradients: not
        torch.autograd.grad (an adversarial example's gradient, a penalty's), where SFB's output hook
        fires too and the averaged factors were written into the weight's gradient, which the real
        backward then added to (a review: FGSM training's SFB layers got the clean loss's gradient
        on top of the adversarial one's). Asked of the layer's own trainable leaves, else of the
        model's other parameters the pass may reach; once per pass. With none to ask, it does."""
        task = torch._C._current_graph_task_id()
        if self._pass[0] == task:
            return self._pass[1]
        skipped = {id(s.layer.weight) for s in self._linear.values()
                   if s.strategy == hybrid.SFB and not s.local_grad}
        own = [q for q in (state.bias, state.layer.weight if state.local_grad else None) if q is not None]
        leaves = own or [q for q in self._params if q.requires_grad and id(q) not in skipped]
        try:
            accumulating = not leaves or any(
                torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(q).node) for q in leaves)
        except RuntimeError:    # "A leaf node was passed ... running autograd.grad()": one the call asked for
            accumulating = False
        self._pass = (task, accumulating)
        return accumulating

    # ---- backward --------------------------------------------------------------------------------
    def _ready(self, p: torch.Tensor) -> None:
        """Autograd has accumulated p's gradient for this backward: hand it on. With
        find_unused_parameters, in the ranks' common order: p and the gradients after it in that
        order that are ready already."""
        if self.world == 1:
            return
        if not self._sync:
            self._accumulated_ids.add(id(p))
            return
        self._arm()
        if not self.find_unused_parameters:
            self._came.add(id(p))
            self._hand_on(p)
            return
        if self._arrivals is not None and id(p) not in self._got:
            self._arrivals.append(id(p))
        self._got.add(id(p))
        while self._handed < len(self._order) and id(self._order[self._handed]) in self._got:
            self._handed += 1
            self._hand_on(self._order[self._handed - 1])

    def _warn_if_some_stopped_coming(self) -> None:
        """Without find_unused_parameters, at the end of backward: warn (once) if a parameter whose
        gradient came in the last step has none in this one. Where data decides which parameters a
        step uses, ranks then form different buckets and gloo aborts the process whose collective
        disagrees, with a message of its own that does not say why; a rank that skipped a parameter
        says so before its last bucket goes (its earlier buckets may disagree already). Every rank
        skipping the same parameters is harmless: hence a warning, and only once; a parameter frozen
        since (requires_grad False) is not missing."""
        missing = self._came_last - self._came
        self._came_last, self._came = self._came, set()
        if not missing or self._warned_missing:     # the usual step: no walk over the parameters
            return
        names = [name for name, p in self.module.named_parameters()
                 if id(p) in missing and p.requires_grad]
        if not names:
            return
        self._warned_missing = True
        warnings.warn(f"rank {dist.get_rank(self.group)}: no gradient in this step for "
                      f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}, which had one in the "
                      f"last step. If data decides which parameters a step uses and ranks differ, their "
                      f"buckets differ: gloo aborts the process whose collective disagrees (sparcoll's "
                      f"raise MismatchError), or sums gradients of one size that are not the same "
                      f"parameter's. Pass find_unused_parameters=True, as DDP needs", RuntimeWarning,
                      stacklevel=1)

    def _warn_outside_sfb(self, state: LinearState) -> None:
        """Once per layer: under SFB autograd computes no gradient for the weight in the layer's call,
        so one that reached it came from elsewhere (a penalty on the weight in the loss, the weight
        used outside the layer), and the factors, whose average replaces the gradient, do not carry
        it. Said rather than lost silently (docs/reliability.md, "Known gaps")."""
        if id(state.layer.weight) in self._warned_outside:
            return
        self._warned_outside.add(id(state.layer.weight))
        warnings.warn(f"rank {dist.get_rank(self.group)}: {state.name} got gradient from outside its layer's call "
                      f"(a penalty on the weight in the loss, a use of the weight elsewhere), which "
                      f"sufficient-factor broadcasting does not carry: that part is lost. Give the layer "
                      f"strategy 'ring', or put the penalty in the optimizer's weight_decay", RuntimeWarning,
                      stacklevel=1)

    def _left_unsynchronized(self, ids: set[int]) -> RuntimeError | None:
        """The error for parameters that accumulated a gradient under no_sync and got none in the
        synchronized step after it (an extra loss on the first micro-batch only): nothing averages
        that gradient, and each rank's optimizer would apply its own. DDP raises here too."""
        names = [name for name, p in self.module.named_parameters() if id(p) in ids and p.requires_grad]
        if not names:
            return None
        return RuntimeError(f"rank {dist.get_rank(self.group)}: {', '.join(names[:3])}"
                            f"{' ...' if len(names) > 3 else ''} accumulated a gradient under no_sync but got "
                            f"none in the synchronized step after it, so nothing averages it; pass "
                            f"find_unused_parameters=True, which does")

    def _hand_on(self, p: torch.Tensor) -> None:
        """p's gradient to the synchronization thread: alone, in a bucket, or compressed first."""
        weight = self._weight_of.get(id(p), p)
        state = self._linear.get(id(weight))
        if state is not None and state.strategy == hybrid.SFB:
            if p is weight and not state.local_grad:
                self._warn_outside_sfb(state)
            return                          # its layer's factors carry it
        chosen = state.strategy if state is not None and p is weight else None
        if chosen is None:
            chosen = self._choose(p, 0)
        if chosen == hybrid.SFB:            # a weight whose gradient came from outside its layer's call
            chosen = hybrid.RING
        grad = p.grad
        compressed = chosen not in STRATEGIES and not grad.is_sparse
        dense_ring = chosen == hybrid.RING and not grad.is_sparse
        coo_sparse = chosen == hybrid.SPARSE and grad.is_sparse
        dense_sparse = chosen == hybrid.SPARSE and not grad.is_sparse
        size = 0 if grad.is_sparse else grad.numel() * grad.element_size()
        small = not grad.is_sparse and size <= SMALL_BYTES
        unit = self._unit.get(self._names.get(id(p)))
        in_unit = unit is not None and self._unit_size[unit] > 1
        # a plan's unit of several compressed tensors, of several dense ones on the ring, or of several
        # COO ones under the sparse AllReduce, is one bucket, whatever their sizes; without a plan,
        # dense gradients on the ring smaller than a full bucket (a larger one goes alone, in place,
        # not copied into a bucket) and COO gradients under the sparse AllReduce ready one after
        # another are buckets. Dense gradients under the sparse AllReduce are concatenated into one
        # (copied): a plan's unit of them if they hold at most BUCKET_BYTES together, else one by
        # one; without a plan, small ones as on the ring (ncf's eight MLP tensors, 2761 elements, took
        # 8.5 ms one after another)
        if dense_sparse:
            bucketed = self._unit_bytes[unit] <= BUCKET_BYTES if in_unit else small and unit is None
        else:
            bucketed = small or ((compressed or dense_ring or coo_sparse) and in_unit) \
                or (coo_sparse and not self._unit) or (dense_ring and self._ring_bucketed(size))
        if not (compressed or ((dense_ring or coo_sparse or dense_sparse) and bucketed)):
            self._enqueue(p, chosen, p.grad)
            return
        kind = (chosen, self._placement_of(p, chosen) if compressed else CHANNEL)
        try:
            payload = self._compress_apart(p, *kind) if compressed else None
        except BaseException as exc:          # reaches backward at its end, as the thread's errors
            self._fail_in_order(exc)
            return
        if bucketed:
            self._add_to_bucket(p, kind, payload)
        else:
            self._send_compressed(p, kind, payload)

    def _send_compressed(self, p: torch.Tensor, kind: tuple, payload) -> None:
        """A large compressed gradient goes at once, with its layer's bias if that is the last of the
        open bucket (the same compressor): one collective for the layer."""
        last = self._bucket[-1][0] if self._bucket and self._bucket_kind == kind else None
        layer = [self._bucket.pop()] if last is not None and self._weight_of.get(id(last)) is p else []
        self._flush()
        event = Event(self._names.get(id(p), "?"), kind[0], time.perf_counter())
        self.trace.append(event)
        self._put_compressed(kind, layer + [(p, event, payload)])

    def _placement_of(self, p: torch.Tensor, spec: str) -> str:
        """Where p's compressor runs: the plan's placement, on the synchronization thread for a
        compressor that cannot compress apart from its collective (PowerSGD)."""
        placement = self._placement.get(self._names.get(id(p)), CHANNEL)
        return placement if placement == CHANNEL or self._reducer(spec, placement).splits else CHANNEL

    def _compress_apart(self, p: torch.Tensor, spec: str, placement: str):
        """Compress p's gradient here (the training thread) or on the offload thread, or None: the
        synchronization thread compresses it (CHANNEL). The synchronization thread communicates the
        payload, in backward order as every other tensor. Each placement has its own Reducer, so that
        each compresses in the same order on every rank (randomk's shared indices and PowerSGD's
        seeds follow the order of calls)."""
        if placement == CHANNEL:
            return None
        reducer = self._reducer(spec, placement)
        if placement == OFFLOAD:
            if self._resources.offload is None:
                self._resources.offload = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="sparcoll-offload")
            return self._resources.offload.submit(reducer.compress, p.grad, id(p))
        return reducer.compress(p.grad, id(p))

    def _fail_in_order(self, error: BaseException) -> None:
        """An error of the training thread: it reaches the synchronization thread after what was queued
        before it, and that thread skips what comes after (see _skipping)."""
        self._flush()                   # the open bucket was ready before it
        self._put((None, FAILED, error, []))

    def _enqueue(self, p: torch.Tensor, chosen: str, extra) -> None:
        self._flush()                   # the bucket goes first: it was ready first
        event = Event(self._names.get(id(p), "?"), chosen, time.perf_counter())
        self.trace.append(event)
        self._put((p, chosen, extra, [event]))

    def _put(self, item: tuple) -> None:
        self._started += 1
        with self._idle:
            self._pending += 1
        if self.wait_free:
            self._queue.put(item)
        else:
            self._held.append(item)

    def _add_to_bucket(self, p: torch.Tensor, kind: tuple, payload) -> None:
        """Small gradients of one kind (the ring, or one compressor in one placement) travel together,
        as DDP's buckets: one collective instead of one each; without a plan, so do the ring's
        gradients smaller than BUCKET_BYTES (on 2 cores each collective costs CPU: deeplight's 640 KB
        MLP weights one by one made its step 1.16-1.22x longer on loopback). The bucket is formed
        on the training thread in ready order and sent when it is full, when a gradient that does
        not join it is ready, or at the end of backward, so it is the same on every rank without a
        message. A plan's unit of several tensors gathers apart from it and from the other units (its
        members need not be ready one after another: deeplight's dense_embedding is ready between
        its two COO embeddings) and goes as soon as it is complete (the plan priced the unit ready
        with its last member: waiting for the next gradient cost ncf's first bucket 9 ms), and then
        only: a unit may hold several large tensors, compressed or on the ring (sparcoll.plan.fusion)."""
        name = self._names.get(id(p), "?")
        event = Event(name, kind[0], time.perf_counter())
        self.trace.append(event)
        unit = self._unit.get(name)
        if unit is not None and self._unit_size[unit] > 1:
            gathering = self._unit_buckets.setdefault(unit, [kind, [], 0])
            if _other_kind(gathering[0], gathering[1], kind, p.grad):
                # a hand-made plan's unit of several kinds (or dtypes): one collective per kind, as
                # without a plan, never a member sent under another's strategy
                self._flush()
                self._put_bucket(gathering[0], gathering[1])
                gathering[:2] = kind, []
            gathering[1].append((p, event, payload))
            gathering[2] += 1
            if gathering[2] == self._unit_size[unit]:
                self._send_unit(unit)
            return
        if _other_kind(self._bucket_kind, self._bucket, kind, p.grad):
            self._flush()
        self._bucket_kind = kind
        self._bucket.append((p, event, payload))
        self._bucket_bytes += p.grad.numel() * p.grad.element_size()
        # a plan's unit of one tensor goes at once
        if unit is not None or self._bucket_bytes >= (COO_BUCKET_BYTES if p.grad.is_sparse else BUCKET_BYTES):
            self._flush()

    def _flush(self) -> None:
        """The open bucket (not a plan's unit) to the synchronization thread."""
        if not self._bucket:
            return
        bucket, self._bucket, self._bucket_bytes = self._bucket, [], 0
        self._put_bucket(self._bucket_kind, bucket)

    def _send_unit(self, unit: int) -> None:
        """A plan's unit, complete or at the end of backward, after the open bucket (ready before it)."""
        self._flush()
        kind, members, _ = self._unit_buckets.pop(unit)
        self._put_bucket(kind, members)

    def _send_incomplete_units(self) -> None:
        """At the end of backward, the units some of whose members had no gradient, in the plan's
        order: the same on every rank that missed the same ones (DDP's rule: find_unused_parameters
        for ranks that differ)."""
        for unit in sorted(self._unit_buckets):
            self._send_unit(unit)

    def _put_bucket(self, kind: tuple, bucket: list) -> None:
        whole = {hybrid.RING: BUCKET, hybrid.SPARSE: COO_UNIT if bucket[0][0].grad.is_sparse
                 else SPARSE_BUCKET}.get(kind[0])   # uncompressed
        if whole is not None:
            self._put((None, whole, [(q, q.grad) for q, _, _ in bucket], [e for _, e, _ in bucket]))
        else:
            self._put_compressed(kind, bucket)

    def _put_compressed(self, kind: tuple, members: list) -> None:
        """(parameter, event, payload) of one compressor in one placement: one collective for all."""
        self._put((None, COMPRESSED, (self._reducer(*kind), [(q, q.grad, x) for q, _, x in members]),
                   [e for _, e, _ in members]))

    def _arm(self) -> None:
        """At the first gradient of a backward: make its end wait for the synchronizations."""
        if self._armed:
            return
        self._claim_channels()
        self._armed = True
        self._step += 1
        self._started = self._ran = 0
        self.trace = []
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._share_rows()

    def _claim_channels(self) -> None:
        """This wrapper synchronizes on its group (and communicator) in this backward: RuntimeError, on
        every rank alike, if another wrapper does already (a loss through two wrapped models)."""
        keys = [("process group", id(self.group if self.group is not None else dist.group.WORLD))]
        keys += [("communicator", id(self.comm))] if self.comm is not None else []
        with _SYNCHRONIZING_LOCK:
            for key in keys:
                other = _SYNCHRONIZING.get(key)
                if other is not None and other is not self:
                    raise RuntimeError(
                        f"two DataParallel wrappers on one {key[0]} synchronize in one backward (of "
                        f"{type(other.module).__name__} and of {type(self.module).__name__}): their collectives "
                        f"would pair across ranks in different orders. Wrap the models in one DataParallel, or "
                        f"give each its own group (group=dist.new_group(), on every rank in the same order) and "
                        f"its own communicator")
            for key in keys:
                _SYNCHRONIZING[key] = self

    def _release_channels(self) -> None:
        with _SYNCHRONIZING_LOCK:
            for key in [key for key, holder in _SYNCHRONIZING.items() if holder is self]:
                del _SYNCHRONIZING[key]

    def _share_rows(self) -> None:
        """Queue, first in the step, the allreduce of the rows this rank fed each linear layer whose
        strategy the hybrid model picks (one that may take SFB, _may_take_sfb): the next step chooses
        from the ranks' mean, so every rank chooses alike (ranks choosing differently would run
        different collectives) whatever each one's batch. Left running: it used to be a check that
        the rows agreed, on the synchronization thread, and it held that thread 16-20 ms a step beside
        backward on deeplight (4 processes on 2 cores) before the step's first collective. None at
        all where no layer's rows matter: on gpt tiny (2 ranks on loopback, one fixed batch) the
        allreduce alone made the step 3.4-4.1 ms where it is 1.9-2.1 without."""
        auto = [s for s in self._linear.values() if self._requested(s.layer.weight) == AUTO]
        if not auto:
            return
        # then whether this rank called each more than once (SFB needs the same count everywhere)
        rows = torch.tensor([s.rows for s in auto] + [float(len(s.calls) > 1) for s in auto],
                            dtype=torch.float64)
        weights = [id(s.layer.weight) for s in auto]
        self._put((None, ROWS, (rows, weights), [Event("(rows of linear layers)", ROWS, time.perf_counter())]))

    def _hand_on_the_rest(self) -> tuple[list, torch.Tensor]:
        """find_unused_parameters, at the end of backward: the parameters not handed on yet, in the
        order, each without a gradient of this step (or accumulated under no_sync) with a copy of
        the gradient it holds in its place (a second backward without zero_grad: DDP's rule), else
        zeros; then the allreduce that counts the ranks that used each parameter (until the
        order is rebuilt, followed by where in rank 0's arrivals each parameter came, 1 for the
        first, 0 for none: the other ranks add zeros). Returns the stand-ins, (position in the
        order, parameter, its gradient before), and that allreduce's tensor (final once every
        synchronization of the step is done)."""
        used = [id(p) in self._got or (id(p) in self._accumulated_ids and p.grad is not None)
                for p in self._order]
        stand_ins = []
        for i in range(self._handed, len(self._order)):
            p = self._order[i]
            if not used[i]:
                stand_ins.append((i, p, p.grad))
                if p.grad is not None:      # the same layout as a rank that used it gets: held + new
                    p.grad = p.grad.clone()
                elif id(p) in self._coo or id(p) in self._lookups:
                    p.grad = sparse.zeros_like(p)
                else:
                    p.grad = torch.zeros_like(p)
            self._hand_on(p)
        self._flush()
        self._send_incomplete_units()
        self._handed, self._got, self._accumulated_ids = 0, set(), set()
        if self._arrivals is None:
            counts = torch.tensor(used, dtype=torch.int32)
        else:
            came = [0] * len(self._order)
            if dist.get_rank(self.group) == 0:
                where = {id(p): i for i, p in enumerate(self._order)}
                for k, pid in enumerate(self._arrivals, 1):
                    came[where[pid]] = k
            counts = torch.tensor(used + came, dtype=torch.int32)
            self._arrivals = []
        self._put((None, USED, counts, [Event("(parameters used)", USED, time.perf_counter())]))
        return stand_ins, counts

    def _rebuild_order(self, came: list[int]) -> None:
        """The order from now on: rank 0's gradients as they came (`came`: where in its arrivals each
        parameter of the order came, 0 for none), then those it did not get, as they were."""
        first = sorted((k, i) for i, k in enumerate(came) if k > 0)
        rest = [p for p, k in zip(self._order, came) if k == 0]
        self._order = [self._order[i] for _, i in first] + rest
        self._arrivals = None

    @staticmethod
    def _restore_unused_everywhere(stand_ins: list, counts: torch.Tensor,
                                   error: BaseException | None) -> None:
        """A parameter no rank used keeps the gradient it had before the step (None, as under DDP):
        the zeros it stood in with are nobody's gradient. After an error every stand-in goes back."""
        for i, p, before in stand_ins:
            if error is not None or counts[i] == 0:
                p.grad = before

    def _requested(self, p: torch.Tensor) -> str:
        if isinstance(self._explicit, dict):
            return self._explicit.get(self._names.get(id(p)), AUTO)
        return self._explicit

    def _finish(self) -> None:
        """End of backward: wait for every synchronization, then let backward return."""
        self.backward_end = time.perf_counter()
        if self.find_unused_parameters:
            stand_ins, counts = self._hand_on_the_rest()    # accumulated gradients included
            unsynchronized = set()
        else:
            stand_ins, counts = [], None
            unsynchronized, self._accumulated_ids = self._accumulated_ids - self._came, set()
            self._warn_if_some_stopped_coming()
        self._flush()
        self._send_incomplete_units()
        if not self.find_unused_parameters:     # (with it every rank reduces the same by construction)
            self._put((None, CHECK, None, []))
        if self._sfb_channel is not None and any(s.strategy == hybrid.SFB for s in self._linear.values()):
            self._put((None, SFB_END, sum(s.gathers for s in self._linear.values()), []))
        self._armed = False
        self._release_channels()
        self._accumulated = False
        held, self._held = self._held, []
        for item in held:
            self._queue.put(item)
        with self._breaking():
            error = self._wait_for_the_step("gradient synchronization")
            if error is None and unsynchronized:
                error = self._left_unsynchronized(unsynchronized)
            if error is not None:
                error = self._agree_on_the_failed_step(error)
        self._break_on(error)
        if error is not None:
            self._settle_offloaded()
        self._unchecked = []        # a step's gradients are checked in that step's buckets or not at all
        self._keep_what_the_step_learned(error is None)
        self._restore_unused_everywhere(stand_ins, counts, error)
        if error is not None:       # dropped, as a step whose backward raised: no rank's own gradient
            for p in self._params:  # may reach an optimizer as if it were the average
                p.grad = None
        if error is None and counts is not None and len(counts) > len(self._order):
            self._rebuild_order(counts[len(self._order):].tolist())
        for key, state in self._linear.items():
            started, weight, bias, bias_sum = state.started, state.weight_sum, state.bias, state.bias_sum
            self._own_rows[key] = state.rows
            state.reset()
            if error is None and started:       # SFB's averages replace the local gradients
                state.layer.weight.grad = weight
                if bias is not None:
                    bias.grad = bias_sum
        if isinstance(error, DivergedError):
            raise error
        if error is not None:
            raise RuntimeError(f"gradient synchronization failed: {error}{self._hint(error)}") from error

    @contextlib.contextmanager
    def _breaking(self):
        """A step whose synchronizations timed out or whose ranks no longer agree leaves collectives
        pending on gloo on some ranks: the next forward's buffer broadcast or the next step's
        collectives would pair with them and wait for the process group's timeout (30 minutes) on
        every rank. Such an error is kept, and every later forward raises at once instead (as DDP
        refuses every step after a failed one)."""
        try:
            yield
        except BaseException as exc:
            self._break_on(exc)
            raise

    def _break_on(self, error: BaseException | None) -> None:
        """After a timeout, a divergence, a mismatch or a peer's failure no later step runs, and peers
        still waiting for this rank's collectives learn it within a second. (A mismatch: where a bucket's
        check failed, how many of the step's later collectives each rank had started depends on its
        threads' timing, so the next step's would pair with them.)"""
        if error is not None and _ends_the_job(error):
            self._broken = error
            if self._dropped is not None:
                try:
                    self._dropped.give_up(self._step)
                except Exception as exc:    # the Store gone too: the peers' deadlines remain
                    warnings.warn(f"could not tell the peers that DataParallel stopped: {exc}", RuntimeWarning,
                                  stacklevel=2)

    def _agree_on_the_failed_step(self, error: BaseException) -> BaseException:
        """The step's synchronization failed here with `error`: the step is dropped if every rank's
        failed after running as many synchronizations (an error in the wrapper's own code, alike
        everywhere); else DivergedError on every rank. A rank that failed alone (out of memory, say)
        would otherwise go on to its next step while its peers still wait in this one, and their
        collectives would pair one step's with another's: silently, where their sizes agree. gloo's
        own timeout is a CollectiveTimeout (the group may hold collectives still pending); a
        MismatchError every rank raises alike, and a PeerError ends the job's steps (_break_on)."""
        if gloo_timed_out(error):
            timeout = CollectiveTimeout(f"a collective timed out ({error})")
            timeout.__cause__ = error
            return timeout
        if gloo_lost_a_peer(error):
            lost = PeerError(f"a peer's connection broke ({error})")
            lost.__cause__ = error
            return lost
        if self._dropped is None or _ends_the_job(error):
            return error
        try:
            self._dropped.drop(self._step, self._ran, min(self.timeout, AGREE_S),
                               failed=f"gradient synchronization failed ({type(error).__name__}: {error})")
        except DivergedError as exc:
            exc.__cause__ = error
            return exc
        return error

    def _wait_for_the_step(self, what: str, watch: bool = True) -> BaseException | None:
        """Wait for every synchronization of the step (within the timeout) and take its error, if any.
        After an error the synchronization thread skips the rest of the step (from the error's place
        in its queue, _skipping): waiting for all of it means that nothing of this step runs after the
        error is cleared. `watch`: every second of waiting, look whether a peer dropped this step
        (its backward raised, or its synchronization failed, this rank's did not)."""
        now = time.monotonic()
        deadline, look = now + self.timeout, now + WATCH_EVERY_S
        while True:
            with self._idle:
                while self._pending and now < min(deadline, look):
                    self._idle.wait(min(deadline, look) - now)
                    now = time.monotonic()
                if not self._pending:
                    error, self._error, self._skipping = self._error, None, None
                    return error
            if now >= deadline:
                raise CollectiveTimeout(f"{what} did not finish within {self.timeout} s")
            look = now + WATCH_EVERY_S
            diverged = None
            if watch and self._dropped:     # (a rank whose own step failed too drops it once its items ran:
                diverged = self._dropped.dropped_by_a_peer(self._step) if self._error is None else \
                    self._dropped.finished_by_a_peer(self._step)    # a peer's drop is no divergence then)
            if diverged is not None:
                raise DivergedError(diverged)

    def _drop_failed_step(self) -> None:
        """At the forward after a backward that raised (autograd never called _finish): the step is
        dropped, if every rank's backward raised at the same point (sparcoll.torch.dropped: the ranks
        agree through the Store, else DivergedError on every rank). The step's synchronizations
        already started run to their end, paired with the peers' same ones; what it had not sent
        (the open bucket, the units being gathered, the held items) is dropped on every rank alike;
        every gradient is cleared (set to None, as zero_grad does: a result of the step's
        synchronization may have landed after the caller cleared them). Before, the next backward
        found the wrapper armed: it never waited for its synchronizations and sent the old step's
        half-filled buckets with its own gradients (a 3-layer MLP's gradients off by up to 1.2e-3,
        silently). DDP instead refuses every later step."""
        error = None
        with self._idle:
            self._pending -= len(self._held)        # never queued (wait_free=False)
        self._held = []
        try:
            self._dropped.drop(self._step, self._started, self.timeout)
            error = self._wait_for_the_step("the synchronization of a step whose backward raised",
                                            watch=False)
            self._settle_offloaded()
        finally:
            self._keep_what_the_step_learned(False)
            self._bucket, self._bucket_bytes, self._unit_buckets, self._held = [], 0, {}, []
            self._armed = self._accumulated = False
            self._release_channels()
            self._unchecked = []
            self._came = set()
            self._handed, self._got, self._accumulated_ids = 0, set(), set()
            if self._arrivals is not None:
                self._arrivals = []
            for state in self._linear.values():
                state.reset()
            for p in self._params:
                p.grad = None
        warnings.warn("a backward raised before its gradients were synchronized, on every rank: "
                      "DataParallel dropped that step and cleared the gradients", RuntimeWarning,
                      stacklevel=5)      # the caller's model(...)
        if error is not None:
            raise RuntimeError(f"the synchronization of a step whose backward raised failed: {error}"
                               f"{self._hint(error)}") from error

    def _settle_offloaded(self) -> None:
        """Wait, within the timeout, until the offload thread ran every compression submitted so far:
        after a failed step none may still write a gradient's error-feedback memory (the step's
        synchronization skipped those tensors once it failed)."""
        if self._resources.offload is not None:
            try:
                self._resources.offload.submit(lambda: None).result(timeout=self.timeout)   # one thread: in order
            except (RuntimeError, concurrent.futures.CancelledError):
                pass    # closed before or during the wait: nothing more runs there
            except concurrent.futures.TimeoutError:
                warnings.warn(f"an offloaded compression still ran {self.timeout} s after its step failed",
                              RuntimeWarning, stacklevel=2)

    def _hint(self, error: BaseException) -> str:
        """What a MismatchError means here: the parameters its tags stand for, and the likely cause."""
        if not isinstance(error, MismatchError):
            return ""
        names = {tag: self._names.get(pid, "?") for pid, tag in self._tags.items()}
        tags = sorted({int(t) for t in re.findall(r"\btag (\d+)", str(error))})  # wire.tagged's words
        which = "; ".join(f"tag {t} is {names[t]!r}" for t in tags if t in names)
        # (not for SFB's calls that differ: _calls_differ says what to do)
        cause = "" if self.find_unused_parameters or isinstance(error.__cause__, LabelMismatch) else (
            ". If some ranks' steps leave out parameters the others use (a branch the data decides), "
            "pass find_unused_parameters=True")
        return (f" ({which})" if which else "") + cause

    # ---- the synchronization thread ----------------------------------------------------------------
    def _serve(self, item: tuple) -> None:
        """The synchronization thread's work on one queued item (_each_item)."""
        p, chosen, extra, events = item
        start, started = time.perf_counter(), None
        try:
            if self._skipping is None:     # after a failure, later tensors are moot
                self._ran += 1
                started = self._synchronize(p, chosen, extra)
        except BaseException as exc:       # every error reaches backward, none kills the thread; the
            self._error = self._error or exc   # first is the step's (the completion thread's may come first)
            self._skipping = self._skipping or exc
        end = time.perf_counter()
        for event in events:
            event.start, event.end = start, end
        if started is not None:      # the completion thread counts it done
            self._running.put(Started(*started, events))
        else:
            self._one_done()

    def _complete(self, started: Started) -> None:
        """The completion thread's work on one collective the synchronization thread left running,
        in the order they started: waits for it and puts its result in place (after an error, only
        waits: nothing of the step may run after backward has returned)."""
        try:
            self._wait_for(started.work)
            if self._error is None:
                started.finish()
        except BaseException as exc:       # every error reaches backward, none kills the thread
            self._error = self._error or exc
            if _ends_the_job(exc):      # else the rest of the step still runs, as on every rank
                self._skipping = self._skipping or exc
        end = time.perf_counter()
        for event in started.events:
            event.end = end
        self._one_done()

    def _one_done(self) -> None:
        """One item of the step is over: backward's wait for the step counts it."""
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _wait_for(self, work) -> None:
        """gloo's wait for a collective left running, within the timeout; gloo's own timeout error
        (a RuntimeError, "Operation timed out!") as CollectiveTimeout, which _breaking keeps."""
        wait_within(work, self.timeout)

    def _synchronize(self, p: torch.Tensor, chosen: str, extra) -> tuple | None:
        if chosen == FAILED:
            raise extra
        if chosen == USED:             # in place: _finish reads it once every synchronization is done
            return self._later(dist.all_reduce(extra, group=self.group, async_op=True), lambda: None)
        if chosen == ROWS:
            rows, weights = extra
            work = dist.all_reduce(rows, group=self.group, async_op=True)

            def learn() -> None:
                self._learned_rows.update(zip(weights, (rows[:len(weights)] / self.world).tolist()))
                self._learned_repeated.update(w for w, n in zip(weights, rows[len(weights):].tolist()) if n)
            return self._later(work, learn)
        if chosen in (hybrid.SFB, SFB_END):
            try:
                if chosen == SFB_END:
                    end_of_step(self._sfb_channel, extra)
                    return None
                state, u, v, label = extra
                state.add(*gather_factors(u, v, self._sfb_channel, label))
                return None
            except LabelMismatch as exc:
                raise self._calls_differ(exc.labels) from exc
        if chosen == CHECK:
            return self._check_alone()
        if chosen == BUCKET:
            params, grads = zip(*extra)
            tags, self._unchecked = self._unchecked + [self._tags[id(q)] for q in params], []
            check = self._bucket_check(tags, grads[0].dtype)
            flats, work = self.channel.start_allreduce_mean_many(
                [g.reshape(-1) for g in grads] + ([] if check is None else [check]))

            def finish() -> None:
                if check is not None and not torch.equal(flats[-1], check):
                    names = ", ".join(self._names.get(id(q), "?") for q in params[:4])
                    raise self._mixed(f"since the last check (this rank's bucket: {names}"
                                      f"{' ...' if len(params) > 4 else ''}, and the gradients before)")
                for q, grad, flat in zip(params, grads, flats):
                    self._put_back(q, grad, flat)
            return self._later(work, finish)
        if chosen == SPARSE_BUCKET:
            params, grads = zip(*extra)
            averages = self.channel.sparse_mean_many(grads, self._tags[id(params[0])])
            for q, grad, average in zip(params, grads, averages):
                self._put_back(q, grad, average)
            return None
        if chosen == COO_UNIT:          # one sparse AllReduce of the unit's rows (sparse.concatenate)
            grads = [self._note_rows(q, grad.coalesce()) for q, grad in extra]
            totals = sparse.allreduce_many(grads, "avg", self.comm, tag=self._tags[id(extra[0][0])])
            for (q, _), total in zip(extra, totals):
                q.grad = self._lookups.as_declared(q, total)
            return None
        if chosen == COMPRESSED:
            reducer, members = extra
            grads = [grad for _, grad, _ in members]
            if reducer.compressor.scheme != "sparse":   # on gloo's group: the next bucket checks them
                self._unchecked += [self._tags[id(q)] for q, _, _ in members]
            payloads = [x.result(timeout=self.timeout) if isinstance(x, concurrent.futures.Future) else x
                        for _, _, x in members]
            # the averages straight into the gradients where they are flat float32 (vgg's layers:
            # 400 MB of copy fewer per step)
            into = [g.view(-1) for g in grads] if all(map(takes_average_in_place, grads)) else None
            tag = self._tags[id(members[0][0])]
            if payloads[0] is None:             # compressed here, on the synchronization thread
                outs = reducer.reduce_many(grads, [id(q) for q, _, _ in members], into=into, tag=tag)
            else:
                outs = reducer.communicate(payloads, grads, into, tag)
            for grad, out in zip(grads, outs):
                if out.data_ptr() != grad.data_ptr():
                    grad.copy_(out.view_as(grad))
            return None
        grad = extra        # as it was handed on: the caller may have cleared p.grad after a failed backward
        if grad.is_sparse:
            return self._synchronize_coo(p, self._note_rows(p, grad.coalesce()), chosen)
        flat = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1).clone()
        finish = functools.partial(self._put_back, p, grad, flat)
        if chosen in (hybrid.RING, hybrid.PS):      # gloo's: the next ring bucket's check covers it
            self._unchecked.append(self._tags[id(p)])
        if chosen == hybrid.RING:
            return self._later(self.channel.start_allreduce_mean(flat), finish)
        if chosen == hybrid.PS:
            if id(p) not in self._scratch:
                shard = -(-flat.numel() // self.world)
                self._scratch[id(p)] = [torch.empty(shard, dtype=flat.dtype) for _ in range(self.world - 1)]
            ps_allreduce(flat, self.group, self._scratch[id(p)], self.timeout).div_(self.world)
        elif chosen == hybrid.SPARSE:
            self.comm.allreduce(flat, op="avg", tag=self._tags[id(p)])
        finish()
        return None

    def _check_alone(self) -> tuple | None:
        """At the end of a step, the check of what gloo reduced after its last bucket (a model whose
        last gradients are large, or go to the parameter server), in an allreduce of its own: only
        where one of them has the size of another parameter (else ranks that reduced different ones
        disagree on sizes, and gloo stops them). Ranks whose reductions agree decide alike; ranks
        whose reductions differ fail either way."""
        tags, self._unchecked = self._unchecked, []
        check = self._bucket_check(tags, torch.float32) if self._ambiguous.intersection(tags) else None
        if check is None:
            return None
        sent = check.clone()

        def finish() -> None:
            if not torch.equal(check, sent):
                raise self._mixed("after the step's last bucket")
        return self._later(self.channel.start_allreduce_mean(check), finish)

    def _calls_differ(self, labels: list) -> MismatchError:
        """The error of SFB's gathers whose labels differ by rank (sfb.gather_factors): each rank's
        call of which layer, or the end of its step's gathers."""
        names = {self._tags[weight]: state.name for weight, state in self._linear.items()}
        said = "; ".join(f"rank {rank}: " + (f"the end of its step, after {k} calls of its SFB layers"
                                             if tag == END else f"call {k} of {names.get(tag, f'tag {tag}')}")
                         for rank, (tag, k) in enumerate(labels))
        return MismatchError(f"ranks called their linear layers a different number of times in one step, at "
                             f"this gather {said}: sufficient-factor broadcasting gathers each call on its own; "
                             f"give such a layer another strategy (\"ring\")")

    def _mixed(self, where: str) -> MismatchError:
        """The error of a check whose elements came back changed (_bucket_check), `where` saying which
        gradients it covered."""
        return MismatchError(f"rank {dist.get_rank(self.group)}: the ranks' gradients reduced by gloo "
                             f"held different parameters {where}: their sums mix them")

    def _bucket_check(self, tags: list[int], dtype: torch.dtype) -> torch.Tensor | None:
        """Two elements that ride at the end of a ring bucket, world * t and world * t * t, where t (1 to
        BUCKET_CHECK_MOST) stands for `tags` in order: the bucket's parameters', after those of the
        gradients gloo reduced alone since the last bucket (large ones on the ring, the parameter
        server's). Divided by the world and summed, they come back as they went on every rank if and
        only if every rank's t was the same (their variance is zero): a rank that reduced other
        parameters of the same sizes (a branch the others did not take) fails that step on every
        rank, where gloo would have summed them. Exact integers in float32 up to BUCKET_CHECK_WORLD
        ranks; none for half dtypes."""
        if not 1 < self.world <= BUCKET_CHECK_WORLD or dtype not in (torch.float32, torch.float64):
            return None
        t = 1 + zlib.crc32(str(tags).encode()) % BUCKET_CHECK_MOST
        return torch.tensor([self.world * t, self.world * t * t], dtype=dtype)

    @staticmethod
    def _later(work, finish: Callable[[], None]) -> tuple | None:
        """A started collective's (work, finish) for the completion thread; finished here (None)
        where there is nothing to wait for."""
        if work is None:
            finish()
            return None
        return work, finish

    def _put_back(self, p: torch.Tensor, grad: torch.Tensor, flat: torch.Tensor) -> None:
        """p's average, `flat`, into its gradient (unless it is a view of it), and its density."""
        if flat.data_ptr() != grad.data_ptr():
            grad.copy_(flat.view_as(grad))
        self._learn_density(p, flat)

    def _learn_density(self, p: torch.Tensor, averaged: torch.Tensor) -> None:
        """The block density of p's averaged gradient, which the hybrid choice reads next step; only
        where it chooses, and where a density could make it choose the sparse AllReduce (a scan of
        every block, on the synchronization thread: deeplight's embedding is 68 MB; without the
        scans of its 16 small tensors gpt tiny's step went from 5.1-5.9 to 4.0-5.3 ms on loopback)."""
        if id(p) in self._density_decides:
            blocks = BlockTensor(averaged, self._block_size())
            self._learned_density[id(p)] = blocks.nonzero().size / max(1, blocks.nblocks)

    def _keep_what_the_step_learned(self, succeeded: bool) -> None:
        """At a step's end, once none of its collectives runs: its rows and densities become what the
        next step chooses by, if it succeeded on every rank; else the last good step's stay."""
        if succeeded:
            self._rows.update(self._learned_rows)
            self._density.update(self._learned_density)
            self._repeated |= self._learned_repeated
        self._learned_rows, self._learned_density, self._learned_repeated = {}, {}, set()

    def _note_rows(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """`grad` (coalesced COO), having noted the share of p's rows it touches: this worker's
        density, which `strategy` prices its bytes by (no choice reads it: a COO gradient's strategy
        does not depend on it, and the share differs by rank)."""
        self._density[id(p)] = grad._nnz() / max(1, entries_of(grad))
        return grad

    def _synchronize_coo(self, p: torch.Tensor, grad: torch.Tensor, chosen: str) -> tuple | None:
        """A sparse COO gradient (nn.Embedding(sparse=True)): averaged without densifying, gloo's
        sparse all_reduce left running."""
        if chosen in (hybrid.RING, hybrid.PS):        # the group's sparse all_reduce (gloo's gathers)
            self._unchecked.append(self._tags[id(p)])
            total, work = self._group_channel.start_sparse_mean(grad)
            return self._later(work, lambda: setattr(p, "grad", self._lookups.as_declared(p, total.coalesce())))
        if chosen == hybrid.SPARSE:
            total = self.comm.allreduce_coo(grad, op="avg", tag=self._tags[id(p)])
        else:
            total = self._reducer(chosen).reduce(grad, key=id(p), tag=self._tags[id(p)])
        p.grad = self._lookups.as_declared(p, total)
        return None

    def _reducer(self, spec: str, placement: str = CHANNEL) -> Reducer:
        """The one Reducer of a compressor in a placement, whichever thread asks first (the training thread
        for a bucket, the synchronization thread for a COO gradient): each Reducer agrees on its settings
        in a collective of its own at its first use, so a second one made by a race on one rank only
        would add a collective there that its peers never run, and every rank would wait for the
        timeout."""
        with self._reducers_lock:
            if (spec, placement) not in self._reducers:
                self._reducers[spec, placement] = Reducer(spec, self.group, self.comm, self.timeout,
                                                          check_sizes=False)     # (_check_alike_on_every_rank)
            return self._reducers[spec, placement]

    def _check_alike_on_every_rank(self, refused: BaseException | None = None) -> None:
        """MismatchError on every rank if the ranks were given other models (parameters' names,
        shapes, dtypes) or other strategies, before anything else crosses the group: rank 0's
        parameters broadcast into tensors of other sizes made gloo abort the process, and one rank's
        fp16 against another's ring in a step did too. `refused`: why this rank refused its strategy
        (a plan for another worker count or model: a stale file on one host), which the others raise
        naming it (they waited for the whole timeout, or got gloo's "Connection closed by peer"); this
        rank then raises its own. One gather of two checksums and a reason, within the timeout."""
        model = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in self.module.named_parameters()]
        strategy = None if refused is not None else (
            sorted(self._explicit.items()) if isinstance(self._explicit, dict) else self._explicit,
            sorted(self._placement.items()), sorted(self._unit.items()), self.find_unused_parameters,
            self.comm is not None)
        reason = None if refused is None else f"{type(refused).__name__}: {refused}"
        every = self._group_channel.allgather_object(
            (zlib.crc32(repr(model).encode()), zlib.crc32(repr(strategy).encode()), reason))
        refusals = [f"rank {rank}: {theirs[2]}" for rank, theirs in enumerate(every) if theirs[2] is not None]
        if refusals:
            if refused is None:
                raise MismatchError("a rank refused the strategy it was given for DataParallel (" +
                                    "; ".join(refusals) + "): every rank needs the same, fitting this model")
            return
        for i, what in enumerate(("model (its parameters' names, shapes or dtypes)",
                                  "strategy (or find_unused_parameters, or a communicator)")):
            others = [rank for rank, theirs in enumerate(every) if theirs[i] != every[0][i]]
            if others:
                raise MismatchError(f"rank(s) {others} built DataParallel with another {what} than rank 0: "
                                    f"every rank needs the same")

    def _broadcast_from_rank0(self) -> None:
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, group=self.group, group_src=0)

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank, one broadcast per dtype, on the training thread (no
        synchronization runs between backward's end and the next forward)."""
        by_dtype = collections.defaultdict(list)
        for t in self.module.buffers():
            by_dtype[t.dtype].append(t)
        with torch.no_grad():
            for same in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                dist.broadcast(flat, group=self.group, group_src=0)
                for t, part in zip(same, flat.split([t.numel() for t in same])):
                    t.copy_(part.view_as(t))


def _other_kind(kind: tuple, members: list, new_kind: tuple, grad: torch.Tensor) -> bool:
    """Whether `grad`, of `new_kind`, cannot join `members` (as in DataParallel._bucket) gathered under
    `kind`: one collective carries one kind, one dtype and one layout."""
    if not members:
        return False
    first = members[0][0].grad
    return kind != new_kind or first.dtype != grad.dtype or first.is_sparse != grad.is_sparse


WHAT_STRATEGY_IS = (f"'{AUTO}', {', '.join(repr(s) for s in STRATEGIES)}, a compressor spec such as "
                    f"'blocktopk:0.01', {{parameter name: strategy}}, a plan of `sparcoll plan` or the path of "
                    f"a JSON file of either")


class Loaded(NamedTuple):
    """A strategy argument read and checked: "auto", one strategy for all, or {name: strategy}; from a
    plan also {name: placement} of its compressed tensors, {name: unit} and {name: numel}."""
    strategy: Union[str, dict]
    placement: dict
    units: dict
    numels: dict
    workers: int | None = None      # a plan's: the job size it was made for
    unused: frozenset | None = None     # a plan's parameters left out as unused (None: not a plan, or an
    # older plan that did not list them): every other trainable parameter must be in the plan


def _load(strategy) -> Loaded:
    """The strategy argument, each strategy in it checked (ValueError naming the problem, TypeError
    for an argument of another type). A string is a strategy, else the name of a file of them: one
    ending .json (any case) always, another only where it names no strategy."""
    if isinstance(strategy, str) and not strategy.lower().endswith(".json"):
        try:
            return Loaded(_checked(strategy), {}, {}, {})
        except ValueError:
            if not Path(strategy).is_file():
                raise
    if isinstance(strategy, (str, Path)):
        strategy = _read(Path(strategy))
    if isinstance(strategy, Mapping) and isinstance(strategy.get("tensors"), list):     # a plan
        return _plan(strategy)
    if isinstance(strategy, Mapping):
        return Loaded({str(name): _checked(s, name) for name, s in strategy.items()}, {}, {}, {})
    if not isinstance(strategy, str):
        raise TypeError(f"strategy is {WHAT_STRATEGY_IS}; got {type(strategy).__name__}")
    return Loaded(_checked(strategy), {}, {}, {})       # a file holding one strategy


def _read(path: Path):
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the strategy file {path}: {exc}") from None
    if not isinstance(loaded, (Mapping, str)):
        raise ValueError(f"{path} holds a JSON {type(loaded).__name__}; expected {{parameter name: strategy}} "
                         f"or a plan of `sparcoll plan`")
    return loaded


def _plan(plan: Mapping) -> Loaded:
    tensors, workers, unused = plan["tensors"], plan.get("workers"), plan.get("unused")
    bad = next((t for t in tensors if not (isinstance(t, Mapping) and {"name", "strategy"} <= t.keys())), None)
    if bad is not None:
        raise ValueError(f"a tensor of the plan is {bad!r}; `sparcoll plan` writes each with its 'name' "
                         f"and 'strategy'")
    numbers = {f"{t['name']}'s numel": t["numel"] for t in tensors if "numel" in t}
    if workers is not None:
        numbers["workers"] = workers
    wrong = next((what for what, n in numbers.items() if not isinstance(n, int) or isinstance(n, bool)), None)
    if wrong is not None:       # (a hand-edited "2" read "made for 2 workers, this job has 2")
        raise ValueError(f"the plan's {wrong} is {numbers[wrong]!r}, not an integer")
    if unused is not None and not (isinstance(unused, list) and all(isinstance(n, str) for n in unused)):
        raise ValueError(f"the plan's unused is {unused!r}, not a list of parameter names")
    placement = {str(t["name"]): str(t.get("placement", CHANNEL)) for t in tensors}
    wrong = sorted(set(placement.values()) - {CHANNEL, THREAD, OFFLOAD})
    if wrong:
        raise ValueError(f"unknown placement {wrong[0]!r} in the plan; expected {THREAD} or {OFFLOAD}")
    return Loaded({str(t["name"]): _checked(t["strategy"], t["name"]) for t in tensors}, placement,
                  {str(t["name"]): t["unit"] for t in tensors if "unit" in t},
                  {str(t["name"]): t["numel"] for t in tensors if "numel" in t}, workers,
                  None if unused is None else frozenset(unused))


def _checked(strategy, name=None) -> str:
    """One strategy (of parameter `name`): a name among STRATEGIES or AUTO (any case), else a
    compressor spec."""
    of = f" for {name}" if name is not None else ""
    if not isinstance(strategy, str):
        raise ValueError(f"the strategy{of} is {strategy!r}, not {WHAT_STRATEGY_IS}")
    if strategy.strip().lower() in (*STRATEGIES, AUTO):
        return strategy.strip().lower()
    try:
        parse(strategy)
    except ValueError as exc:
        raise ValueError(f"unknown strategy {strategy!r}{of}: not {WHAT_STRATEGY_IS} ({exc})") from None
    return strategy


def check_strategy(strategy: str) -> None:
    """ValueError unless `strategy` is one, or a JSON file of them (which is then read)."""
    _load(strategy)


def check_names(module: nn.Module, loaded: Loaded) -> None:
    """ValueError if the strategy names a parameter the module does not have, or a plan gives one
    another size, or leaves out a trainable one it did not find unused: a plan made for another model
    would otherwise leave every tensor on "auto", and one made before a layer was added that layer
    (a review: an empty plan ran as "planned")."""
    if not isinstance(loaded.strategy, dict):
        return
    sizes = {name: p.numel() for name, p in module.named_parameters()}
    unknown = sorted(set(loaded.strategy) - sizes.keys())
    if unknown:
        raise ValueError(f"the strategy names {len(unknown)} parameter(s) the model does not have: "
                         f"{_some(unknown)} (the model's: {_some(list(sizes))}); a plan made for another model?")
    resized = [name for name, numel in loaded.numels.items() if sizes[name] != numel]
    if resized:
        name = resized[0]
        raise ValueError(f"the plan gives {name} {loaded.numels[name]} elements, the model {sizes[name]}: "
                         f"a plan made for another model or workload options?")
    if loaded.unused is not None:
        left = [name for name, p in module.named_parameters()
                if p.requires_grad and name not in loaded.strategy and name not in loaded.unused]
        if left:
            raise ValueError(f"the plan has no strategy for {len(left)} trainable parameter(s) of the model: "
                             f"{_some(left)}; a plan made for another model, or before these were added "
                             f"or unfrozen? plan again")


def _some(names: list) -> str:
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
