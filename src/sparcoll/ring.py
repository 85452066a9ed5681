"""gloo's ring allreduce for the collectives the chooser (algorithm.py) sends its way, made safe.

gloo aborts the whole process when ranks pass buffers of different sizes to one collective
("Received data size doesn't match expected size"), and sums garbage when the dtypes differ but the
byte counts agree. So every ring collective comes with a check: a round through the star (star.py:
every rank's frame to rank 0, rank 0's verdict back, frames of any length) carrying the call (id,
numel, dtype, op, gathered or not, the caller's tag), the call this rank expects next, and _SHARED
numbers. The verdict (rank 0's; with 2 ranks the rows cross and each rank makes it) holds, where
every rank made the same call, one row: that call, the next call if every rank expects the same one,
and the ranks' averages of the shared numbers (the chooser's times, algorithm.py), the same on every
rank. Where the calls differ it holds every rank's fields, so that each rank names the ranks whose
call differs: every rank sees a disagreement and raises MismatchError; none aborts. (It held every
rank's fields always: 136 x world bytes to each rank, 551 KB from rank 0 a small call at 64 ranks.)
The star rather than gloo: its round is written and read by the calling thread, 58 us median on 2
ranks on loopback and 236 us on 4 where gloo's allgather of the fixed-size buffer this check used to
be took 266 and 3070 us (star.py).
  - A tiny tensor (at most TINY_NUMEL elements) travels in that round in float64, and so does a
    gathered one (the chooser's gather path, algorithm.py: at most GATHER_ELEMENTS elements over
    all ranks) in its own dtype: rank 0 (with 2 ranks, each rank) sums them in rank order (halves
    in float32), the same result on every rank, and a tiny one is rounded once, as the sparse
    path's float32 accumulation would.
  - A larger one is summed by an allreduce of the tensor itself, in its own dtype, on a gloo group
    of its own. It waits for its check only when its size is not known to agree: each check also
    carries the call this rank expects next on the ring (the one that followed this call's kind
    last time), compared the same way. When every rank expected the same next call and it comes,
    its data and its check start together, and a check round no longer delays the data. A rank
    whose call differs waits for its check first, so it never joins that data allreduce; the
    check round, which every rank joins, then tells every rank, and those whose data had not
    started give the others' a zero partner of its size (gloo cannot cancel an allreduce); those
    whose data had started let it end before they raise, so nothing writes the caller's tensor
    after the error.
A ring collective waits for gloo (or the star) or for a peer's report of the same collective (a peer
that refused its input tells the aggregators; see WorkerJob.abort), whichever comes first, at most
`timeout`.
"""
from __future__ import annotations

import struct
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from . import wire
from .algorithm import GATHER_ELEMENTS, TINY_NUMEL
from .errors import SETTLE_S, MismatchError, PeerError, ProtocolError
from .star import POLL, Credentials, Star, report_soon, still_waiting

_FIELDS = 7                 # a call: id, numel, dtype, op, 1 if its data is gathered, its tag, and
                            # the elements of the COO tensor its data was made from (0: none)
_SHARED = 3                 # numbers averaged over the ranks in the check round
_CALL = slice(0, _FIELDS)                   # in a rank's fields: this call,
_NEXT = slice(_FIELDS, 2 * _FIELDS)         # the call it expects next,
_SHARE = slice(2 * _FIELDS, 2 * _FIELDS + _SHARED)     # and the numbers to average
_HEAD = _SHARE.stop         # float64 fields in front of the data a call carries
_PACKED = struct.Struct(f"={_HEAD}d")       # a rank's fields as bytes, float64 as numpy's (the
_SHARES = struct.Struct(f"={_SHARED}d")     # ranks share a byte order), the shared numbers, and
_COUNT = struct.Struct("=d")                # a verdict's count of rows: struct's calls cost a tiny
_ROWS = _COUNT.size                         # call less than numpy's; the count's bytes
_NO_CALL = (0,) * _FIELDS                   # (ids start at 1: zeros are no call)
_NO_SHARE = (0.0,) * _SHARED

Call = tuple[int, int, int, int, int, int, int]  # (id, numel, dtype code, op, gathered, tag, COO elements)
_NUMPY_OF = {torch.float32: np.float32, torch.float64: np.float64}   # dtypes read and written
                        # through numpy as they are: a tiny call's numpy calls cost less than torch's


