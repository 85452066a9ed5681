"""The "sparcoll" torch.distributed backend: a process group whose dense SUM/AVG all_reduce runs on
sparcoll, so `DistributedDataParallel` uses sparcoll unchanged.

    import sparcoll.torch
    dist.init_process_group("sparcoll")       # or dist.new_group(backend="sparcoll")

Every other collective, and what sparcoll cannot reduce (other ops, dtypes or devices, several tensors
at once), is delegated to an inner gloo group built on the same store, so nothing is unimplemented;
that group is also the group's registered CPU backend, which torch's C++ calls directly (functional
collectives, DTensor, the coalescing manager). "sparcoll" must be the whole backend string: torch
keeps a Python process group as it is, so "cuda:nccl,cpu:sparcoll" would drop nccl.
One exception is torch's: `dist.monitored_barrier` refuses every backend not named "gloo" before it
reaches the group; `sparcoll.torch.monitored_barrier` runs the inner gloo group's instead.
Sparse COO all_reduce of those dtypes runs on sparcoll too (`sparse.allreduce_coo`: block-sparse, never
densified). The communicator takes its options from the environment (SPARCOLL_BLOCK_SIZE,
SPARCOLL_AGGREGATORS, SPARCOLL_HOST, SPARCOLL_STREAMS, SPARCOLL_MESSAGE_BLOCKS, SPARCOLL_CREDITS) and
the group's timeout.

Errors: a failed sparcoll collective raises its own exception (e.g. MismatchError) from `wait()`, and
fails the work's future as a real error, so DDP's backward raises a RuntimeError instead of crashing.
The sparcoll and gloo parts each keep their own order; as with any backend, a tensor must not be passed
to another collective before the work that writes it has completed. After a sparcoll failure the
communicator is poisoned: later sparcoll collectives of the group fail too (recreate the group); where
the failure left the gloo part out of step (a rank's all_reduce went to gloo, its peer's to sparcoll),
the group's gloo collectives fail at once too (PoisonedError on that rank, gloo's closed connection on
its peers), not after the group's timeout.
"""
from __future__ import annotations

import time
import zlib
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from sparcoll.blocks import may_overlap
from sparcoll.communicator import Communicator
from sparcoll.errors import CollectiveTimeout, MismatchError, PoisonedError
from sparcoll.wire import BARRIER_TAG, DELEGATED_TAG, DTYPE_CODES, OPS as SPARCOLL_OPS

from . import sparse
from .futures import Completion, when_done

NAME = "sparcoll"
# The torch reduce ops sparcoll runs, to sparcoll's op names: torch names them alike (SUM: "sum").
OPS = {getattr(dist.ReduceOp.RedOpType, name.upper()): name for name in SPARCOLL_OPS}
WAIT_SLICE_S = 0.05             # how often a waiting SparcollWork looks whether a part failed

# Our method -> the gloo method it forwards to (gloo names some tensor-in/tensor-out forms differently).
DELEGATED = {
    "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "_allgather_base", "_allgather_base": "_allgather_base",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base", "_reduce_scatter_base": "_reduce_scatter_base",
    "alltoall": "alltoall", "all_to_all_single": "alltoall_base", "alltoall_base": "alltoall_base",
    "allreduce_coalesced": "allreduce_coalesced",
    "send": "send", "recv": "recv", "recv_anysource": "recv_anysource",
}


def _seconds(timeout: timedelta | None) -> float | None:
    """A torch timeout in seconds; None when unset (torch uses -1 ms or 0 for "none given")."""
    if timeout is None or timeout <= timedelta(0):
        return None
    return timeout.total_seconds()


