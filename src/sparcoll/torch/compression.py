"""DDP communication hook that compresses gradients with sparcoll.compress, parameter by parameter.

    state = sparcoll.torch.CompressionState(sparcoll.init(), "powersgd:4")   # or a gloo group
    ddp.register_comm_hook(state, sparcoll.torch.compression_hook)

Each bucket is cut back into its parameters' gradients, and each gets its parameter's spec: the state's
spec, except 1-D parameters (biases, norms), which go uncompressed unless compress_1d=True (in float32
when they share a bucket with compressed ones: a float64 bias comes back rounded then), and whatever
`per_param` says (a {parameter: spec} mapping, or a function of the parameter returning a spec or None
for the default). A bucket's gradients under one spec share one collective (two for PowerSGD, one where
all of them go whole, and for variable-size gathers: Reducer.reduce_many), each with its own error
feedback and warm start (keyed by the parameter, so DDP's rebuilt buckets after the first step keep
them). Any bucket layout works: every rank runs the same collectives in the same order, on one thread
and a process group of its own per state, while backward goes on (overlap=False: in the hook, before it
returns).

Gradients are averaged, as DDP's. Under `no_sync` DDP calls no hook and gradients accumulate; the
next synchronized step compresses the accumulated gradients, so accumulation works unchanged.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations against the real types.
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Union

import torch
import torch.distributed as dist

from sparcoll.communicator import Communicator
from sparcoll.compress import Reducer, Spec, parse
from sparcoll.compress.channel import destroy_group
from sparcoll.errors import MismatchError

from .backend import _backend_of

_NONE = parse("none")


def _own_group(group) -> dist.ProcessGroup:
    """A new group of `group`'s ranks, backend and timeout (default: the whole job's) for the state's
    thread alone. On DDP's group, DDP's own collectives (find_unused_parameters' allreduce of the used
    parameters, issued as the last bucket is handed over) would run while the thread reduces buckets,
    in an order that differs from rank to rank: gloo aborts or pairs the wrong calls."""
    pg = group or dist.distributed_c10d._get_default_group()
    sparcoll_pg = _backend_of(pg)
    gloo = sparcoll_pg.gloo if sparcoll_pg is not None else pg._get_backend(torch.device("cpu"))
    return dist.new_group(dist.get_process_group_ranks(pg), timeout=gloo.options._timeout,
                          backend=dist.get_backend(pg))


def _release(worker: ThreadPoolExecutor | None, group) -> None:
    """End a CompressionState's thread (not waiting: a collected state's finalizer may run on it) and
    destroy the group made for it (once: a weakref.finalize)."""
    if worker is not None:
        worker.shutdown(wait=False)
    destroy_group(group)


class CompressionState:
    """What the hook needs: where to communicate, which spec each parameter gets, and the
    compressors' state (error feedback, warm starts, seeds) across steps.

    comm_or_group: a sparcoll Communicator (blocktopk's sparse AllReduce, and sparse gradients
    under none/fp16/bf16; every other collective on `group`, default the whole job), a torch
    ProcessGroup (gloo, or "sparcoll", whose communicator then serves those), or None (the default
    group). spec: the default spec. per_param: {parameter: spec}, or a function of the parameter
    returning a spec or None (the default). compress_1d: compress 1-D parameters too (off: they go
    uncompressed). overlap: reduce on a thread while backward goes on. whole_bucket: compress a
    bucket's gradients under one spec as one tensor (top-k across layers rather than per layer;
    PowerSGD stays per matrix), with error feedback kept per bucket layout (DDP rebuilds its buckets
    once, after the first step, which drops that step's residual). `sent_bytes`: the payload bytes
    this rank contributed so far.

    With overlap on more than one rank, the thread's collectives go on a group of their own, made
    here by dist.new_group: build the state on every rank of the job, in the same order as the
    job's other groups. `close()` ends the thread and destroys that group; a state dropped without
    it (with its DDP) does so when it is collected (a state made per experiment kept both, 5
    descriptors and 3 threads each, until the process ended)."""

    def __init__(self, comm_or_group=None, spec: Union[str, Spec] = "none", *,
                 per_param: Union[Mapping, Callable, None] = None, compress_1d: bool = False,
                 group=None, overlap: bool = True, whole_bucket: bool = False):
        comm = comm_or_group if isinstance(comm_or_group, Communicator) else None
        if comm is None and comm_or_group is not None:
            group = comm_or_group
        self._own = overlap and dist.is_initialized() and dist.get_world_size(group) > 1
        if self._own:
            group = _own_group(group)
        if comm is None and dist.is_initialized():
            backend = _backend_of(group or dist.distributed_c10d._get_default_group())
            comm = backend.comm if backend is not None else None
        self.comm, self.group = comm, group
        self.spec = parse(spec)
        self.compress_1d = compress_1d
        if isinstance(per_param, Mapping):
            self._overrides = {id(p): parse(s) for p, s in per_param.items()}
            self._rule = None
        else:
            self._overrides, self._rule = {}, per_param
        self._reducers: dict = {}
        self._layouts: dict = {}    # bucket index -> its parameters' shapes and specs, as every rank has them
        self.whole_bucket = whole_bucket
        # One thread, so buckets are reduced one after another in the order DDP hands them over,
        # the same on every rank.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="sparcoll-compress") if overlap else None
        self._finalizer = weakref.finalize(self, _release, self._worker, group if self._own else None)
        self._finalizer.atexit = False
        self.closed = False
        self.failed: BaseException | None = None    # the first bucket that failed: no later one runs

    def close(self) -> None:
        """Wait for the bucket in hand, end the thread and destroy the group made for it; the hook
        refuses this state afterwards. Call it on every rank, after the last step; twice is harmless."""
        if self.closed:
            return
        self.closed = True
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._finalizer()

    def spec_for(self, param: torch.Tensor) -> Spec:
        if id(param) in self._overrides:
            return self._overrides[id(param)]
        chosen = self._rule(param) if self._rule is not None else None
        if chosen is not None:
            return parse(chosen)
        return self.spec if param.dim() > 1 or self.compress_1d else _NONE

    def reducer(self, spec: Spec) -> Reducer:
        key = str(spec)
        if key not in self._reducers:
            # DDP checks its parameters' shapes across ranks, and its buckets follow them
            self._reducers[key] = Reducer(spec, self.group, self.comm, check_sizes=False)
        return self._reducers[key]

    @property
    def sent_bytes(self) -> int:
        """Payload bytes this rank contributed so far (see sparcoll.compress.Reducer.sent_bytes)."""
        return sum(r.sent_bytes for r in self._reducers.values())

    def agree_layout(self, index: int, params: list) -> None:
        """Once per layout of bucket `index` (DDP's first step, and its rebuilt buckets after): every
        rank gives the bucket's parameters the same specs, or MismatchError names where they differ,
        on every rank. Ranks whose compress_1d, per_param or whole_bucket differ ran collectives of
        different sizes, which gloo answers by aborting a process. DDP lays buckets out alike on
        every rank, so the ranks check the same buckets at the same steps."""
        layout = (self.whole_bucket, [(tuple(p.shape), str(self.spec_for(p))) for p in params])
        channel = self.reducer(_NONE).channel
        if self._layouts.get(index) == layout or channel.world == 1:
            return
        every = channel.allgather_object(layout)
        if any(theirs != layout for theirs in every):
            raise MismatchError(f"ranks compress bucket {index} differently: " + _differences(every))
        self._layouts[index] = layout

    def reduce_bucket(self, buffer: torch.Tensor, params: list) -> torch.Tensor:
        """Average a bucket's gradients (`buffer`, holding `params`' gradients one after another)
        over ranks; the result (the buffer, or a new sparse tensor for a sparse gradient)."""
        if buffer.is_sparse:
            result = self.reducer(self.spec_for(params[0])).reduce(buffer, key=params[0])
            return result if result.is_sparse else result.to_sparse(buffer.sparse_dim())
        groups, offset = {}, 0
        for param in params:
            view = buffer[offset:offset + param.numel()]
            offset += param.numel()
            groups.setdefault(self.reducer(self.spec_for(param)), []).append((param, view))
        # Uncompressed gradients (biases, norms) ride in a compressed group's collective where it
        # can carry them (blocktopk's sparse AllReduce): one collective per bucket, not two.
        carrier = next((r for r in groups if r.compressor.carries_exact), None)
        riders = groups.pop(self.reducer(_NONE), []) if carrier is not None else []
        for reducer, members in groups.items():
            if reducer.spec == _NONE and len(members) == len(params):
                # the whole bucket uncompressed: in place, bit for bit what DDP computes
                reducer.agree()
                reducer.channel.allreduce_mean(buffer)
                reducer.sent_bytes += buffer.numel() * buffer.element_size()
                continue
            extra = riders if reducer is carrier else []
            exact = [view for _, view in extra]
            if self.whole_bucket and reducer.compressor.scheme != "powersgd":
                views = [view for _, view in members]
                outs = reducer.reduce_many([torch.cat(views)], [tuple(id(p) for p, _ in members)],
                                           exact)
                results = list(outs[0].split([view.numel() for view in views])) + outs[1:]
            else:
                # the averages land in the bucket itself (float32 buckets: a view is a target)
                into = [view for _, view in members + extra] if buffer.dtype == torch.float32 else None
                results = reducer.reduce_many([view.view(_laid_out(param)) for param, view in members],
                                              [param for param, _ in members], exact, into)
            for (_, view), result in zip(members + extra, results):
                if result.data_ptr() != view.data_ptr():
                    view.copy_(result.reshape(-1))
        return buffer


def _laid_out(param: torch.Tensor) -> tuple:
    """The shape of `param`'s gradient as DDP lays it out in a bucket: in the parameter's memory
    order (its dimensions by stride, largest first) where that memory is dense, else its own shape
    (DDP's layout then). A matrix compressor (PowerSGD) sees the gradient or a permutation of its
    dimensions, of the same rank; a transposed weight's viewed in its own shape was its elements
    reshaped (a rank-1 gradient came back 64% off at rank 1)."""
    if param.is_contiguous():
        return tuple(param.shape)
    # (a dimension of size 1, whose stride says nothing, after the others of its stride)
    order = sorted(range(param.dim()), key=lambda d: (-param.stride(d), param.shape[d] == 1))
    expected = 1
    for d in reversed(order):
        if param.shape[d] != 1 and param.stride(d) != expected:
            return tuple(param.shape)      # overlapping or with gaps: DDP lays it out contiguous
        expected *= param.shape[d]
    return tuple(param.shape[d] for d in order)


def _differences(layouts: list) -> str:
    """Where the ranks' layouts of one bucket (CompressionState.agree_layout) differ, in words."""
    wholes = {whole for whole, _ in layouts}
    if len(wholes) > 1:
        return ", ".join(f"rank {r} whole_bucket={whole}" for r, (whole, _) in enumerate(layouts))
    lines = [f"parameter {i} of shape {entries[0][0]}: " +
             ", ".join(f"rank {r} {spec}" for r, (_, spec) in enumerate(entries))
             for i, entries in enumerate(zip(*(params for _, params in layouts)))
             if len({entry for entry in entries}) > 1]
    return "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else "")


def compression_hook(state: CompressionState,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress and average `bucket`'s gradients (see CompressionState). With `overlap` (the
    default) the bucket is reduced on the state's thread, on the state's own group, while backward
    and DDP's own collectives go on. A failure fails the future, and DDP's backward raises it; every
    later bucket of the state then fails at once."""
    if state.closed:
        raise RuntimeError("compression_hook: its CompressionState was closed; make a new one")
    buffer, params = bucket.buffer(), bucket.parameters()
    done = torch.futures.Future()

    def run() -> None:
        try:
            if state.failed is not None:
                raise RuntimeError(f"compression_hook: a bucket failed before on this rank ({state.failed}), so "
                                   f"its collectives no longer pair with the other ranks'; make a new "
                                   f"CompressionState (on every rank) to go on")
            state.agree_layout(bucket.index(), params)
            done.set_result(state.reduce_bucket(buffer, params))
        except BaseException as exc:    # any: DDP's backward waits on `done` without a deadline
            # Where one rank failed alone, its next bucket's collectives would pair with the
            # others' current ones: silently, where their sizes agree. None runs after a failure;
            # the others' wait for this rank ends at their group's timeout.
            state.failed = state.failed or exc
            done.set_exception(exc)
    if state._worker is None:
        run()
    else:
        state._worker.submit(run)
    # A future failed by set_exception reads as a value from C++ (see .futures); an exception
    # raised in a `then` callback fails the chained future for DDP too.
    return done.then(lambda finished: finished.value())