def _describe(call) -> str:
    """A call's fields (a sequence of floats) as a rank put them in its check, in words."""
    if not np.isfinite(call).all():
        return f"unreadable fields {call}"
    cid, numel, dtype, op, gathered, tag, coo = (int(f) for f in call)
    dtype_name = wire.DTYPES[dtype][0] if dtype in wire.DTYPES else f"dtype code {dtype}"
    return f"allreduce {cid}: {numel} elements of {dtype_name}, op {wire.op_name(op)}" + \
        (f" (a COO tensor of {coo} elements as one buffer)" if coo else "") + \
        (", gathered" if gathered else "") + wire.tagged(tag)


def _total_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gathered data is summed in: halves add in float32."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def _call_of(fields) -> Call | None:
    """A rank's call from its fields (a sequence of floats); None if they cannot be one (not whole
    numbers, an unknown dtype code)."""
    values = list(fields)
    try:
        call = tuple(map(int, values))
    except (ValueError, OverflowError):     # NaN, infinity
        return None
    return call if list(call) == values and call[1] >= 0 and call[2] in wire.DTYPES else None


def _carried(call: Call) -> bool:
    """Whether a call's data travels in its check round: a tiny one's, or a gathered one's."""
    return call[1] <= TINY_NUMEL or bool(call[4])


def _carrier(call: Call) -> torch.dtype:
    """The dtype a carried call's data travels in: a tiny call's in float64 (summed without
    rounding, rounded once), a gathered call's in its own."""
    return torch.float64 if call[1] <= TINY_NUMEL else wire.DTYPES[call[2]][0]


def _payload(call: Call) -> tuple[torch.dtype | None, int]:
    """The dtype a call's data travels in in its check round (None: it does not) and its bytes."""
    if not _carried(call):
        return None, 0
    carrier = _carrier(call)
    return carrier, call[1] * carrier.itemsize


def _same(heads: bytes, part: slice, fields: bytes) -> bool:
    """Whether every rank's `part` of its fields (`heads`: every rank's, as the verdict holds them)
    is this rank's (`fields`, packed). Compared as bytes: numpy's comparisons cost a tiny call more."""
    start, stop = part.start * 8, part.stop * 8
    mine = fields[start:stop]
    if len(heads) == _HEAD * 8:     # one row: the verdict of calls that agree
        return heads[start:stop] == mine
    return all(heads[o + start:o + stop] == mine for o in range(0, len(heads), _HEAD * 8))


def _fields_of(heads: bytes) -> np.ndarray:
    """Every rank's fields, a row each."""
    return np.frombuffer(heads, dtype=np.float64).reshape(-1, _HEAD)


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    """`t`'s memory as a numpy array, if numpy reads and writes it as it is (else None)."""
    return t.numpy() if t.device.type == "cpu" and t.dtype in _NUMPY_OF else None


def _timed(options, timeout: float, **fields):
    """gloo's options of one collective (`options`, e.g. dist.AllreduceOptions()) with `timeout`
    seconds and `fields` set."""
    options.timeout = timedelta(seconds=timeout)
    for name, value in fields.items():
        setattr(options, name, value)
    return options


