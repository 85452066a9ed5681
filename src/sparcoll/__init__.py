"""sparcoll: block-sparse streaming AllReduce (OmniReduce) for data-parallel PyTorch.

    import sparcoll
    comm = sparcoll.init()          # after torch.distributed.init_process_group("gloo")
    comm.allreduce(tensor)          # in place; only non-zero blocks cross the network
"""
from __future__ import annotations

import collections
import importlib

from .communicator import Communicator, Stats, Work
from .errors import (AuthenticationError, CollectiveTimeout, MismatchError, PeerError,
                     PoisonedError, ProtocolError, SparcollError)

__version__ = "0.1.0"
__all__ = ["init", "Communicator", "Stats", "Work", "SparcollError", "ProtocolError",
           "MismatchError", "PeerError", "AuthenticationError", "CollectiveTimeout", "PoisonedError"]

_inits_per_group: collections.Counter = collections.Counter()


def __getattr__(name: str):
    """`sparcoll.torch` after a plain `import sparcoll`, imported on first use: importing it
    registers the "sparcoll" torch.distributed backend, which `sparcoll aggregator` never needs."""
    if name == "torch":
        return importlib.import_module(".torch", __name__)
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
