"""gloo's ring allreduce for the collectives the chooser (algorithm.py) sends its way, made safe.

gloo aborts the whole process when ranks pass buffers of different sizes to one collective
("Received data size doesn't match expected size"), and sums garbage when the dtypes differ but the
byte counts agree. So every ring collective comes with a check: an allgather, on a gloo group of its
own, of a float64 buffer whose length never depends on the call: TINY_NUMEL slots for data, then the
call (id, numel, dtype, op, gathered or not), the call this rank expects next, and _SHARED numbers.
Every rank then holds every rank's buffer: it compares the calls itself (and names the ranks whose
call differs), so every rank sees a disagreement and raises MismatchError; none aborts. The shared
numbers are the ranks' averages of what each put there (the chooser's times, algorithm.py), the same
on every rank. An allgather rather than an allreduce: gloo's ring allgather takes world - 1 steps,
its ring allreduce 2 (world - 1), and on 2 cores each step waits for a process to be scheduled (2
ranks on loopback, one-off script: this buffer gathered in 274-286 us median, 450-751 p90, where
gloo's allreduce of 8 floats took 345, p90 3093). From _ROOTED ranks on, two steps whatever the
world: the buffers gathered at rank 0, which sums the data slots and broadcasts the sums and every
rank's fields (4 ranks: 669 us median against the allgather's 2994 and gloo's allreduce of 8 floats
4459).
  - A tiny tensor (at most TINY_NUMEL elements) travels in that buffer: one round, summed in float64
    in rank order (the same sum on every rank) and rounded once, as the sparse path's float32
    accumulation would.
  - A larger one is summed by an allreduce of the tensor itself, in its own dtype, on a second gloo
    group; or, on the chooser's gather path (algorithm.py), gathered there and summed by every rank
    in rank order (the call's fields say which: ranks never pair an allreduce with an allgather).
    It waits for its check only when its size is not known to agree: each check also carries the
    call this rank expects next on the ring (the one that followed this call's kind last time),
    compared the same way. When every rank expected the same next call:
      - an allreduce: if it comes, its data and its check start together, and a check round (one
        round trip through every process: 6-15 ms with 4 processes on 2 cores) no longer delays
        the data. A rank whose call differs waits for its check first, so it never joins that
        data allreduce; the check round, which every rank joins, then tells every rank, and those
        whose data had not started give the others' a zero partner of its size (gloo cannot
        cancel an allreduce).
      - a gathered call: there is no check round. Every rank joins that call's allgather, on the
        data group, with its own call's fields in front of its data (zeros when its call is
        another one): the sizes agree whatever the calls, and the one round both checks and
        carries the data. From _ROOTED ranks on it is a gather at rank 0, which sums the data,
        and a broadcast of every rank's fields and the sum, as for the check round.
A ring collective waits for gloo or for a peer's report of the same collective (a peer that refused
its input tells the aggregators; see WorkerJob.abort), whichever comes first, at most `timeout`.
"""
from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions    # not re-exported by dist

from . import wire
from .algorithm import TINY_NUMEL
from .errors import REPORT_GRACE, CollectiveTimeout, MismatchError, PeerError

_FIELDS = 5                 # a call: id, numel, dtype, op, and 1 if its data is gathered
_SHARED = 3                 # numbers averaged over the ranks in the check round
_CALL = slice(0, _FIELDS)                   # in a rank's fields: this call,
_NEXT = slice(_FIELDS, 2 * _FIELDS)         # the call it expects next,
_SHARE = slice(2 * _FIELDS, 2 * _FIELDS + _SHARED)     # and the numbers to average
_HEAD = _SHARE.stop         # float64 fields in front of a gathered call's data
_ROOTED = 3                 # from this many ranks the check round goes through rank 0
_POLL = 0.05                # seconds between looks for a peer's report while gloo runs

Call = tuple[int, int, int, int, int]   # (id, numel, dtype code, op, gathered)


def _describe(call: list[float]) -> str:
    """A call's fields as a rank put them in its check buffer, in words."""
    cid, numel, dtype, op, gathered = (int(f) for f in call)
    dtype_name = wire.DTYPES[dtype][0] if dtype in wire.DTYPES else f"dtype code {dtype}"
    op_name = wire.Op(op).name.lower() if op in wire.Op._value2member_map_ else f"op code {op}"
    return f"allreduce {cid}: {numel} elements of {dtype_name}, op {op_name}" + \
        (", gathered" if gathered else "")


