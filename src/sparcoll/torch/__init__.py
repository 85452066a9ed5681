"""PyTorch integration: the "sparcoll" torch.distributed backend and a DDP communication hook.

    import sparcoll.torch                                # registers the backend
    dist.init_process_group("sparcoll")                  # DDP on it runs its allreduces on sparcoll

or, keeping a gloo group for everything else:

    ddp.register_comm_hook(sparcoll.torch.HookState(sparcoll.init()), sparcoll.torch.allreduce_hook)
"""
from __future__ import annotations

from .backend import NAME, ProcessGroupSparcoll, SparcollWork, monitored_barrier, register
from .compression import CompressionState, compression_hook
from .hooks import HookState, allreduce_hook

register()

__all__ = ["NAME", "ProcessGroupSparcoll", "SparcollWork", "HookState", "allreduce_hook",
           "CompressionState", "compression_hook", "monitored_barrier", "register"]
