"""DeepLight-style CTR workload: a DeepFM on Criteo-shaped data.

Model: 26 categorical fields hashed into one concatenated embedding table
(field ``f`` owns ``min(cardinality_f, hash_size) + 1`` rows, the first for a
missing value), 13 dense features each scaling a learned vector, FM
first- and second-order terms plus an MLP over all 39 field vectors, trained
with BCE-with-logits.  The defaults (Criteo Kaggle cardinalities, hash cap
2^17, dim 16, MLP 400-400-400) give 18.6M parameters, 16.9M of them in the
second-order embedding table.

Data: a Criteo TSV file (``read_criteo``) or, by default, synthetic rows whose
per-field raw values are Zipf-distributed over the Criteo cardinalities and
hashed exactly as file values are; labels come from a fixed random logistic
teacher, linear in the table rows and dense features and centred to give
about 28% positives (Criteo: 26%), so the loss can go down.

Batches are ``(ids [n, 26] int64 table rows, dense [n, 13] float32,
labels [n] float32)``, drawn i.i.d. per ``(seed, step)`` (file rows uniformly
with replacement) and sliced per rank as described in ``workloads.base``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Batch, Workload, make_config, relu_mlp, seeded
from .data import hash64, malformed, zipf

NUM_DENSE = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL  # per TSV line, label first
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # distinct values per field in Criteo Kaggle (as used by DLRM)


@dataclass(frozen=True)
class Config:
    sparse_embeddings: bool = False
    embed_dim: int = 16
    hash_size: int = 2**17  # cap on hashed rows per field
    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    hidden: tuple[int, ...] = (400, 400, 400)
    zipf_exponent: float = 1.15
    data_seed: int = 0  # fixes the synthetic teacher
    max_rows: int | None = None  # read at most this many file rows


TINY = dict(embed_dim=4, hash_size=32, hidden=(16,))


def field_rows(cfg: Config) -> np.ndarray:
    """Rows per field: the hashed values plus one row for "missing"."""
    return np.minimum(np.asarray(cfg.cardinalities, np.int64), cfg.hash_size) + 1


def table_ids(raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Map raw categorical values ``[n, 26]`` (negative = missing) to rows of
    the concatenated table."""
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]])
    field = np.arange(raw.shape[1], dtype=np.uint64)
    hashed = 1 + (hash64(raw, field) % (rows - 1).astype(np.uint64)).astype(np.int64)
    return offsets + np.where(raw < 0, 0, hashed)


def read_criteo(path: str | Path, max_rows: int | None = None):
    """Parse a Criteo TSV: ``label \\t 13 ints \\t 26 hex strings`` per line.

    Empty dense fields read as 0 and empty categorical fields as missing (-1).
    Returns ``(labels [n] float32, dense [n, 13] float32 = log1p(max(x, 0)),
    raw [n, 26] int64)``; a malformed line raises ``ValueError`` naming the
    file and line.
    """
    labels, dense, raw = [], [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if max_rows is not None and len(labels) >= max_rows:
                break
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) != NUM_FIELDS:
                raise malformed(path, lineno, f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
            try:
                label = int(fields[0])
                ints = [int(x) if x else 0 for x in fields[1 : 1 + NUM_DENSE]]
                cats = [int(x, 16) & 0x7FFFFFFFFFFFFFFF if x else -1 for x in fields[1 + NUM_DENSE :]]
            except ValueError as e:
                raise malformed(path, lineno, str(e)) from None
            if label not in (0, 1):
                raise malformed(path, lineno, f"label must be 0 or 1, got {label}")
            labels.append(label)
            dense.append(ints)
            raw.append(cats)
    if not labels:
        raise ValueError(f"{path}: no rows")
    dense = np.log1p(np.maximum(np.asarray(dense, np.float64), 0)).astype(np.float32)
    return np.asarray(labels, np.float32), dense, np.asarray(raw, np.int64)


class DeepFM(nn.Module):
    """FM (first + second order) plus an MLP, sharing the field embeddings."""

    def __init__(self, num_rows: int, cfg: Config):
        super().__init__()
        d = cfg.embed_dim
        self.embedding = nn.Embedding(num_rows, d, sparse=cfg.sparse_embeddings)
        self.linear = nn.Embedding(num_rows, 1, sparse=cfg.sparse_embeddings)
        nn.init.normal_(self.embedding.weight, std=0.01)
        nn.init.normal_(self.linear.weight, std=0.01)
        self.dense_embedding = nn.Parameter(torch.randn(NUM_DENSE, d) * 0.01)
        self.dense_linear = nn.Parameter(torch.zeros(NUM_DENSE))
        self.bias = nn.Parameter(torch.zeros(()))
        widths = [(NUM_CATEGORICAL + NUM_DENSE) * d, *cfg.hidden]
        self.mlp = relu_mlp(widths).append(nn.Linear(widths[-1], 1))
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        v = torch.cat([self.embedding(ids), dense.unsqueeze(-1) * self.dense_embedding], 1)  # [n, 39, d]
        first = self.linear(ids).sum((1, 2)) + dense @ self.dense_linear + self.bias
        second = 0.5 * (v.sum(1).square() - v.square().sum(1)).sum(1)
        return first + second + self.mlp(v.flatten(1)).squeeze(1)


class DeepLight(Workload):
    name = "deeplight"

    def __init__(self, data: str | Path | None, seed: int, cfg: Config):
        if len(cfg.cardinalities) != NUM_CATEGORICAL:
            raise ValueError(f"need {NUM_CATEGORICAL} cardinalities, got {len(cfg.cardinalities)}")
        self.rows = field_rows(cfg)
        num_rows = int(self.rows.sum())
        with seeded(seed):
            model = DeepFM(num_rows, cfg)
        super().__init__(model, cfg, ("embedding.weight", "linear.weight"))
        if data is None:
            self.file = None
            rng = np.random.default_rng(cfg.data_seed)
            self.teacher_ids = rng.normal(0, 0.3, num_rows).astype(np.float32)
            self.teacher_dense = rng.normal(0, 0.2, NUM_DENSE).astype(np.float32)
            # Centre the teacher on the data so that about a quarter of the labels are positive.
            self.teacher_bias = np.float32(-1.3) - self._teacher_logit(*self._features(rng, 4096)).mean()
        else:
            labels, dense, raw = read_criteo(data, cfg.max_rows)
            self.file = (table_ids(raw, self.rows), dense, labels)

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        if self.file is not None:
            rows = rng.integers(0, len(self.file[0]), n)
            ids, dense, labels = (a[rows] for a in self.file)
        else:
            ids, dense = self._features(rng, n)
            logit = self.teacher_bias + self._teacher_logit(ids, dense)
            labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return torch.from_numpy(ids), torch.from_numpy(dense), torch.from_numpy(labels)

    def _features(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        raw = zipf(rng, self.config.cardinalities, (n, NUM_CATEGORICAL), self.config.zipf_exponent)
        dense = np.log1p(np.floor(rng.lognormal(0.5, 1.5, (n, NUM_DENSE)))).astype(np.float32)
        return table_ids(raw, self.rows), dense

    def _teacher_logit(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        return self.teacher_ids[ids].sum(1) + dense @ self.teacher_dense

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        ids, dense, labels = batch
        return F.binary_cross_entropy_with_logits(model(ids, dense), labels)


def make(data: str | Path | None = None, seed: int = 0, tiny: bool = False, **overrides) -> DeepLight:
    return DeepLight(data, seed, make_config(Config, TINY, tiny, overrides))