def _total_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gathered data is summed in: halves add in float32."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def _timed(options, timeout: float, **fields):
    """gloo's options of one collective (`options`, e.g. dist.GatherOptions()) with `timeout`
    seconds and `fields` set."""
    options.timeout = timedelta(seconds=timeout)
    for name, value in fields.items():
        setattr(options, name, value)
    return options


class Ring:
    """Two gloo groups of its own (never shared with the caller's collectives, so their order is
    ours): one for the checks, one for the tensors."""

    def __init__(self, store, rank: int, world: int, timeout: float, host: str):
        self.rank, self.world = rank, world
        self.check_group = self._group(dist.PrefixStore("check", store), timeout, host)
        self.data_group = self._group(dist.PrefixStore("data", store), timeout, host)
        self._check = torch.zeros(TINY_NUMEL + _HEAD, dtype=torch.float64)   # data, then fields
        gathered = torch.zeros(world, TINY_NUMEL + _HEAD, dtype=torch.float64)  # every rank's
        self._gathered_rows = list(gathered.unbind(0))      # where gloo writes each rank's
        self._check_np, self._gathered_np = self._check.numpy(), gathered.numpy()
        self._verdict = torch.zeros(TINY_NUMEL + world * _HEAD, dtype=torch.float64)
        self._verdict_np = self._verdict.numpy()    # the sums, then every rank's fields
        self._expected: Call | None = None  # the next call every rank expected, if they agreed
        self._previous: tuple | None = None     # (id, kind) of the last call
        self._after: dict[tuple, tuple] = {}    # kind -> (kind, id distance) of the call after it
        self.collectives = 0
        self.bytes = 0              # bytes of tensors handed to gloo (each crosses the ring twice)
        self.checked_first = 0      # larger calls whose data waited for their check
        self.gathered = 0           # larger calls whose data was gathered

    def _group(self, store, timeout: float, host: str):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, self.rank, self.world, options)

    def allreduce(self, cid: int, tensor: torch.Tensor, op: int, timeout: float, peer_report,
                  share: list[float] | None = None, gather: bool = False) -> list[float] | None:
        """Sum (or average) `tensor` in place over all ranks; returns the ranks' averages of the
        _SHARED numbers in `share` (None if none given: then every rank must give none).
        `gather`: a larger tensor's data is gathered and summed here, not allreduced.
        `peer_report()` returns a peer's error for this collective, if one arrived."""
        data = tensor.detach()
        tiny = data.numel() <= TINY_NUMEL
        gather = gather and not tiny
        call = (cid, data.numel(), wire.DTYPE_CODES[data.dtype], op, int(gather))
        total = data if tiny or data.is_contiguous() else data.contiguous()
        deadline = time.monotonic() + timeout
        expected_next = self._next(call)
        fields = np.array((*call, *(expected_next or (0,) * _FIELDS), *(share or (0.0,) * _SHARED)),
                          dtype=np.float64)     # ids start at 1: zeros are no call expected
        expected, self._expected = self._expected, None
        started = summed = None
        if expected is not None and expected[4]:
            fields_of, summed = self._gather_with_check(total if call == expected else None,
                                                        expected, fields, timeout, deadline,
                                                        peer_report)
        else:
            fields_of, sums, started = self._check_round(total, call, expected, fields, timeout,
                                                         deadline, peer_report)
        agree = (fields_of[:, _CALL] == fields[_CALL]).all(axis=1)
        if not agree.all():
            if summed is None and started is None and expected is not None \
                    and expected[1] > TINY_NUMEL:
                # peers whose call was the expected one (an allreduce) have started its data: a
                # partner of its size lets it end (gloo cannot cancel it; its groups would wait
                # at close)
                self._allreduce_data(torch.zeros(expected[1], dtype=wire.DTYPES[expected[2]][0]),
                                     timeout)
            others = "; ".join(f"rank {r}: {_describe(fields_of[r, _CALL].tolist())}"
                               for r in range(self.world) if not agree[r])
            raise MismatchError(
                f"rank {self.rank}: ranks called allreduce {cid} with different tensors or ops "
                f"(this rank: {_describe(fields[_CALL].tolist())}; {others})")
        if expected_next is not None and (fields_of[:, _NEXT] == fields[_NEXT]).all():
            self._expected = expected_next      # every rank expects the same next call
        if summed is not None and call != expected:
            # every rank made the same call, not the gathered one all expected: that round was
            # its check and carried none of its data
            summed = None
            if tiny:
                _, sums, _ = self._check_round(total, call, None, fields, timeout, deadline,
                                               peer_report)
        if tiny:
            total = torch.from_numpy(sums[:data.numel()])
        elif summed is None and started is None:    # its data waited for its check
            self.checked_first += 1
            if gather:
                _, summed = self._gather_with_check(total, call, fields, timeout, deadline,
                                                    peer_report)
            else:
                started = self._allreduce_data(total, timeout)
        if started is not None:
            self._wait(started, deadline, peer_report)
        if summed is not None:
            total = summed
            self.gathered += 1
        if op == wire.Op.AVG:
            total.div_(self.world)
        if total is not data:
            data.copy_(total.view(data.shape))
        self.collectives += 1
        self.bytes += data.numel() * data.element_size()
        return None if share is None else fields_of[:, _SHARE].mean(axis=0).tolist()

    def _check_round(self, data: torch.Tensor, call: Call, expected: Call | None,
                     fields: np.ndarray, timeout: float, deadline: float, peer_report):
        """The fixed-size check round, a tiny call's data in it; a larger call that every rank
        expected (an allreduce) starts its data alongside. Returns (every rank's fields, the sums
        of the ranks' data slots (a tiny call's result; None where not needed), the data's
        allreduce if started)."""
        tiny = data.numel() <= TINY_NUMEL
        if tiny:
            self._check[:data.numel()] = data.reshape(-1)
        self._check_np[TINY_NUMEL:] = fields        # numpy views: a few us less a call
        started = self._allreduce_data(data, timeout) if expected == call and not tiny else None
        if self.world >= _ROOTED:
            return (*self._rooted_round(timeout, deadline, peer_report), started)
        work = self.check_group.allgather([self._gathered_rows], [self._check],
                                          _timed(AllgatherOptions(), timeout))
        self._wait(work, deadline, peer_report)
        gathered = self._gathered_np
        return gathered[:, TINY_NUMEL:], gathered[:, :TINY_NUMEL].sum(axis=0) if tiny else None, \
            started

    def _rooted_round(self, timeout: float, deadline: float, peer_report):
        """The check round among _ROOTED or more ranks: every rank's buffer gathered at rank 0,
        which sums the data slots (in rank order) and broadcasts the sums and every rank's fields.
        Two steps whatever the world, where a ring allgather takes world - 1. Returns (every
        rank's fields, the sums)."""
        verdict = self._verdict_np

        def decide() -> None:
            verdict[:TINY_NUMEL] = self._gathered_np[:, :TINY_NUMEL].sum(axis=0)
            verdict[TINY_NUMEL:] = self._gathered_np[:, TINY_NUMEL:].reshape(-1)
        self._through_root(self.check_group, self._check, self._gathered_rows, decide,
                           self._verdict, timeout, deadline, peer_report)
        return verdict[TINY_NUMEL:].reshape(self.world, _HEAD), verdict[:TINY_NUMEL]

    def _through_root(self, group, mine: torch.Tensor, rows: list[torch.Tensor] | None, decide,
                      verdict: torch.Tensor, timeout: float, deadline: float, peer_report) -> None:
        """Every rank's `mine` gathered into `rows` at rank 0 (None elsewhere), where decide()
        fills `verdict`, which is then broadcast to every rank: two steps whatever the world."""
        gather = _timed(dist.GatherOptions(), timeout, rootRank=0)
        self._wait(group.gather([rows] if self.rank == 0 else [], [mine], gather), deadline,
                   peer_report)
        if self.rank == 0:
            decide()
        broadcast = _timed(dist.BroadcastOptions(), timeout, rootRank=0, rootTensor=0)
        self._wait(group.broadcast([verdict], broadcast), deadline, peer_report)

    def _gather_with_check(self, data: torch.Tensor | None, expected: Call, fields: np.ndarray,
                           timeout: float, deadline: float, peer_report):
        """Every rank expects the gathered call `expected` (or its check round said they all make
        it): each joins its gather with its own call's fields in front of its data (zeros when
        its call is another one), so one round both checks the calls and carries the data.
        Returns (every rank's fields, the sum of every rank's data, the same on every rank; halves
        add in float32)."""
        dtype = wire.DTYPES[expected[2]][0]
        head, payload = _HEAD * 8, expected[1] * dtype.itemsize
        size = head + -(-payload // 8) * 8      # rows of whole float64s: the views below need
        mine = torch.zeros(size, dtype=torch.uint8)     # no copy
        mine[:head].view(torch.float64).numpy()[:] = fields
        if data is not None:
            mine[head:head + payload].view(dtype).copy_(data.reshape(-1))
        if self.world >= _ROOTED:
            return self._gather_at_root(mine, expected[1], dtype, timeout, deadline, peer_report)
        out = torch.empty(self.world, size, dtype=torch.uint8)
        work = self.data_group.allgather([list(out.unbind(0))], [mine],
                                         _timed(AllgatherOptions(), timeout))
        self._wait(work, deadline, peer_report)
        return out[:, :head].view(torch.float64).numpy(), \
            out[:, head:head + payload].view(dtype).sum(dim=0, dtype=_total_dtype(dtype))

    def _gather_at_root(self, mine: torch.Tensor, numel: int, dtype: torch.dtype, timeout: float,
                        deadline: float, peer_report):
        """A gathered call among _ROOTED or more ranks: every rank's row (`mine`: fields, then
        data) gathered at rank 0, which sums the data and broadcasts every rank's fields and the
        sum. Two steps whatever the world, where a ring allgather takes world - 1
        (as for the check round). Returns what _gather_with_check does."""
        head, fields = _HEAD * 8, self.world * _HEAD * 8
        total_dtype = _total_dtype(dtype)
        verdict = torch.empty(fields + -(-numel * total_dtype.itemsize // 8) * 8,
                              dtype=torch.uint8)    # every rank's fields, then the sum
        total = verdict[fields:fields + numel * total_dtype.itemsize].view(total_dtype)
        gathered = torch.empty(self.world, mine.numel(), dtype=torch.uint8) \
            if self.rank == 0 else None

        def decide() -> None:
            verdict[:fields].view(self.world, head).copy_(gathered[:, :head])
            rows = gathered[:, head:head + numel * dtype.itemsize].view(dtype)
            torch.sum(rows, dim=0, dtype=total_dtype, out=total)
        self._through_root(self.data_group, mine,
                           list(gathered.unbind(0)) if gathered is not None else None, decide,
                           verdict, timeout, deadline, peer_report)
        return verdict[:fields].view(torch.float64).numpy().reshape(self.world, _HEAD), total

    def _allreduce_data(self, tensor: torch.Tensor, timeout: float):
        """Start a larger call's allreduce, in place, on the data group: gloo's work."""
        return self.data_group.allreduce([tensor], _timed(dist.AllreduceOptions(), timeout))

    def _next(self, call: Call) -> Call | None:
        """The call expected after `call`: the kind that followed its kind last time, at the same
        distance in ids. Learns from `call` itself first (the same on every rank whose calls are
        the same)."""
        cid, kind = call[0], call[1:]
        if self._previous is not None:
            previous_id, previous_kind = self._previous
            self._after[previous_kind] = (kind, cid - previous_id)
        self._previous = (cid, kind)
        after = self._after.get(kind)
        return None if after is None else (cid + after[1], *after[0])

    def _wait(self, work, deadline: float, peer_report) -> None:
        """Wait for one gloo collective until done, a peer's report, or the deadline: gloo's own
        wait in slices of _POLL seconds, between which this rank looks for a peer's report. No
        polling first: a thread that polls takes a core from gloo's threads on 2 busy cores (2
        ranks on loopback, 8 to 4K floats, 6 runs each: the median call 403-592 us without it,
        462-1022 us with 2 ms of polling; docs/benchmarks.md)."""
        while True:
            try:
                work.wait(timedelta(seconds=max(0.001, min(_POLL, deadline - time.monotonic()))))
                return
            except Exception:   # gloo: "Operation timed out!" from this wait, or a failure
                if work.is_completed():     # done meanwhile, or failed: its own outcome says which
                    try:
                        work.wait()
                        return
                    except Exception as exc:    # a dead peer, gloo's own timeout, a peer
                        # that gave up and closed: its report says why, if it sent one
                        raise self._report_soon(peer_report) or PeerError(
                            f"rank {self.rank}: gloo's ring failed: {exc}") from exc
            report = peer_report()
            if report is not None:
                raise report
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(f"rank {self.rank}: gloo's ring did not finish within "
                                        f"the timeout (a peer may be dead, stuck, or calling "
                                        f"other collectives)")

    @staticmethod
    def _report_soon(peer_report) -> BaseException | None:
        """A peer's report that arrives within REPORT_GRACE seconds (a peer that refused its
        input reports it, then closes its groups: the closed connection may be seen first)."""
        end = time.monotonic() + REPORT_GRACE
        while (report := peer_report()) is None and time.monotonic() < end:
            time.sleep(0.01)
        return report

    def close(self) -> None:
        """Abort what gloo still runs (after a failure) and release its connections: a peer's
        allreduce that this rank never joined then fails at once ("Connection closed by peer"),
        and this rank's own waits until its peers close, at most gloo's timeout."""
        for group in (self.check_group, self.data_group):
            try:
                group.abort()
            except Exception:   # closing must not raise; the group may already be gone
                pass
        self.check_group = self.data_group = None
