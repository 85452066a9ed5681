"""All-reduce of sparse COO tensors (e.g. `nn.Embedding(sparse=True)` gradients under DDP).

For now through gloo's own sparse all_reduce (an AllGather of indices and values; SUM only, so AVG
divides the summed values). When the core grows a native COO path (`Communicator.allreduce_coo`),
this function is the one place to switch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions

OPS = ("sum", "avg")


def allreduce_coo(tensor: torch.Tensor, op: str, gloo: dist.ProcessGroup) -> torch.futures.Future:
    """Start reducing `tensor` in place over `gloo` (a gloo process group); the future's value is
    [tensor] once the result is in it."""
    if op not in OPS:
        raise ValueError(f"sparse all_reduce supports {', '.join(OPS)}, not {op!r}")
    opts = AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    world = gloo.size()

    def finish(done: torch.futures.Future) -> list[torch.Tensor]:
        done.value()        # raises gloo's error, which fails the returned future
        if op == "avg":
            tensor._values().div_(world)
        return [tensor]

    return gloo.allreduce([tensor], opts).get_future().then(finish)
