"""The collectives compressed payloads travel by, on a torch.distributed group (gloo, or a sparcoll
group) and optionally a sparcoll Communicator for the sparse AllReduce. Without an initialized
torch.distributed (one process) every collective is the identity: the world is 1.

Every result is an AVERAGE over ranks, like DDP's gradients.
"""
from __future__ import annotations

import pickle
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout, MismatchError, SparcollError


class LabelMismatch(MismatchError):
    """Ranks paired gathers of different labels (Channel.allgather); `labels`: every rank's."""

    def __init__(self, labels: list):
        super().__init__("ranks paired different gathers: " + ", ".join(
            f"rank {rank} {label}" for rank, label in enumerate(labels)))
        self.labels = labels


class Channel:
    def __init__(self, group=None, comm=None, timeout: float | None = None):
        """`timeout`: seconds each gloo collective may take (None: the group's own timeout, 30 minutes
        by default), a CollectiveTimeout after it. The communicator's collectives keep its own."""
        self.group, self.comm, self.timeout = group, comm, timeout
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        elif comm is not None:
            self.world, self.rank = comm.world, comm.rank
        else:
            self.world, self.rank = 1, 0

    def allreduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Average a dense tensor in place (each share divided first, as DDP does); returns it."""
        self._wait(self.start_allreduce_mean(t))
        return t

    def start_allreduce_mean(self, t: torch.Tensor):
        """allreduce_mean, started on the group's own threads: t holds the average once the returned
        work is waited for (None: nothing to wait for, one rank). gloo runs a later collective while
        this one travels, as under DDP's buckets."""
        if self.world == 1:
            return None
        t.div_(self.world)
        return dist.all_reduce(t, group=self.group, async_op=True)

    def allreduce_mean_many(self, tensors: list) -> list:
        """Average tensors of one dtype in one allreduce (in place for a single tensor)."""
        outs, work = self.start_allreduce_mean_many(tensors)
        self._wait(work)
        return outs

    def start_allreduce_mean_many(self, tensors: list) -> tuple[list, object]:
        """allreduce_mean_many, started: (the averages, valid once the work is waited for; the work or
        None)."""
        if self.world == 1:
            return list(tensors), None
        if len(tensors) == 1:
            return list(tensors), self.start_allreduce_mean(tensors[0])
        flat, parts = _concatenated(tensors)
        return parts, self.start_allreduce_mean(flat)

    def sparse_mean_many(self, tensors: list, tag: int = 0) -> list:
        """Average dense tensors of one dtype in one sparse AllReduce of the communicator (tagged
        `tag`), concatenated: their averages (new tensors)."""
        flat, parts = _concatenated(tensors)
        self.comm.allreduce(flat, op="avg", tag=tag)
        return parts

    def blocks_mean(self, tensors: list, block_size: int, into: list | None = None,
                    tag: int = 0) -> list:
        """Average block-sparse tensors given as (block indices ascending, rows, numel) in one sparse
        AllReduce: their blocks side by side as one COO tensor of rows, so nothing dense is built,
        scanned or sent for the blocks no rank kept. Returns each tensor's flat dense average,
        written into `into`'s flat float32 tensors when given."""
        counts = [-(-numel // block_size) for _, _, numel in tensors]
        offsets = [0]
        for count in counts[:-1]:
            offsets.append(offsets[-1] + count)
        indices = torch.cat([idx + off for (idx, _, _), off in zip(tensors, offsets)])
        rows = torch.cat([r for _, r, _ in tensors])
        summed = self.sparse_mean(block_rows(indices, rows, sum(counts)), tag)
        got, vals = summed.indices()[0], summed.values()
        bounds = torch.searchsorted(got, torch.tensor(offsets + [sum(counts)])).tolist()
        out = []
        for j, ((_, _, numel), off, lo, hi) in enumerate(zip(tensors, offsets, bounds, bounds[1:])):
            dense = torch.empty(numel) if into is None else into[j]
            out.append(scatter_rows(dense.zero_(), got[lo:hi] - off, vals[lo:hi], block_size))
        return out

    def sparse_mean(self, t: torch.Tensor, tag: int = 0) -> torch.Tensor:
        """Average a sparse COO tensor (a new coalesced one) with sparcoll's sparse AllReduce: only
        blocks that are non-zero somewhere cross the wire. Without a communicator, the group's own
        sparse all_reduce (gloo's gathers; a sparcoll group's is sparcoll's). `tag`: the sparse
        AllReduce's (Communicator.allreduce); gloo's collectives carry none."""
        if self.world == 1:
            return t
        if self.comm is not None:
            return self.comm.allreduce_coo(t, op="avg", tag=tag)
        total, work = self.start_sparse_mean(t)
        self._wait(work)
        return total.coalesce()

    def start_sparse_mean(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The group's own sparse all_reduce of t / world (gloo's gathers), started: (the average,
        uncoalesced, valid once the work is waited for; the work or None)."""
        if self.world == 1:
            return t, None
        t = t / self.world
        return t, dist.all_reduce(t, group=self.group, async_op=True)

    def allgather(self, parts: tuple, variable: bool, label: tuple = ()) -> list[tuple]:
        """Every rank's `parts` (1-D tensors, the same dtypes on every rank), in rank order. With
        `variable`, ranks may send different lengths, including 0: the lengths are gathered first and
        each rank's bytes are padded to the longest (so a rank with nothing still takes part).
        `label`: integers naming this gather, which every rank's must equal (where ranks could pair
        different gathers), sent with the lengths: if they differ no data moves, and every rank
        raises LabelMismatch alike."""
        if self.world == 1:
            return [tuple(parts)]
        lengths = torch.tensor([*label, *(p.numel() for p in parts)], dtype=torch.long)
        if variable or label:
            every = [torch.empty_like(lengths) for _ in range(self.world)]
            self._wait(dist.all_gather(every, lengths, group=self.group, async_op=True))
            labels = [tuple(e[:len(label)].tolist()) for e in every]
            if len(set(labels)) > 1:
                raise LabelMismatch(labels)
            every = [e[len(label):] for e in every]
        else:
            every = [lengths] * self.world
        sizes = torch.tensor([p.element_size() for p in parts], dtype=torch.long)
        nbytes = [int((n * sizes).sum()) for n in every]
        if max(nbytes) == 0:
            return [tuple(p[:0] for p in parts)] * self.world
        data = torch.empty(max(nbytes), dtype=torch.uint8)
        data[nbytes[self.rank]:] = 0
        if parts:
            torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts],
                      out=data[:nbytes[self.rank]])
        gathered = [torch.empty_like(data) for _ in range(self.world)]
        self._wait(dist.all_gather(gathered, data, group=self.group, async_op=True))
        return [_split(buf, n, parts) for buf, n in zip(gathered, every)]

    def allgather_object(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order (torch's all_gather_object takes no timeout)."""
        mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        return [pickle.loads(bytes(theirs.numpy())) for (theirs,) in self.allgather((mine,), variable=True)]

    def _wait(self, work) -> None:
        wait_within(work, self.timeout)


TIMED_OUT = 0.95        # a gloo wait that failed after this share of its timeout timed out


def wait_within(work, timeout: float | None) -> None:
    """Wait for a collective started on a gloo group (nothing for None), at most `timeout` seconds (None:
    the group's own timeout). gloo's own timeout (its group's, or this wait's) is a CollectiveTimeout;
    any other failure of the collective is gloo's error."""
    if work is None:
        return
    if timeout is None:
        work.wait()
        return
    began = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        if time.monotonic() - began < TIMED_OUT * timeout and not gloo_timed_out(exc):
            raise
        raise CollectiveTimeout(f"a collective did not finish within {timeout:g} s ({exc})") from exc


def destroy_group(group) -> None:
    """Destroy a group made for sparcoll's own collectives, from a finalizer too (a dropped wrapper or
    state, collected on whichever thread let go of it last): an error, such as torch's tables changing
    meanwhile on another thread, is a warning, not an exception escaping the finalizer."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except Exception as exc:
        warnings.warn(f"sparcoll could not destroy a process group it made ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)


def gloo_timed_out(error: BaseException) -> bool:
    """Whether `error` is gloo's own timeout (its group's, shorter than the caller's, or a wait's):
    "Timed out waiting 1000ms for recv operation to complete", and in the group's next collective
    "Application timeout caused pair closure" (torch 2.13)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and not isinstance(error, SparcollError) \
        and ("timed out" in text or "timeout" in text)


