"""The interface every workload implements.

Sharding contract: a *global batch* of ``batch_size * world_size`` rows is a
pure function of ``(seed, step)`` and that total size; rank ``r`` takes rows
``r * batch_size : (r + 1) * batch_size``.  So the ranks of one step together
see exactly what a single process (``rank=0, world_size=1``) with batch size
``batch_size * world_size`` sees for that step, which lets distributed
training be checked against a single-process reference.  Every rank builds
the whole global batch and keeps its slice: cheap next to a training step,
and it needs no coordination.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from .data import step_rng

Batch = tuple[torch.Tensor, ...]
"""Tensors that share their first (row) dimension."""


class Workload:
    """A model plus a deterministic, shardable data source.

    Attributes:
        name: registry name.
        model: the ``nn.Module`` to train, initialised from the factory's seed.
        config: the frozen dataclass of sizes and options actually used (sizes
            read from a data file replace the configured ones).
        sparse_params: names of the parameters that get row-sparse gradients:
            ``torch.sparse_coo`` tensors when ``sparse_embeddings`` is true,
            otherwise dense tensors that are zero outside the rows looked up.
    """

    name: str

    def __init__(self, model: nn.Module, config, sparse_params: tuple[str, ...]):
        self.model = model
        self.config = config
        self.sparse_params = sparse_params

    @property
    def sparse_embeddings(self) -> bool:
        return self.config.sparse_embeddings

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        """Draw ``n`` rows; all randomness must come from ``rng``."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean loss of ``model`` on ``batch`` (``model`` may be a DDP wrapper)."""
        raise NotImplementedError

    def global_batch(self, step: int, batch_size: int, world_size: int = 1, seed: int = 0) -> Batch:
        """All ``batch_size * world_size`` rows of ``step``."""
        return self.sample(step_rng(seed, step), batch_size * world_size)

    def batches(
        self, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, start_step: int = 0
    ) -> Iterator[Batch]:
        """Endless stream of this rank's slice of each step's global batch."""
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size=}, {rank=}, {world_size=}"
            )
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return (
            tuple(t[rows] for t in self.global_batch(step, batch_size, world_size, seed))
            for step in itertools.count(start_step)
        )


class NextTokenWorkload(Workload):
    """A language model on token windows: the loss is each next token's cross-entropy, and its
    embedding's gradient is row-sparse unless the softmax is tied to it."""

    def __init__(self, model: nn.Module, config):
        super().__init__(model, config, () if config.tie_weights else ("embedding.weight",))

    @staticmethod
    def refuse_sparse_tied(config) -> None:
        if config.tie_weights and config.sparse_embeddings:
            raise ValueError("a tied softmax makes the embedding gradient dense: sparse_embeddings needs "
                             "tie_weights=False")

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        (tokens,) = batch
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@contextlib.contextmanager
def seeded(seed: int):
    """Make model construction deterministic without disturbing the caller's
    global torch RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def relu_mlp(widths) -> nn.Sequential:
    """Linear+ReLU layers through ``widths``.  Biases start at zero (as in the
    Keras/TF NeuMF and DeepFM code): with small embedding inputs, random
    biases would fix each unit on or off for the whole batch and fake
    sparsity in the MLP gradients."""
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
        nn.init.zeros_(layers[-2].bias)
    return nn.Sequential(*layers)


def make_config(config_cls, tiny_overrides: dict, tiny: bool, overrides: dict):
    """``config_cls`` defaults, then the tiny preset if asked, then overrides
    (an unknown key is a ``TypeError``)."""
    return config_cls(**{**(tiny_overrides if tiny else {}), **overrides})
