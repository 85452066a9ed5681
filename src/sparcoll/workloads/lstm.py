"""LSTM language model workload with a large vocabulary.

Model: embedding -> multi-layer LSTM -> full softmax over the vocabulary,
cross-entropy on next-token prediction.  Defaults: vocab 50,000 x 200, two
LSTM layers of 200, ``bptt`` 35, about 10.7M parameters (tied).

Tied softmax (``tie_weights=True``, the default): the decoder reuses the
embedding matrix.  The softmax then gives every row of it a gradient, so the
gradient is dense whatever the embedding does; ``sparse_embeddings=True``
requires ``tie_weights=False`` (the input embedding then gets a row-sparse
COO gradient and the separate decoder a dense one), and a tied model lists
no ``sparse_params``.

Data: a plain-text file (``read_text``: whitespace tokens, ids by descending
frequency, vocab capped, rest mapped to ``<unk>``; the vocab then fixes the
table size) or, by default, a synthetic Zipf token stream in which, with
probability ``follow_prob``, a token is instead the fixed successor of the
previous one, so the LSTM has context to learn.  Both keep frequent words at
low ids, like a frequency-sorted vocabulary.

Batches are ``(tokens [n, bptt + 1] int64,)``: independent windows (random
offsets into the file, or fresh synthetic sequences) drawn per
``(seed, step)``, sliced per rank as described in ``workloads.base``.  No
hidden state is carried between batches, so rows are interchangeable.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .base import Batch, NextTokenWorkload, make_config, seeded
from .data import zipf

UNK = "<unk>"


@dataclass(frozen=True)
class Config:
    sparse_embeddings: bool = False
    vocab_size: int = 50_000  # a cap when reading a file
    embed_dim: int = 200
    hidden_dim: int = 200
    num_layers: int = 2
    bptt: int = 35
    tie_weights: bool = True
    zipf_exponent: float = 1.0
    follow_prob: float = 0.5
    data_seed: int = 0  # fixes the synthetic successor table


TINY = dict(vocab_size=64, embed_dim=16, hidden_dim=16, num_layers=1, bptt=8)


def read_text(path: str | Path, vocab_size: int) -> tuple[np.ndarray, list[str]]:
    """Whitespace-tokenize a UTF-8 file into ids.

    The vocabulary is ``<unk>`` (id 0) plus the ``vocab_size - 1`` most
    frequent words, by descending count then alphabetically.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        words = f.read().split()
    if not words:
        raise ValueError(f"{path}: no tokens")
    counts = collections.Counter(words)
    vocab = [UNK] + sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - 1]
    index = {w: i for i, w in enumerate(vocab)}
    return np.fromiter((index.get(w, 0) for w in words), np.int64, len(words)), vocab


class LanguageModel(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.embed_dim, sparse=cfg.sparse_embeddings)
        self.lstm = nn.LSTM(cfg.embed_dim, cfg.hidden_dim, cfg.num_layers, batch_first=True)
        self.decoder = nn.Linear(cfg.hidden_dim, cfg.vocab_size)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if cfg.tie_weights:
            self.decoder.weight = self.embedding.weight
        else:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[n, t, vocab]`` for ``tokens [n, t]``."""
        return self.decoder(self.lstm(self.embedding(tokens))[0])


class LSTMWorkload(NextTokenWorkload):
    name = "lstm"

    def __init__(self, data: str | Path | None, seed: int, cfg: Config):
        self.refuse_sparse_tied(cfg)
        if cfg.tie_weights and cfg.embed_dim != cfg.hidden_dim:
            raise ValueError(f"tie_weights needs embed_dim == hidden_dim, got {cfg.embed_dim} and {cfg.hidden_dim}")
        if data is None:
            self.tokens = None
            rng = np.random.default_rng(cfg.data_seed)
            self.successor = zipf(rng, cfg.vocab_size, cfg.vocab_size, cfg.zipf_exponent)
        else:
            self.tokens, vocab = read_text(data, cfg.vocab_size)
            if len(self.tokens) < cfg.bptt + 1:
                raise ValueError(f"{data}: {len(self.tokens)} tokens, need at least bptt + 1 = {cfg.bptt + 1}")
            cfg = dataclasses.replace(cfg, vocab_size=len(vocab))
        with seeded(seed):
            model = LanguageModel(cfg)
        super().__init__(model, cfg)

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        cfg = self.config
        if self.tokens is not None:
            starts = rng.integers(0, len(self.tokens) - cfg.bptt, n)
            tokens = self.tokens[starts[:, None] + np.arange(cfg.bptt + 1)]
        else:
            tokens = zipf(rng, cfg.vocab_size, (n, cfg.bptt + 1), cfg.zipf_exponent)
            follow = rng.random((n, cfg.bptt + 1)) < cfg.follow_prob
            for t in range(1, cfg.bptt + 1):  # a chain: vectorized over rows, sequential in time
                tokens[:, t] = np.where(follow[:, t], self.successor[tokens[:, t - 1]], tokens[:, t])
        return (torch.from_numpy(tokens),)


def make(data: str | Path | None = None, seed: int = 0, tiny: bool = False, **overrides) -> LSTMWorkload:
    return LSTMWorkload(data, seed, make_config(Config, TINY, tiny, overrides))
