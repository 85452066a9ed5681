"""All-reduce of sparse COO tensors (e.g. `nn.Embedding(sparse=True)` gradients under DDP) on sparcoll.

`Communicator.allreduce_coo` reduces block-sparse without densifying and returns a new tensor; torch
collectives work in place, so the result is copied back into the caller's tensor before completion.
"""
from __future__ import annotations

import torch

import sparcoll
from sparcoll.communicator import Communicator
from sparcoll.wire import OPS


def allreduce_coo(tensor: torch.Tensor, op: str, comm: Communicator) -> sparcoll.Work:
    """Start reducing `tensor` in place; the returned Work completes once the result is in it."""
    if op not in OPS:
        raise ValueError(f"sparse all_reduce supports {', '.join(OPS)}, not {op!r}")
    work = comm.allreduce_coo(tensor, op=op, async_op=True)
    # Registered first, so it runs before the callbacks that complete the caller's future.
    work.add_done_callback(lambda done: done.exception() is None and tensor.copy_(done.tensor))
    return work
