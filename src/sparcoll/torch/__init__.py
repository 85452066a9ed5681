"""PyTorch integration: the "sparcoll" torch.distributed backend, DDP communication hooks, and
Poseidon's data-parallel wrapper.

    import sparcoll.torch                                # registers the backend
    dist.init_process_group("sparcoll")                  # DDP on it runs its allreduces on sparcoll

or, keeping a gloo group for everything else:

    ddp.register_comm_hook(sparcoll.torch.HookState(sparcoll.init()), sparcoll.torch.allreduce_hook)

or, instead of DDP, per-tensor strategies and wait-free backpropagation:

    model = sparcoll.torch.DataParallel(model, comm=sparcoll.init())
"""
from __future__ import annotations

from .backend import NAME, ProcessGroupSparcoll, SparcollWork, monitored_barrier, register, stats
from .compression import CompressionState, compression_hook
from .hooks import HookState, allreduce_hook
from .parallel import DataParallel

register()

__all__ = ["NAME", "ProcessGroupSparcoll", "SparcollWork", "HookState", "allreduce_hook",
           "CompressionState", "compression_hook", "DataParallel", "monitored_barrier", "register", "stats"]