class SparcollWork(dist.Work):
    """Handle of a collective that sparcoll (at least partly) runs, backed by a Completion."""

    def __init__(self, completion: Completion):
        super().__init__()
        self._completion = completion

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done (without a timeout: until the deadline of the sparcoll collectives it
        waits for); raise the collective's own error (not wrapped) as soon as one part failed: a
        barrier whose sparcoll part failed raises at once, while its gloo part waits for peers that
        may never come."""
        seconds = _seconds(timeout)
        at_deadline = seconds is None and self._completion.deadline is not None
        if at_deadline:
            seconds = max(0.0, self._completion.deadline - time.monotonic())
        end = None if seconds is None else time.monotonic() + seconds
        while self._completion.error is None and not self._completion.done.wait(WAIT_SLICE_S):
            if end is not None and time.monotonic() >= end:
                error = CollectiveTimeout(f"collective not finished after {seconds:g} s")
                if at_deadline:     # as sparcoll's own wait: the collective must not run after this error
                    self._completion.give_up(error)
                raise error
        if self._completion.error is not None:
            raise self._completion.error
        return True

    def is_completed(self) -> bool:
        return self._completion.done.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._completion.error is None

    def exception(self) -> BaseException | None:
        return self._completion.error

    def get_future(self) -> torch.futures.Future:
        return self._completion.future

    def result(self) -> list[torch.Tensor]:
        """The tensors the collective wrote (once complete)."""
        return self._completion.value


def _delegate(gloo_name: str):
    def method(self, *args):
        self._gloo_in_step()
        return getattr(self.gloo, gloo_name)(*args)
    method.__name__ = gloo_name
    method.__doc__ = f"Delegated to the inner gloo group's {gloo_name}."
    return method


def _allreduce_arguments(tensors, opts) -> tuple[list[torch.Tensor], dist.AllreduceOptions]:
    """A list of tensors and AllreduceOptions from any of the forms torch's ProcessGroup.allreduce
    takes: options, a ReduceOp or nothing, for a list of tensors or one tensor."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if isinstance(opts, dist.AllreduceOptions):
        return tensors, opts
    options = dist.AllreduceOptions()
    if opts is not None:
        options.reduceOp = opts
    return tensors, options


