"""gloo's ring allreduce for the collectives the chooser (algorithm.py) sends its way, made safe.

gloo aborts the whole process when ranks pass buffers of different sizes to one allreduce ("Received
data size doesn't match expected size"), and sums garbage when the dtypes differ but the byte counts
agree. So every ring collective comes with a check: an allreduce, on a gloo group of its own, of a
buffer whose length never depends on the call: float64, TINY_NUMEL slots for data, then (id, numel,
dtype, op) as 16-bit digits and their squares. Summed, all ranks agree iff sum(x) == world * x and
sum(x^2) == world * x^2 on every rank (the ranks' values then have zero variance), so every rank
sees a disagreement and raises MismatchError; none aborts. Two more slots carry numbers the ranks
must agree on (the chooser's times, algorithm.py): summed and divided by the world, every rank gets
the same averages.
  - A tiny tensor (at most TINY_NUMEL elements) travels in that buffer: one round, summed in float64
    and rounded once, as the sparse path's float32 accumulation would.
  - A larger one is summed by an allreduce of the tensor itself, in its own dtype, on a second gloo
    group. It waits for its check only when its size is not known to agree: each check also carries
    the call this rank expects next on the ring (the one that followed this call's kind last time),
    checked the same way. When every rank expected the same next call and it comes, its data and its
    check start together, and a check round (one round trip through every process: 6-15 ms with 4
    processes on 2 cores) no longer delays the data. A rank whose call differs from what all
    expected waits for its check first, so it never joins that data allreduce; the check round,
    which every rank joins, then tells every rank, and those whose data had not started give the
    others' data allreduce a zero partner of its size (gloo cannot cancel an allreduce).
A ring collective waits for gloo or for a peer's report of the same collective (a peer that refused
its input tells the aggregators; see WorkerJob.abort), whichever comes first, at most `timeout`.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import wire
from .algorithm import TINY_NUMEL
from .errors import CollectiveTimeout, MismatchError, PeerError

_DIGITS = 4                 # 16-bit digits per checked field
_FIELDS = 4                 # a call: id, numel, dtype, op
_CALL = 2 * _FIELDS * _DIGITS           # a call's digits and their squares
_SHARED = 2                 # numbers averaged over the ranks in the check round
_POLL = 0.05                # seconds between looks for a peer's report while gloo runs
_REPORT_GRACE = 0.5         # seconds a failed allreduce waits for a peer's report of why
_SPIN = 0.002               # seconds of looking at is_completed() first: gloo's timed wait wakes
                            # about 0.9 ms late (8 floats on loopback: 1.9 ms against 1.0 untimed)

Call = tuple[int, int, int, int]        # (id, numel, dtype code, op)


def _digits(call: Call | None) -> torch.Tensor:
    """A call's fields as 16-bit digits and their squares; zeros for no call (ids start at 1)."""
    fields = call or (0,) * _FIELDS
    digits = torch.tensor([(f >> (16 * d)) & 0xFFFF for f in fields for d in range(_DIGITS)],
                          dtype=torch.float64)
    return torch.cat([digits, digits * digits])


