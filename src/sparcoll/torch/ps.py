"""A sharded parameter server over a torch.distributed group (gloo point-to-point), colocated with the
workers as Poseidon's: rank s serves shard s of every tensor. Each rank pushes shard s of its tensor to
rank s, sums the shards it receives into its own in place, sends the sum back to every rank and
receives every other shard's sum straight into its tensor. All transfers are posted at once, so pushes
to different servers and the pulls proceed concurrently.

Bytes each rank sends for n elements: 2 n (P - 1) / P elements, as a ring allreduce; what differs is
the pattern (P - 1 concurrent peers instead of one neighbour).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from sparcoll.compress.channel import wait_within

PUSH, PULL = 1, 2


def ps_allreduce(tensor: torch.Tensor, group=None, scratch: list | None = None,
                 timeout: float | None = None) -> torch.Tensor:
    """Sum the flat contiguous `tensor` over the group's ranks in place; returns it. `scratch`: a list
    of world - 1 tensors of at least one shard each, reused across calls (else allocated). `timeout`:
    seconds each transfer may take (None: the group's own timeout)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return tensor
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    shards = torch.tensor_split(tensor, world)
    mine = shards[rank]
    others = [r for r in range(world) if r != rank]
    if scratch is None:
        scratch = [torch.empty(mine.numel(), dtype=tensor.dtype) for _ in others]
    pushes = [dist.isend(shards[r], peer(r), group=group, tag=PUSH) for r in others]
    incoming = [buf[:mine.numel()] for buf in scratch]
    arrivals = [dist.irecv(buf, peer(r), group=group, tag=PUSH) for buf, r in zip(incoming, others)]
    pulls = [dist.irecv(shards[r], peer(r), group=group, tag=PULL) for r in others]
    for buf, arrival in zip(incoming, arrivals):
        wait_within(arrival, timeout)
        mine.add_(buf)
    replies = [dist.isend(mine, peer(r), group=group, tag=PULL) for r in others]
    for work in pushes + pulls + replies:
        wait_within(work, timeout)
    return tensor