class ProcessGroupSparcoll(dist.ProcessGroup):
    """A process group whose dense SUM/AVG all_reduce is a sparcoll allreduce."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout: timedelta):
        super().__init__(rank, world)
        self._group_name = self._group_desc = ""
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world, timeout)
        self._gloo_left: MismatchError | None = None    # why the gloo part is out of step (_out_of_step)
        self.comm = Communicator(dist.PrefixStore("sparcoll", store), rank, world,
                                 timeout=timeout.total_seconds())
        # Collectives that torch's C++ calls on the group's backend for a device, not through these
        # methods (functional collectives, DTensor, the coalescing manager), go to the gloo group.
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)

    def getBackendName(self) -> str:
        return NAME

    # The C++ base keeps name and description in its backends, and a Python group has none.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def _accelerated(self, tensors: list[torch.Tensor], op) -> bool:
        """One CPU tensor, dense or sparse COO, of a dtype and under an op that sparcoll reduces, and of
        no more blocks than its indices number (a COO tensor of 2^40 rows goes to gloo); not a dense
        one whose elements share memory (expand()), which the Communicator refuses and gloo reduces."""
        t = tensors[0] if len(tensors) == 1 else None
        return (t is not None and op in OPS and t.layout in (torch.strided, torch.sparse_coo)
                and t.device.type == "cpu" and t.dtype in DTYPE_CODES and self.comm.too_many_blocks(t) is None
                and not (t.layout == torch.strided and may_overlap(t)))

    def allreduce(self, tensors: list[torch.Tensor] | torch.Tensor, opts=None) -> dist.Work:
        """Dense float SUM/AVG on sparcoll, a sparse COO one via sparse.allreduce_coo, the rest on
        gloo. As torch's groups, it takes (tensors, options), (tensors, op) or (tensor, op), the last
        optional: DDP's join hook calls `allreduce(tensor)` (under find_unused_parameters)."""
        tensors, opts = _allreduce_arguments(tensors, opts)
        op = opts.reduceOp.op
        if not self._accelerated(tensors, op):
            return self._delegated_allreduce(tensors, opts)
        return SparcollWork(Completion.start(tensors, lambda: self._issue(
            tensors[0], OPS[op], _seconds(opts.timeout), at_once=not opts.asyncOp)))

    def _issue(self, tensor: torch.Tensor, op: str, timeout: float | None, tag: int = 0,
               at_once: bool = False) -> list:
        """Start a sparcoll allreduce (a COO one via sparse.allreduce_coo): the Work to wait for, or
        none where it ran at once: as it must when issued from a future's callback (torch's PowerSGD
        hook waits for an all_reduce there: that thread is the one that would serve it), and
        `at_once` (torch's blocking `dist.all_reduce`, whose options say it waits at once): a
        blocking call runs on the caller's thread, where handing it to the engine thread and back
        made a 1-float all_reduce over 2 ranks 1.65x gloo's."""
        coo = tensor.layout == torch.sparse_coo
        if at_once or self.comm.on_callback_thread():
            if coo:
                sparse.copy_into(tensor, self.comm.allreduce_coo(tensor, op=op))
            else:
                self.comm.allreduce(tensor, op=op, timeout=timeout, tag=tag)
            return []
        if coo:
            return [sparse.allreduce_coo(tensor, op, self.comm)]
        return [self.comm.allreduce(tensor, op=op, async_op=True, timeout=timeout, tag=tag)]

    def _delegated_allreduce(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        """gloo's all_reduce, checked by a small sparcoll allreduce of a tag of its own: a peer whose
        call went to sparcoll (a float tensor where this rank's is int64, say) then gets MismatchError
        at once on both ranks, where each would wait in its own library for the group's timeout (30
        minutes by default). The small allreduce sums each rank's fingerprint of the call (op, dtype,
        size, async or not), so ranks that all delegate but disagree (MIN against MAX, which gloo mixes
        silently) get MismatchError too. A blocking call (torch's options say when the caller waits at
        once) checks first and starts gloo's call only where every rank's is the same: gloo ends the
        process whose call's size differs (int64 of 3 against 5 elements, a review), and the group's
        gloo part stays in step. An async call checks beside gloo's call, so as not to wait for the
        peers before it returns; where the check fails, its gloo part is out of step (_out_of_step).
        A non-contiguous dense tensor goes to gloo as a contiguous copy, written back when gloo is
        done: gloo itself reduces the first elements of the view's storage instead, silently (torch
        2.13; a review). One whose elements share memory (expand()) goes as it is, as gloo takes it:
        no copy can be written back."""
        op = opts.reduceOp.op

        def gloo_part() -> dist.Work | torch.futures.Future:
            staged = [t.contiguous() if t.layout == torch.strided and not may_overlap(t) else t for t in tensors]
            work = self.gloo.allreduce(staged, opts)
            return _written_back(work, staged, tensors) if any(s is not t for s, t in zip(staged, tensors)) else work

        def issue() -> list:
            self._gloo_in_step()
            h, world = _call_number(op, tensors, opts.asyncOp), self.size()
            sums = torch.tensor([h, h * h], dtype=torch.float64)
            if not opts.asyncOp:
                self._issue(sums, "sum", _seconds(opts.timeout), DELEGATED_TAG, at_once=True)
                if sums.tolist() != [world * h, world * h * h]:
                    raise _mismatched_call(op, tensors)
                return [gloo_part()]
            started = gloo_part()
            checking = self._beside_gloo(lambda: self._issue(sums, "sum", _seconds(opts.timeout), DELEGATED_TAG))
            verdict = torch.futures.Future()

            def judge(error: BaseException | None) -> None:
                if error is None and sums.tolist() != [world * h, world * h * h]:
                    error = _mismatched_call(op, tensors)
                    self._out_of_step(error)    # a peer's call may not have started its gloo part
                if error is None:
                    verdict.set_result(None)
                else:
                    verdict.set_exception(error)
            if checking:
                when_done(checking[0], judge)
            else:
                judge(None)
            return checking + [verdict, started]
        return SparcollWork(Completion.start(tensors, issue))

    def barrier(self, opts=None) -> dist.Work:
        """Done when every rank has issued all earlier collectives of both parts: a one-element
        sparcoll allreduce queues behind this rank's earlier sparcoll work, gloo's barrier behind
        gloo's. The allreduce's tag of its own makes a peer's all_reduce of one element, which
        all_reduce never tags, fail with MismatchError instead of pairing with it. The gloo part is
        issued first, whatever the sparcoll part does: a rank whose communicator is already failed
        still keeps the gloo group in step with its peers."""
        opts = dist.BarrierOptions() if opts is None else opts

        def issue() -> list:
            self._gloo_in_step()
            gloo_part = self.gloo.barrier(opts)
            return self._beside_gloo(lambda: self._issue(torch.ones(1), "sum", _seconds(opts.timeout),
                                                         BARRIER_TAG)) + [gloo_part]
        return SparcollWork(Completion.start([], issue))

    def _beside_gloo(self, issue_check: Callable[[], list]) -> list:
        """The sparcoll round issued beside a gloo part (issue_check's Works; none where it ran at once,
        from a callback), watched: if it fails with MismatchError, a peer called something else (a
        float all_reduce that went to sparcoll where this rank's int64 one went to gloo), and this
        rank's gloo part waits for a partner that never comes: gloo would pair it with the group's
        next gloo collective, or wait for the group's timeout (30 minutes by default; a review). Later
        calls that reach gloo then raise at once, and the inner gloo group is aborted, so that a
        peer's next gloo collective fails at once too."""
        try:
            checking = issue_check()
        except MismatchError as exc:
            self._out_of_step(exc)
            raise
        for work in checking:
            when_done(work, self._out_of_step)
        return checking

    def _out_of_step(self, error: BaseException | None) -> None:
        if isinstance(error, MismatchError) and self._gloo_left is None:
            self._gloo_left = error
            try:
                self.gloo.abort()
            except Exception:   # best effort: this rank's own calls raise anyway
                pass

    def _gloo_in_step(self) -> None:
        if self._gloo_left is not None:
            raise PoisonedError(f"this group's gloo part is out of step since a collective beside it failed "
                                f"({self._gloo_left}); create a new group")

    def shutdown(self) -> None:
        self.comm.close()
        self.gloo.shutdown()

    abort = shutdown


for _name, _target in DELEGATED.items():
    setattr(ProcessGroupSparcoll, _name, _delegate(_target))


def _written_back(work: dist.Work, staged: list[torch.Tensor], tensors: list[torch.Tensor]) -> torch.futures.Future:
    """gloo's `work` on `staged`, then each copy among them written into the tensor it stands for, as
    gloo writes (a Parameter's or an inference tensor's view too); gloo's error fails it too."""
    def write_back(done: torch.futures.Future) -> None:
        done.value()
        for copy, t in zip(staged, tensors):
            if copy is not t:
                with torch.inference_mode() if t.is_inference() else torch.no_grad():
                    t.copy_(copy)
    return work.get_future().then(write_back)


def _call_number(op, tensors: list[torch.Tensor], async_op: bool) -> float:
    """A number h in [1, 2^20] that names a call's op, dtypes, layouts and sizes, and whether it is
    async (which decides whether its gloo part starts before its check). Summed over the ranks, h and
    h^2 add up to world * h and world * h^2 exactly (float64, up to 8,192 ranks) only if every rank's
    h is this one."""
    described = repr((str(op), [(str(t.dtype), str(t.layout), t.numel()) for t in tensors], async_op))
    return float(zlib.crc32(described.encode()) % (1 << 20) + 1)


def _mismatched_call(op, tensors: list[torch.Tensor]) -> MismatchError:
    sizes = ", ".join(f"{t.numel()} elements of {t.dtype}" for t in tensors)
    return MismatchError(f"ranks called all_reduce with different arguments (op, dtype, size or async_op) on a "
                         f"sparcoll group; this rank's: {str(op).split('.')[-1]} of {sizes}")


def monitored_barrier(group=None, timeout: timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """`torch.distributed.monitored_barrier` for a group on any backend: on a "sparcoll" group it
    runs the inner gloo group's (torch's own function refuses backends not named "gloo")."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    inner = _backend_of(pg)
    if inner is None:
        return dist.monitored_barrier(group, timeout, wait_all_ranks)
    if timeout is None:
        timeout = dist.default_pg_timeout
    return inner.gloo.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def stats(group=None):
    """The traffic and collective counts (sparcoll.Stats) of a "sparcoll" group (default: the whole job):
    how a training script checks that its gradients really go through sparcoll, and how many bytes."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    inner = _backend_of(pg)
    if inner is None:
        raise ValueError(f"the group uses the {dist.get_backend(pg)!r} backend, not {NAME!r}: "
                         f"init_process_group({NAME!r}) after importing sparcoll.torch")
    return inner.comm.stats


def _backend_of(pg) -> ProcessGroupSparcoll | None:
    """The sparcoll group behind a torch ProcessGroup, if that is what it wraps (dist.new_group hands
    out a "sparcoll" group itself, unwrapped)."""
    if isinstance(pg, ProcessGroupSparcoll):
        return pg
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except Exception:   # torch raises when the group has no backend for cpu
        return None
    return backend if isinstance(backend, ProcessGroupSparcoll) else None


def register() -> None:
    """Make "sparcoll" a torch.distributed backend (idempotent)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, ProcessGroupSparcoll, devices=["cpu"])
