"""Neural collaborative filtering workload (NeuMF: GMF + MLP).

Task: implicit feedback, as in the NeuMF paper and MLPerf NCF.  Every rating
counts as a positive (user, item) interaction; each batch row is one positive
plus ``num_negatives`` items drawn uniformly (not filtered against the
user's history), scored with BCE-with-logits.  Defaults follow NeuMF
(predictive factors 8, MLP 64-32-16-8) at MovieLens-20M scale
(138,493 users x 26,744 items), about 6.6M parameters, nearly all in the
four embedding tables.

Data: a MovieLens ``ratings.csv`` / ``ratings.dat`` (``read_movielens``; ids
remapped to dense indices, which then fix the table sizes) or, by default,
synthetic interactions: Zipf-active users, Zipf-popular items, half of the
items drawn from a popularity ranking shifted per user group so user
embeddings have something to learn.  Users and items are scattered over the
tables by fixed permutations, as real ids are not sorted by popularity.

Batches are ``(users [n] int64, items [n, 1 + num_negatives] int64)`` with
the positive item in column 0, drawn i.i.d. per ``(seed, step)`` (file
interactions uniformly with replacement) and sliced per rank as described in
``workloads.base``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Batch, Workload, make_config, relu_mlp, seeded
from .data import malformed, zipf

TASTE_GROUPS = 16  # synthetic users fall into this many groups with shifted item preferences
CSV_HEADER = "userId,movieId,rating,timestamp"


@dataclass(frozen=True)
class Config:
    sparse_embeddings: bool = False
    num_users: int = 138_493  # ignored when reading a file
    num_items: int = 26_744  # ignored when reading a file
    mf_dim: int = 8
    mlp_layers: tuple[int, ...] = (64, 32, 16, 8)  # the first is the concatenated embedding width
    num_negatives: int = 4
    user_zipf: float = 0.8
    item_zipf: float = 1.1
    data_seed: int = 0  # fixes the synthetic users' and items' id scattering
    max_rows: int | None = None  # read at most this many file rows


TINY = dict(num_users=50, num_items=40, mf_dim=4, mlp_layers=(8, 4))


def read_movielens(path: str | Path, max_rows: int | None = None):
    """Parse MovieLens ratings: ``.dat`` is ``UserID::MovieID::Rating::Timestamp``,
    anything else is CSV with the ``userId,movieId,rating,timestamp`` header.

    Returns ``(users, items, num_users, num_items)`` with ids remapped to dense
    indices in increasing id order; a malformed line raises ``ValueError``
    naming the file and line.
    """
    sep = "::" if Path(path).suffix == ".dat" else ","
    users, items = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if sep == "," and lineno == 1 and line == CSV_HEADER:
                continue
            if max_rows is not None and len(users) >= max_rows:
                break
            fields = line.split(sep)
            if len(fields) != 4:
                raise malformed(path, lineno, f"expected 4 {sep!r}-separated fields, got {len(fields)}")
            try:
                user, item, _, _ = int(fields[0]), int(fields[1]), float(fields[2]), int(fields[3])
            except ValueError as e:
                raise malformed(path, lineno, str(e)) from None
            users.append(user)
            items.append(item)
    if not users:
        raise ValueError(f"{path}: no ratings")
    user_ids, users = np.unique(users, return_inverse=True)
    item_ids, items = np.unique(items, return_inverse=True)
    return users.astype(np.int64), items.astype(np.int64), len(user_ids), len(item_ids)


class NeuMF(nn.Module):
    """Generalized matrix factorization and an MLP, fused by a final linear layer."""

    def __init__(self, cfg: Config):
        super().__init__()
        half = cfg.mlp_layers[0] // 2
        sparse = cfg.sparse_embeddings
        self.user_gmf = nn.Embedding(cfg.num_users, cfg.mf_dim, sparse=sparse)
        self.item_gmf = nn.Embedding(cfg.num_items, cfg.mf_dim, sparse=sparse)
        self.user_mlp = nn.Embedding(cfg.num_users, half, sparse=sparse)
        self.item_mlp = nn.Embedding(cfg.num_items, half, sparse=sparse)
        for emb in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            nn.init.normal_(emb.weight, std=0.01)
        self.mlp = relu_mlp((2 * half, *cfg.mlp_layers[1:]))
        self.out = nn.Linear(cfg.mf_dim + cfg.mlp_layers[-1], 1)
        nn.init.zeros_(self.out.bias)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, k]`` for ``users [n]`` against ``items [n, k]``."""
        k = items.shape[1]
        gmf = self.user_gmf(users).unsqueeze(1) * self.item_gmf(items)
        user = self.user_mlp(users).unsqueeze(1).expand(-1, k, -1)
        mlp = self.mlp(torch.cat([user, self.item_mlp(items)], -1))
        return self.out(torch.cat([gmf, mlp], -1)).squeeze(-1)


class NCF(Workload):
    name = "ncf"

    def __init__(self, data: str | Path | None, seed: int, cfg: Config):
        if data is None:
            self.file = None
            rng = np.random.default_rng(cfg.data_seed)
            self.user_perm = rng.permutation(cfg.num_users)
            self.item_perm = rng.permutation(cfg.num_items)
        else:
            users, items, num_users, num_items = read_movielens(data, cfg.max_rows)
            self.file = (users, items)
            cfg = dataclasses.replace(cfg, num_users=num_users, num_items=num_items)
        with seeded(seed):
            model = NeuMF(cfg)
        names = ("user_gmf.weight", "item_gmf.weight", "user_mlp.weight", "item_mlp.weight")
        super().__init__(model, cfg, names)

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        cfg = self.config
        if self.file is not None:
            rows = rng.integers(0, len(self.file[0]), n)
            users, positives = (a[rows] for a in self.file)
        else:
            user_rank = zipf(rng, cfg.num_users, n, cfg.user_zipf)
            item_rank = zipf(rng, cfg.num_items, n, cfg.item_zipf)
            shift = (user_rank % TASTE_GROUPS) * (cfg.num_items // TASTE_GROUPS)
            item_rank = np.where(rng.random(n) < 0.5, (item_rank + shift) % cfg.num_items, item_rank)
            users, positives = self.user_perm[user_rank], self.item_perm[item_rank]
        negatives = rng.integers(0, cfg.num_items, (n, cfg.num_negatives))
        items = np.concatenate([positives[:, None], negatives], 1)
        return torch.from_numpy(users), torch.from_numpy(items)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        users, items = batch
        logits = model(users, items)
        labels = torch.zeros_like(logits)
        labels[:, 0] = 1
        return F.binary_cross_entropy_with_logits(logits, labels)


def make(data: str | Path | None = None, seed: int = 0, tiny: bool = False, **overrides) -> NCF:
    return NCF(data, seed, make_config(Config, TINY, tiny, overrides))
