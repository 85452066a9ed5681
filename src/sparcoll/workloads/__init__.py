"""CPU training workloads for comparing communication libraries.

Each workload is a model plus a deterministic, rank-shardable data source::

    from sparcoll.workloads import get_workload, WORKLOADS
    wl = get_workload("ncf", data=None, seed=0, sparse_embeddings=True)
    for batch in wl.batches(batch_size=256, rank=r, world_size=4, seed=0):
        loss = wl.loss(wl.model, batch)

``data`` is a local file path (format per workload) or ``None`` for synthetic
data; ``seed`` fixes the model's initialisation; keyword overrides set fields
of the workload's ``Config`` (unknown names raise ``TypeError``), and
``tiny=True`` first applies a small preset meant for tests.  Every workload
accepts ``sparse_embeddings``: with it, embedding tables use ``sparse=True``
and the parameters named in ``wl.sparse_params`` get ``torch.sparse_coo``
gradients; without it those gradients are dense but zero outside the rows
the batch looked up.

Rank ``r`` of ``world_size`` gets rows ``r*bs:(r+1)*bs`` of a global batch
generated from ``(seed, step)`` (see ``workloads.base``), so concatenating
the ranks' batches of a step gives ``wl.global_batch(step, bs, world_size,
seed)``, which is also what ``batches(bs * world_size, 0, 1, seed)`` yields.

Workloads: ``deeplight`` (DeepFM CTR, Criteo TSV), ``ncf`` (NeuMF, MovieLens
ratings), ``lstm`` (language model, plain text), ``cnn`` (ResNet, dense control),
``narrowrec`` (recommendation model with narrow embedding rows, synthetic);
communication-bound dense models: ``vgg`` (Poseidon's VGG19-22K classifier head,
``.npz`` features) and ``gpt`` (decoder language model, pydoc's English text or
plain text).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from . import cnn, deeplight, gpt, lstm, narrowrec, ncf, vgg
from .base import Batch, Workload

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "deeplight": deeplight.make,
    "ncf": ncf.make,
    "lstm": lstm.make,
    "cnn": cnn.make,
    "narrowrec": narrowrec.make,
    "vgg": vgg.make,
    "gpt": gpt.make,
}


def get_workload(name: str, data: str | Path | None = None, seed: int = 0, **overrides) -> Workload:
    """Build workload ``name``; see the module docstring for the arguments."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](data=data, seed=seed, **overrides)


__all__ = ["WORKLOADS", "Batch", "Workload", "get_workload"]