class Ring:
    """Two gloo groups of its own (never shared with the caller's collectives, so their order is
    ours): one for the checks, one for the tensors."""

    def __init__(self, store, rank: int, world: int, timeout: float, host: str):
        self.rank, self.world = rank, world
        self.check_group = self._group(dist.PrefixStore("check", store), timeout, host)
        self.data_group = self._group(dist.PrefixStore("data", store), timeout, host)
        self._check = torch.zeros(TINY_NUMEL + 2 * _CALL + _SHARED, dtype=torch.float64)
        self._expected: Call | None = None  # the next call every rank expected, if they agreed
        self._previous: tuple | None = None     # (id, kind) of the last call
        self._after: dict[tuple, tuple] = {}    # kind -> (kind, id distance) of the call after it
        self.collectives = 0
        self.bytes = 0              # bytes of tensors handed to gloo (each crosses the ring twice)
        self.checked_first = 0      # larger calls whose data waited for their check

    def _group(self, store, timeout: float, host: str):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, self.rank, self.world, options)

    def allreduce(self, cid: int, tensor: torch.Tensor, op: int, timeout: float, peer_report,
                  share: list[float] | None = None) -> list[float] | None:
        """Sum (or average) `tensor` in place over all ranks; returns the ranks' averages of the
        _SHARED numbers in `share` (None if none given: then every rank must give none).
        `peer_report()` returns a peer's error for this collective, if one arrived."""
        data = tensor.detach()
        call = (cid, data.numel(), wire.DTYPE_CODES[data.dtype], op)
        tiny = data.numel() <= TINY_NUMEL
        total = data if tiny or data.is_contiguous() else data.contiguous()
        deadline = time.monotonic() + timeout
        buffer = self._check
        buffer.zero_()
        if tiny:
            buffer[:data.numel()] = data.reshape(-1)
        checks = buffer[TINY_NUMEL:TINY_NUMEL + 2 * _CALL]
        expected_next = self._next(call)
        mine = torch.cat([_digits(call), _digits(expected_next)])
        checks[:] = mine
        shared = buffer[TINY_NUMEL + 2 * _CALL:]
        shared[:] = torch.tensor(share or [0.0] * _SHARED, dtype=torch.float64)
        expected, self._expected, data_work = self._expected, None, None
        if expected == call and not tiny:
            data_work = self.data_group.allreduce([total], self._options(timeout))
        self._wait(self.check_group.allreduce([buffer], self._options(timeout)), deadline, peer_report)
        if not torch.equal(checks[:_CALL], mine[:_CALL] * self.world):
            if data_work is None and expected is not None and expected[1] > TINY_NUMEL:
                # peers whose call was the expected one have started its data: a partner of the
                # same size lets it end (gloo cannot cancel it; its groups would wait at close)
                dummy = torch.zeros(expected[1], dtype=wire.DTYPES[expected[2]][0])
                self.data_group.allreduce([dummy], self._options(timeout))
            raise MismatchError(
                f"rank {self.rank}: ranks called allreduce {cid} with different tensors or ops "
                f"(this rank: {data.numel()} elements of {data.dtype}, op "
                f"{wire.Op(op).name.lower()})")
        if torch.equal(checks[_CALL:], mine[_CALL:] * self.world):
            self._expected = expected_next      # every rank expects the same next call
        if tiny:
            total = buffer[:data.numel()]
        else:
            if data_work is None:
                self.checked_first += 1
                data_work = self.data_group.allreduce([total], self._options(timeout))
            self._wait(data_work, deadline, peer_report)
        if op == wire.Op.AVG:
            total.div_(self.world)
        if total is not data:
            data.copy_(total.view(data.shape))
        self.collectives += 1
        self.bytes += data.numel() * data.element_size()
        return None if share is None else (shared / self.world).tolist()

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

    @staticmethod
    def _options(timeout: float) -> dist.AllreduceOptions:
        options = dist.AllreduceOptions()
        options.timeout = timedelta(seconds=timeout)
        return options

    def _wait(self, work, deadline: float, peer_report) -> None:
        """Wait for one gloo allreduce until done, a peer's report, or the deadline: first _SPIN
        seconds of polling (a short collective is done by then), then gloo's own wait in slices of
        _POLL seconds, between which this rank looks for a peer's report."""
        spin_end = time.monotonic() + _SPIN
        while not work.is_completed() and time.monotonic() < spin_end:
            time.sleep(0)       # yields the GIL; a short collective ends here, woken at once
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
                            f"rank {self.rank}: gloo's ring allreduce failed: {exc}") from exc
            report = peer_report()
            if report is not None:
                raise report
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(f"rank {self.rank}: gloo's ring did not finish within "
                                        f"the timeout (a peer may be dead, stuck, or calling "
                                        f"other collectives)")

    @staticmethod
    def _report_soon(peer_report) -> BaseException | None:
        """A peer's report that arrives within _REPORT_GRACE seconds (a peer that refused its
        input reports it, then closes its groups: the closed connection may be seen first)."""
        end = time.monotonic() + _REPORT_GRACE
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
