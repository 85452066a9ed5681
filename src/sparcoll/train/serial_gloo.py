"""gloo with one worker thread: the process group of plain DDP on a model with sparse gradients.

torch 2.13's gloo process group runs its collectives on two worker threads, so two of DDP's buckets
can be reduced at once. With sparse embedding gradients (each one a bucket of its own, reduced by
gloo's sparse all_reduce on a worker thread), DDP crashed in native code now and then: heap
corruption ("malloc(): unaligned tcache chunk detected", "free(): invalid pointer") or SIGSEGV, in
backward or in the next collective. Measured with ncf (tiny, sparse embeddings, 2 workers, 30 steps,
two busy loops taking the cores): 6 of 779 runs crashed with two worker threads, none of 629 with one
(docs/results/ddp-crash). With one thread the same gloo algorithms run one collective at a time.

The group is made through torch's public backend registry, as the "sparcoll" backend is, with the
devices gloo itself would take (GLOO_SOCKET_IFNAME's interfaces when it is set).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

NAME = "gloo_serial"


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._threads = 1
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    options._devices = ([dist.ProcessGroupGloo.create_device(interface=name) for name in interfaces]
                        or [dist.ProcessGroupGloo.create_default_device()])
    return dist.ProcessGroupGloo(store, rank, size, options)


def register() -> None:
    """Make NAME a torch.distributed backend (idempotent)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