class Ring:
    """The star for the checks (and the data that travels with them) and a gloo group for larger
    tensors, both its own (never shared with the caller's collectives, so their order is ours)."""

    def __init__(self, store, rank: int, world: int, timeout: float, host: str,
                 credentials: Credentials, abandon=lambda: None):
        """`abandon()`: the error of a peer that gave up init meanwhile, if one did (the star's
        waits look for it)."""
        self.rank, self.world = rank, world
        self.gather_limit = GATHER_ELEMENTS // world    # elements of the largest gathered call
        payload = 8 * max(TINY_NUMEL, self.gather_limit)
        self.star = Star.connect(dist.PrefixStore("star", store), rank, world, host, credentials,
                                 timeout, row_limit=_HEAD * 8 + payload,
                                 verdict_limit=_ROWS + world * _HEAD * 8 + payload, abandon=abandon)
        try:
            self.data_group = self._group(dist.PrefixStore("data", store), timeout, host)
        except BaseException:
            self.star.close()
            raise
        self._row = torch.zeros(_HEAD * 8 + payload, dtype=torch.uint8)  # fields, then data
        self._row_np = self._row.numpy()
        self._row_bytes = memoryview(self._row_np)
        self._verdict = torch.zeros(_ROWS + world * _HEAD * 8 + payload, dtype=torch.uint8)  # _decide's
        self._verdict_np = self._verdict.numpy()
        self._verdict_bytes = memoryview(self._verdict_np)
        self._one_row, self._every_row = _COUNT.pack(1), _COUNT.pack(world)
        self._expected: Call | None = None  # the next call every rank expected, if they agreed
        self._previous: tuple | None = None     # (id, kind) of the last call
        self._after: dict[tuple, tuple] = {}    # kind -> (kind, id distance) of the call after it
        self.collectives = 0
        self.bytes = 0              # bytes of tensors reduced here (through gloo or the star)
        self.checked_first = 0      # larger calls whose allreduce waited for their check
        self.gathered = 0           # larger calls whose data travelled with their check

    def _group(self, store, timeout: float, host: str):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, self.rank, self.world, options)

    def allreduce(self, cid: int, tensor: torch.Tensor, op: int, timeout: float, peer_report,
                  share: list[float] | None = None, gather: bool = False,
                  lost=lambda: None, tag: int = 0, coo: int = 0) -> list[float] | None:
        """Sum (or average) `tensor` in place over all ranks; returns the ranks' averages of the
        _SHARED numbers in `share` (None if none given: then every rank must give none).
        `gather`: a larger tensor (at most gather_limit elements) travels with its check and is
        summed by rank 0, not allreduced. `tag`: the caller's, which every rank's call must have too.
        `coo`: the elements of the COO tensor `tensor` was made from (densified.py), which every
        rank's must match too: COO tensors of other shapes may make buffers of one size.
        `peer_report()` returns a peer's error for this
        collective, if one arrived; `lost()` the error of a connection this rank lost meanwhile
        (a peer's process died), which ends the check round's waits too: the round cannot end
        without that peer, and a survivor that gave up first may close before its report of why
        arrives. Not gloo's wait: peers may still complete its allreduce."""
        data = tensor.detach()
        numel = data.numel()
        gather = gather and TINY_NUMEL < numel <= self.gather_limit
        call = (cid, numel, wire.DTYPE_CODES[data.dtype], op, int(gather), tag, coo)
        deadline = time.monotonic() + timeout
        expected_next = self._next(call)
        fields = _PACKED.pack(*call, *(expected_next or _NO_CALL), *(share or _NO_SHARE))
        expected, self._expected = self._expected, None
        contiguous = data if data.is_contiguous() else data.contiguous()
        carrier, payload = _payload(call)
        carried = carrier is not None
        array = _numpy(data) if carried else None     # (a tiny call's data goes in and out here)
        # gloo sums float16 in float16: an average's shares, divided first, do not overflow where the
        # average would not (the sparse and gathered paths sum in float32)
        shares = op == wire.Op.AVG and data.dtype == torch.float16 and not carried
        started = None
        if call == expected and not carried:
            started = self._allreduce_data(contiguous, timeout, shares)     # beside its check
        heads, agreed, total = self._round(contiguous, array, call, carrier, payload, fields, deadline,
                                           lambda: peer_report() or lost())
        if not agreed:
            if len(heads) != self.world * _HEAD * 8:
                raise ProtocolError(f"rank {self.rank}: rank 0's verdict of the check says every rank made "
                                    f"this rank's call, but it holds another")
            fields_of = _fields_of(heads)
            agree = (fields_of[:, _CALL] == np.frombuffer(fields, dtype=np.float64)[_CALL]).all(axis=1)
            if started is None and expected is not None and not _carried(expected):
                # peers whose call was the expected one (an allreduce) have started its data: a
                # partner of its size lets it end (gloo cannot cancel it; its groups would wait
                # at close)
                self._allreduce_data(torch.zeros(expected[1], dtype=wire.DTYPES[expected[2]][0]),
                                     timeout)
            if started is not None:
                # the call's data started beside its check: the differing ranks' zero partners
                # let it end, and it writes the caller's tensor until then; the caller who gets
                # the error owns the tensor again
                self._let_end(started, deadline)
            others = "; ".join(f"rank {r}: {_describe(fields_of[r, _CALL].tolist())}"
                               for r in range(self.world) if not agree[r])
            raise MismatchError(
                f"rank {self.rank}: ranks called allreduce {cid} with different tensors or ops "
                f"(this rank: {_describe(call)}; {others})")
        if expected_next is not None and _same(heads, _NEXT, fields):
            self._expected = expected_next      # every rank expects the same next call
        if total is None:
            if started is None:     # its size was not known to agree: it waited for its check
                self.checked_first += 1
                started = self._allreduce_data(contiguous, timeout, shares)
            self._wait(started, deadline, peer_report)
            total = contiguous
        elif gather:
            self.gathered += 1
        if op == wire.Op.AVG and not shares:
            total /= self.world
        if array is not None and isinstance(total, np.ndarray):    # a carried call's sum
            with np.errstate(over="ignore"):    # a sum beyond the dtype: infinity, as gloo's, unannounced
                np.copyto(array, total.reshape(array.shape), casting="unsafe")
        elif total is not data:
            data.copy_(torch.as_tensor(total).view(data.shape))
        self.collectives += 1
        self.bytes += numel * data.element_size()
        return None if share is None else list(_SHARES.unpack_from(heads, _SHARE.start * 8))  # (averaged by _decide)

    def _round(self, data: torch.Tensor, array: np.ndarray | None, call: Call,
               carrier: torch.dtype | None, payload: int, fields: bytes, deadline: float, peer_report):
        """One round through the star: this rank's fields (packed), and its data if the call carries
        it (`payload` bytes in `carrier`: a tiny call's in float64, a gathered one's in its dtype;
        `array`: the data as numpy, if numpy reads it). Returns (the verdict's fields as bytes: one
        row if every rank made the same call, else every rank's; whether every rank made this
        rank's call; the sum of the ranks' data (numpy, in the verdict) if they did and the call
        carries data, else None)."""
        self._row_bytes[:_HEAD * 8] = fields
        if payload:
            carried = self._row_np[_HEAD * 8:_HEAD * 8 + payload]
            if array is None or carrier is not torch.float64:
                torch.from_numpy(carried).view(carrier).copy_(data.reshape(-1))
            else:
                np.copyto(carried.view(np.float64), array.reshape(-1))
        verdict = self.star.round(self._row_np[:_HEAD * 8 + payload], self._decide, deadline,
                                  peer_report)
        rows = _COUNT.unpack_from(verdict)[0] if len(verdict) >= _ROWS else None
        if rows not in (1, self.world) or len(verdict) < _ROWS + rows * _HEAD * 8:
            raise ProtocolError(f"rank {self.rank}: rank 0's verdict of the check ({len(verdict)} bytes) does "
                                f"not hold the fields of one rank or of all {self.world}")
        end = _ROWS + int(rows) * _HEAD * 8
        heads = verdict[_ROWS:end].tobytes()
        agreed = _same(heads, _CALL, fields)
        if not payload or not agreed:
            if len(verdict) != end:
                raise ProtocolError(f"rank {self.rank}: rank 0's verdict holds {len(verdict) - end} bytes "
                                    f"after its fields, where the call carries no data")
            return heads, agreed, None
        total_dtype = _total_dtype(carrier)
        if len(verdict) != end + call[1] * total_dtype.itemsize:
            raise ProtocolError(f"rank {self.rank}: rank 0's verdict holds {len(verdict) - end} "
                                f"bytes of sums for a call of {call[1]} elements")
        return heads, agreed, verdict[end:].view(_NUMPY_OF[total_dtype])

    def _decide(self, rows: list[np.ndarray]) -> np.ndarray:
        """The verdict of a round (rank 0's; with 2 ranks each rank's own), behind the count of its
        rows of fields: if every rank made the same call, one row (the call, the next call if every
        rank expects the same one, else zeros: none, and the ranks' averages of the shared numbers),
        then, if the call carries data, the sum of their data in rank order (a tiny call's in
        float64, a gathered one's in its dtype, halves in float32); else every rank's fields."""
        head = _HEAD * 8
        lengths = {len(row) for row in rows}
        for r, row in enumerate(rows if min(lengths) < head else ()):
            if len(row) < head:
                raise ProtocolError(f"rank {self.rank}: rank {r}'s check holds {len(row)} "
                                    f"bytes, fewer than its fields")
        fields_of = [row[:head].tobytes() for row in rows]
        if len({f[:_CALL.stop * 8] for f in fields_of}) > 1:      # calls that differ
            every = b"".join(fields_of)
            heads = _ROWS + len(every)
            self._verdict_bytes[:heads] = self._every_row + every
            return self._verdict_np[:heads]
        values = _PACKED.unpack(fields_of[0])
        next_agrees = len({f[_NEXT.start * 8:_NEXT.stop * 8] for f in fields_of}) == 1
        shares = zip(*(_SHARES.unpack_from(f, _SHARE.start * 8) for f in fields_of))
        fields = _PACKED.pack(*values[_CALL], *(values[_NEXT] if next_agrees else _NO_CALL),
                              *(sum(column) / self.world for column in shares))
        heads = _ROWS + head
        self._verdict_bytes[:heads] = self._one_row + fields
        call = _call_of(values[_CALL])
        carrier, payload = _payload(call) if call is not None else (None, -1)
        size = head + payload
        for r, row in enumerate(rows if lengths != {size} else ()):
            if len(row) != size:
                raise ProtocolError(f"rank {self.rank}: rank {r}'s check holds {len(row)} bytes, "
                                    f"not what its call needs ({_describe(values[_CALL])})")
        if size == head:
            return self._verdict_np[:heads]
        total_dtype = _total_dtype(carrier)
        end = heads + call[1] * total_dtype.itemsize
        if carrier is torch.float64:    # a tiny call: numpy's calls cost less than torch's
            total = self._verdict_np[heads:end].view(np.float64)
            np.copyto(total, rows[0][_HEAD * 8:].view(np.float64))
            with np.errstate(over="ignore", invalid="ignore"):  # infinity and NaN as gloo's, unannounced
                for row in rows[1:]:
                    total += row[_HEAD * 8:].view(np.float64)
            return self._verdict_np[:end]
        total = self._verdict[heads:end].view(total_dtype)
        total.copy_(torch.from_numpy(rows[0][_HEAD * 8:]).view(carrier))
        for row in rows[1:]:
            total.add_(torch.from_numpy(row[_HEAD * 8:]).view(carrier))
        return self._verdict_np[:end]

    def _allreduce_data(self, tensor: torch.Tensor, timeout: float, shares: bool = False):
        """Start a larger call's allreduce, in place, on the data group: gloo's work. `shares`: of
        the tensor divided by the world first (an average's)."""
        if shares:
            tensor.div_(self.world)
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
        wait in slices of POLL seconds, between which this rank looks for a peer's report. No
        polling first: a thread that polls takes a core from gloo's threads on 2 busy cores (2
        ranks on loopback, 8 to 4K floats, 6 runs each: the median call 403-592 us without it,
        462-1022 us with 2 ms of polling; docs/benchmarks-log.md)."""
        while True:
            try:
                work.wait(timedelta(seconds=max(0.001, min(POLL, deadline - time.monotonic()))))
                return
            except Exception:   # gloo: "Operation timed out!" from this wait, or a failure
                if work.is_completed():     # done meanwhile, or failed: its own outcome says which
                    try:
                        work.wait()
                        return
                    except Exception as exc:    # a dead peer, gloo's own timeout, a peer
                        # that gave up and closed: its report says why, if it sent one
                        raise report_soon(peer_report) or PeerError(
                            f"rank {self.rank}: gloo's ring failed{self._closed_links()}: "
                            f"{exc}") from exc
            still_waiting(peer_report, deadline,
                          f"rank {self.rank}: gloo's ring did not finish within the timeout")

    @staticmethod
    def _let_end(work, deadline: float) -> None:
        """Wait, until the deadline (at least SETTLE_S), for a data allreduce whose call has already
        failed; its own failure is moot (the caller gets the call's error)."""
        try:
            work.wait(timedelta(seconds=max(SETTLE_S, deadline - time.monotonic())))
        except Exception:   # gloo's timeout, or a peer gone meanwhile
            pass

    def _closed_links(self) -> str:
        """Which ranks' star connections are closed, in words (gloo's errors name an address, not
        a rank); rank 0 sees every rank's, the others rank 0's."""
        closed = self.star.closed_peers()
        if not closed:
            return ""
        ranks = ", ".join(f"rank {r}" for r in closed)
        return f" ({ranks} closed {'its' if len(closed) == 1 else 'their'} connection: died or left)"

    def close(self) -> None:
        """Close the star and abort what gloo still runs (after a failure): a peer waiting for
        this rank's frame, or in an allreduce that this rank never joined, then fails at once
        ("Connection closed by peer"), and this rank's own waits until its peers close, at most
        gloo's timeout."""
        self.star.close()
        try:
            self.data_group.abort()
        except Exception:   # closing must not raise; the group may already be gone
            pass
        self.data_group = None
