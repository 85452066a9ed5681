"""Recommendation model with narrow embedding rows: sparse gradients at a fine granularity.

Model: one ``nn.Embedding`` table per id column (default two, a million rows each, as users and
items), rows of ``embedding_dim`` elements (16, 32 or 64; default 32), the looked-up rows
concatenated into an MLP (default 64-32) and a final linear layer, BCE-with-logits.  About 64M
parameters, all but a few thousand in the tables: the gradient is large, but a step touches few
rows, and each touched row is only ``embedding_dim`` elements long, shorter than a 256-element
block.  ``sparse_params`` are the tables (``tables.0.weight``, ...), with ``torch.sparse_coo``
gradients when ``sparse_embeddings=True``.  With DDP on gloo, 4 workers of 256 samples and a
1 Gbit/s link, a step took about 3.8-4.0 s, 85-86% of it communication (two runs).

Data: synthetic only.  Each column's ids are Zipf-distributed by popularity rank, scattered over
its table by a fixed permutation (real ids are not sorted by popularity).  Every popularity rank
falls in one of ``taste_groups`` groups; the label is drawn from a fixed random logistic teacher: an effect
of each column's group plus an interaction of the groups of each pair of columns, so the embeddings
of popular ids and the MLP have something to learn.

Batches are ``(ids [n, num_tables] int64, labels [n] float32)``, drawn i.i.d. per ``(seed, step)``
and sliced per rank as described in ``workloads.base``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Batch, Workload, make_config, relu_mlp, seeded
from .data import zipf


@dataclass(frozen=True)
class Config:
    sparse_embeddings: bool = False
    table_rows: tuple[int, ...] = (1_000_000, 1_000_000)  # one table per id column
    embedding_dim: int = 32
    hidden: tuple[int, ...] = (64, 32)
    zipf_exponent: float = 1.1
    taste_groups: int = 16
    data_seed: int = 0  # fixes the id scattering and the teacher


TINY = dict(table_rows=(200, 100), embedding_dim=4, hidden=(8,))


class NarrowRecModel(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        sparse = cfg.sparse_embeddings
        # nn.Embedding's N(0, 1) initialisation: with NeuMF's N(0, 0.01) the rows and the MLP start
        # near a saddle and plain SGD hardly moves the loss in 200 steps.
        self.tables = nn.ModuleList(nn.Embedding(rows, cfg.embedding_dim, sparse=sparse) for rows in cfg.table_rows)
        widths = (len(cfg.table_rows) * cfg.embedding_dim, *cfg.hidden)
        self.mlp = relu_mlp(widths).append(nn.Linear(widths[-1], 1))
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[n]`` for ``ids [n, num_tables]``."""
        rows = [table(ids[:, i]) for i, table in enumerate(self.tables)]
        return self.mlp(torch.cat(rows, 1)).squeeze(1)


class NarrowRec(Workload):
    name = "narrowrec"

    def __init__(self, data: str | Path | None, seed: int, cfg: Config):
        if data is not None:
            raise ValueError("the narrowrec workload has synthetic data only")
        if len(cfg.table_rows) < 2:
            raise ValueError(f"need at least two tables, got table_rows={cfg.table_rows}")
        rng = np.random.default_rng(cfg.data_seed)
        self.perms = [rng.permutation(rows) for rows in cfg.table_rows]
        self.pairs = list(itertools.combinations(range(len(cfg.table_rows)), 2))
        groups = cfg.taste_groups
        self.effect = rng.normal(0, 1.0, (len(cfg.table_rows), groups))
        self.affinity = rng.normal(0, 1.5 / np.sqrt(len(self.pairs)), (len(self.pairs), groups, groups))
        with seeded(seed):
            model = NarrowRecModel(cfg)
        super().__init__(model, cfg, tuple(f"tables.{i}.weight" for i in range(len(cfg.table_rows))))

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        cfg = self.config
        ranks = zipf(rng, cfg.table_rows, (n, len(cfg.table_rows)), cfg.zipf_exponent)
        groups = ranks % cfg.taste_groups
        logit = sum(self.effect[i][groups[:, i]] for i in range(len(cfg.table_rows)))
        logit += sum(self.affinity[k][groups[:, a], groups[:, b]] for k, (a, b) in enumerate(self.pairs))
        labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        ids = np.stack([perm[ranks[:, i]] for i, perm in enumerate(self.perms)], 1)
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        ids, labels = batch
        return F.binary_cross_entropy_with_logits(model(ids), labels)


def make(data: str | Path | None = None, seed: int = 0, tiny: bool = False, **overrides) -> NarrowRec:
    return NarrowRec(data, seed, make_config(Config, TINY, tiny, overrides))