def gloo_lost_a_peer(error: BaseException) -> bool:
    """Whether `error` is gloo's word that a peer's connection broke (its process died or left; torch
    2.13: "Connection reset by peer", "Connection closed by peer")."""
    text = str(error)
    return isinstance(error, RuntimeError) and not isinstance(error, SparcollError) \
        and ("Connection reset by peer" in text or "Connection closed by peer" in text)


def _concatenated(tensors: list) -> tuple[torch.Tensor, list]:
    """One flat copy of `tensors` end to end, and each one's view of its part."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat, [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def block_rows(indices: torch.Tensor, rows: torch.Tensor, nblocks: int) -> torch.Tensor:
    """Blocks `indices` (ascending, distinct) of a tensor of `nblocks` blocks with their `rows`, as the
    COO tensor of rows the sparse AllReduce takes: nothing dense is built or scanned."""
    return torch.sparse_coo_tensor(indices.unsqueeze(0), rows, (nblocks, rows.shape[1]),
                                   is_coalesced=True, check_invariants=False)


def scatter_rows(flat: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor, width: int):
    """Write `rows` (width elements each, ascending block `indices`) into the flat tensor; the
    last block may be partial (its padding dropped). How a sparse AllReduce's average reaches a
    gradient (`blocks_mean` with `into`) and BlockTopK decompresses."""
    full = flat.numel() // width
    inside = int(torch.searchsorted(indices, full))
    flat[:full * width].view(full, width).index_copy_(0, indices[:inside], rows[:inside])
    if inside < indices.numel():
        flat[full * width:] = rows[inside, :flat.numel() - full * width]
    return flat


def _split(buf: torch.Tensor, lengths: torch.Tensor, like: tuple) -> tuple:
    out, offset = [], 0
    for n, p in zip(lengths.tolist(), like):
        size = n * p.element_size()
        part = buf[offset:offset + size]
        # a view as a wider dtype needs an aligned offset (e.g. floats after an odd byte count)
        out.append((part if offset % p.element_size() == 0 else part.clone()).view(p.dtype))
        offset += size
    return tuple(out)
