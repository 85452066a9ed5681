"""sparcoll: block-sparse streaming AllReduce (OmniReduce) for data-parallel PyTorch.

    import sparcoll
    comm = sparcoll.init()          # after torch.distributed.init_process_group("gloo")
    comm.allreduce(tensor)          # in place; only non-zero blocks cross the network
"""
from __future__ import annotations

import collections
import importlib
from typing import TYPE_CHECKING

from .allocator import keep_freed_memory
from .errors import (AuthenticationError, CollectiveTimeout, DivergedError, MismatchError, PeerError,
                     PoisonedError, ProtocolError, SparcollError)

if TYPE_CHECKING:
    from .communicator import Communicator, Stats, Work

__version__ = "0.1.0"
__all__ = ["init", "Communicator", "Stats", "Work", "SparcollError", "ProtocolError",
           "MismatchError", "PeerError", "AuthenticationError", "CollectiveTimeout", "PoisonedError",
           "DivergedError", "keep_freed_memory"]

_inits_per_group: collections.Counter = collections.Counter()


def __getattr__(name: str):
    """What needs torch, imported on first use, so that `import sparcoll` imports no torch (1.5 s)
    where none is needed: the `sparcoll` command's help and its refusal of a bad option come at once.
    `sparcoll.torch`'s import registers the "sparcoll" torch.distributed backend, which `sparcoll
    aggregator` never needs."""
    if name == "torch":
        return importlib.import_module(".torch", __name__)
    if name in ("Communicator", "Stats", "Work"):
        value = getattr(importlib.import_module(".communicator", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparcoll' has no attribute {name!r}")


def init(group=None, **options) -> Communicator:
    """A Communicator over a torch.distributed group (default: the whole job).

    Rendezvous goes through the group's torch.distributed Store, so torchrun's is the only one.
    Options: block_size (elements, default 256 or $SPARCOLL_BLOCK_SIZE), aggregators (None:
    colocated, one per rank; or ["host:port", ...] of `sparcoll aggregator` processes, default
    $SPARCOLL_AGGREGATORS), streams (1), message_blocks (2048: the most blocks per message; each
    rank sizes its messages down to 1/8 of that on slow links), credits (2) (or $SPARCOLL_STREAMS,
    $SPARCOLL_MESSAGE_BLOCKS, $SPARCOLL_CREDITS), timeout (seconds), host.
    Every rank of the group must call init, in the same order as other inits on that group."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from .communicator import Communicator

    if not dist.is_initialized():
        raise SparcollError("call torch.distributed.init_process_group before sparcoll.init")
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the "
                         f"group passed to sparcoll.init; only its members may call it")
    name = c10d._get_process_group_name(group)
    _inits_per_group[name] += 1
    store = dist.PrefixStore(f"sparcoll/{name}/{_inits_per_group[name]}/",
                             c10d._get_default_store())
    return Communicator(store, dist.get_rank(group), dist.get_world_size(group), **options)
