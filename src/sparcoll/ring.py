"""gloo's ring allreduce for the collectives the chooser (algorithm.py) sends its way, made safe.

gloo aborts the whole process when ranks pass buffers of different sizes to one allreduce ("Received
data size doesn't match expected size"), and sums garbage when the dtypes differ but the byte counts
agree. So every ring collective starts with the same allreduce, of a buffer whose length never
depends on the call: float64, TINY_NUMEL slots for data, then a check of (id, numel, dtype, op) as
16-bit digits x and their squares. Summed, all ranks agree iff sum(x) == world * x and
sum(x^2) == world * x^2 on every rank (the ranks' values then have zero variance), so every rank
sees a disagreement and raises MismatchError; none aborts. Two more slots carry numbers the ranks
must agree on (the chooser's times, algorithm.py): summed and divided by the world, every rank gets
the same averages.
  - A tiny tensor (at most TINY_NUMEL elements) travels in that buffer: one round (still about
    twice gloo's own time per call on loopback, docs/benchmarks.md), summed in float64 and rounded
    once, as the sparse path's float32 accumulation would.
  - A larger one follows in a second allreduce of the tensor itself, in its own dtype.
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

_DIGITS = 4                 # 16-bit digits per checked field (id, numel, dtype, op)
_CHECK = 2 * 4 * _DIGITS    # the digits and their squares
_SHARED = 2                 # numbers averaged over the ranks in the first round
_POLL = 0.05                # seconds between looks for a peer's report while gloo runs
_SPIN = 0.002               # seconds of looking at is_completed() first: gloo's timed wait wakes
                            # about 0.9 ms late (8 floats on loopback: 1.9 ms against 1.0 untimed)


class Ring:
    """A gloo group of its own (never shared with the caller's collectives, so its order is ours)."""

    def __init__(self, store, rank: int, world: int, timeout: float, host: str):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        self.rank, self.world = rank, world
        self.group = dist.ProcessGroupGloo(store, rank, world, options)
        self._first = torch.zeros(TINY_NUMEL + _CHECK + _SHARED, dtype=torch.float64)
        self.collectives = 0
        self.bytes = 0              # bytes of tensors handed to gloo (each crosses the ring twice)

    def allreduce(self, cid: int, tensor: torch.Tensor, op: int, timeout: float, peer_report,
                  share: list[float] | None = None) -> list[float] | None:
        """Sum (or average) `tensor` in place over all ranks; returns the ranks' averages of the
        _SHARED numbers in `share` (None if none given: then every rank must give none).
        `peer_report()` returns a peer's error for this collective, if one arrived."""
        data = tensor.detach()
        fields = [cid, data.numel(), wire.DTYPE_CODES[data.dtype], op]
        tiny = data.numel() <= TINY_NUMEL
        buffer = self._first
        buffer.zero_()
        if tiny:
            buffer[:data.numel()] = data.reshape(-1)
        digits = torch.tensor([(f >> (16 * d)) & 0xFFFF for f in fields for d in range(_DIGITS)],
                              dtype=torch.float64)
        check = buffer[TINY_NUMEL:TINY_NUMEL + _CHECK]
        check[:len(digits)] = digits
        check[len(digits):] = digits * digits
        shared = buffer[TINY_NUMEL + _CHECK:]
        shared[:] = torch.tensor(share or [0.0] * _SHARED, dtype=torch.float64)
        self._run(buffer, timeout, peer_report)
        if not (torch.equal(check[:len(digits)], digits * self.world)
                and torch.equal(check[len(digits):], digits * digits * self.world)):
            raise MismatchError(
                f"rank {self.rank}: ranks called allreduce {cid} with different tensors or ops "
                f"(this rank: {data.numel()} elements of {data.dtype}, op "
                f"{wire.Op(op).name.lower()})")
        if tiny:
            total = buffer[:data.numel()]
        else:
            total = data if data.is_contiguous() else data.contiguous()
            self._run(total, timeout, peer_report)
        if op == wire.Op.AVG:
            total.div_(self.world)
        if total is not data:
            data.copy_(total.view(data.shape))
        self.collectives += 1
        self.bytes += data.numel() * data.element_size()
        return None if share is None else (shared / self.world).tolist()

    def _run(self, tensor: torch.Tensor, timeout: float, peer_report) -> None:
        """One gloo SUM allreduce, waited for until done, a peer's report, or the deadline: first
        _SPIN seconds of polling (a short collective is done by then), then gloo's own wait in
        slices of _POLL seconds, between which this rank looks for a peer's report."""
        options = dist.AllreduceOptions()
        options.timeout = timedelta(seconds=timeout)
        work = self.group.allreduce([tensor], options)
        spin_end = time.monotonic() + _SPIN
        while not work.is_completed() and time.monotonic() < spin_end:
            time.sleep(0)       # yields the GIL; a short collective ends here, woken at once
        deadline = time.monotonic() + timeout
        while True:
            try:
                work.wait(timedelta(seconds=max(0.001, min(_POLL, deadline - time.monotonic()))))
                return
            except Exception:   # gloo: "Operation timed out!" from this wait, or a failure
                if work.is_completed():     # done meanwhile, or failed: its own outcome says which
                    try:
                        work.wait()
                        return
                    except Exception as exc:    # a dead peer, gloo's own timeout
                        raise PeerError(f"rank {self.rank}: gloo's ring allreduce failed: "
                                        f"{exc}") from exc
            report = peer_report()
            if report is not None:
                raise report
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(f"rank {self.rank}: gloo's ring did not finish within "
                                        f"{timeout:g} s (a peer may be dead, stuck, or calling "
                                        f"other collectives)")

    def close(self) -> None:
        """Abort what gloo still runs (after a failure) and release its connections."""
        try:
            self.group.abort()
        except Exception:   # closing must not raise; the group may already be gone
            pass
