"""DDP communication hook: average each gradient bucket with sparcoll, on a DDP model whose process
group is gloo.

    state = sparcoll.torch.HookState(sparcoll.init())
    ddp.register_comm_hook(state, sparcoll.torch.allreduce_hook)

A bucket's allreduce starts as soon as DDP hands the bucket over, so buckets overlap the rest of
backward; sparcoll's own thread completes the returned future (nothing blocks in a callback). A failed
allreduce fails the future, and DDP's backward raises it as a RuntimeError.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations against the real types.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparcoll.communicator import Communicator

from . import sparse
from .futures import Completion


@dataclass
class HookState:
    """comm: a sparcoll Communicator over DDP's group (sparcoll.init); it reduces dense and sparse
    COO buckets alike."""
    comm: Communicator


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket` over all ranks, like DDP's default hook; the future's value is the buffer."""
    buffer = bucket.buffer()

    def issue() -> list:
        if buffer.layout == torch.sparse_coo:
            return [sparse.allreduce_coo(buffer, "avg", state.comm)]
        return [state.comm.allreduce(buffer, op="avg", async_op=True)]

    return Completion.start(buffer, issue).future
