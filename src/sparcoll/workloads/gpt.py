"""GPT-style decoder language model on real English text: a dense, communication-bound case.

Model: token and learned position embeddings, ``num_layers`` pre-LayerNorm decoder blocks (causal
multi-head self-attention, GELU MLP of 4x the width), a final LayerNorm and a softmax over the
vocabulary, cross-entropy on next-token prediction, no dropout.  Defaults: 4 layers of width 384,
6 heads, 32-token sequences; with the default text's vocabulary of 9,452 tokens about 10.7M
parameters, 3.63M of them in the embedding.

Communication-bound only with few tokens per worker: computation grows with parameters x tokens,
a ring AllReduce with parameters alone.  With DDP on gloo, 4 workers on 2 CPU cores shared with
other work and a 1 Gbit/s link, one 32-token sequence per worker (``--batch-size 1``) gave steps of
0.7-0.8 s, 68-78% of them communication over five runs (78% when the machine was quietest); 64
tokens per worker (2 x 32 or 1 x 64) 58-76% over ten runs, 4 x 64 tokens 47%.

Tied softmax (``tie_weights=True``, the default): the output layer reuses the token embedding, so
its gradient is dense; as for the ``lstm`` workload, ``sparse_embeddings=True`` requires
``tie_weights=False`` (the token embedding then gets a row-sparse COO gradient, the separate output
layer a dense one) and a tied model lists no ``sparse_params``.

Data: the English text of Python's own documentation topics (``pydoc_data.topics``, about 465 KB,
in every CPython install; the topics joined in key order) by default, or a UTF-8 plain-text file
(``data=PATH``).  The text is cut at the first newline after ``1 - eval_fraction`` of its
characters: the part before is the training split, the part after the held-out split.  The
tokenizer (``WordTokenizer``) is built from the training split alone: ids 0-255 are the bytes,
then whitespace-separated words, each with its leading space if it has one, and runs of whitespace,
by descending count then alphabetically, up to ``vocab_size`` in all.  A piece outside the
vocabulary is spelled in bytes, so ``decode(encode(text)) == text`` for any text.  The vocabulary
then fixes the table size (pydoc's training split has 9,196 distinct pieces longer than a byte:
9,452 tokens).

Batches are ``(tokens [n, seq_len + 1] int64,)``: windows at random offsets into the training
split, drawn per ``(seed, step)`` and sliced per rank as described in ``workloads.base``.
``eval_batch()`` gives the held-out split as consecutive non-overlapping windows and
``eval_loss(model)`` the mean loss over them (no gradient).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Batch, NextTokenWorkload, make_config, seeded

PIECE = re.compile(r" ?\S+|\s+(?!\S)|\s+")  # a word with its leading space, or a whitespace run (GPT-2's rule)


@dataclass(frozen=True)
class Config:
    sparse_embeddings: bool = False
    vocab_size: int = 16_384  # a cap: 256 bytes plus the most frequent pieces of the training split
    width: int = 384
    num_layers: int = 4
    num_heads: int = 6
    seq_len: int = 32  # short, to keep a step communication-bound (see the module docstring)
    tie_weights: bool = True
    eval_fraction: float = 0.1  # the end of the text held out for evaluation


TINY = dict(vocab_size=320, width=16, num_layers=1, num_heads=2, seq_len=8)


class WordTokenizer:
    """Word-level tokenizer with byte fallback: ids 0-255 are the bytes, ``256 + i`` is ``pieces[i]``."""

    def __init__(self, pieces: list[str]):
        self.pieces = list(pieces)
        self.index = {p: 256 + i for i, p in enumerate(self.pieces)}

    @classmethod
    def build(cls, text: str, vocab_size: int) -> WordTokenizer:
        """The ``vocab_size - 256`` most frequent pieces of ``text`` that are not a single byte."""
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be at least 256 (the bytes), got {vocab_size}")
        counts = collections.Counter(PIECE.findall(text))
        pieces = sorted((p for p in counts if len(p.encode()) > 1), key=lambda p: (-counts[p], p))
        return cls(pieces[: vocab_size - 256])

    def __len__(self) -> int:
        return 256 + len(self.pieces)

    def encode(self, text: str) -> np.ndarray:
        ids = []
        for piece in PIECE.findall(text):
            i = self.index.get(piece)
            if i is None:
                ids.extend(piece.encode())
            else:
                ids.append(i)
        return np.asarray(ids, np.int64)

    def decode(self, ids) -> str:
        out = bytearray()
        for i in np.asarray(ids).tolist():
            out += bytes((i,)) if i < 256 else self.pieces[i - 256].encode()
        return out.decode("utf-8", errors="replace")


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def split_text(text: str, eval_fraction: float) -> tuple[str, str]:
    """Cut at the first newline after ``1 - eval_fraction`` of the characters (the end if none)."""
    cut = text.find("\n", int(len(text) * (1 - eval_fraction)))
    return (text, "") if cut < 0 else (text[:cut], text[cut:])


@functools.lru_cache(maxsize=8)
def _pydoc_corpus(vocab_size: int, eval_fraction: float):
    return corpus(pydoc_text(), vocab_size, eval_fraction)


def corpus(text: str, vocab_size: int, eval_fraction: float) -> tuple[WordTokenizer, np.ndarray, np.ndarray]:
    """``(tokenizer, training ids, held-out ids)`` of ``text``, the tokenizer built from the training split."""
    train, held_out = split_text(text, eval_fraction)
    tokenizer = WordTokenizer.build(train, vocab_size)
    return tokenizer, tokenizer.encode(train), tokenizer.encode(held_out)


class Block(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention, then the MLP, each around a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.width, sparse=cfg.sparse_embeddings)
        self.position = nn.Parameter(torch.zeros(cfg.seq_len, cfg.width))
        self.blocks = nn.Sequential(*(Block(cfg.width, cfg.num_heads) for _ in range(cfg.num_layers)))
        self.ln = nn.LayerNorm(cfg.width)
        self.decoder = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        # GPT-2's initialisation: N(0, 0.02), residual projections scaled down by sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.num_layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
        if cfg.tie_weights:
            self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[n, t, vocab]`` for ``tokens [n, t]``, ``t <= seq_len``."""
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        return self.decoder(self.ln(self.blocks(x)))


class GPTWorkload(NextTokenWorkload):
    name = "gpt"

    def __init__(self, data: str | Path | None, seed: int, cfg: Config):
        self.refuse_sparse_tied(cfg)
        if cfg.width % cfg.num_heads:
            raise ValueError(f"width {cfg.width} is not a multiple of num_heads {cfg.num_heads}")
        if not 0 < cfg.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {cfg.eval_fraction}")
        if data is None:
            self.tokenizer, self.train_tokens, self.eval_tokens = _pydoc_corpus(cfg.vocab_size, cfg.eval_fraction)
            source = "pydoc_data.topics"
        else:
            with open(data, encoding="utf-8", errors="replace") as f:
                text = f.read()
            self.tokenizer, self.train_tokens, self.eval_tokens = corpus(text, cfg.vocab_size, cfg.eval_fraction)
            source = str(data)
        for split, tokens in (("training", self.train_tokens), ("held-out", self.eval_tokens)):
            if len(tokens) < cfg.seq_len + 1:
                raise ValueError(
                    f"{source}: {split} split has {len(tokens)} tokens, need seq_len + 1 = {cfg.seq_len + 1}"
                )
        cfg = dataclasses.replace(cfg, vocab_size=len(self.tokenizer))
        with seeded(seed):
            model = GPT(cfg)
        super().__init__(model, cfg)

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        window = self.config.seq_len + 1
        starts = rng.integers(0, len(self.train_tokens) - window + 1, n)
        return (torch.from_numpy(self.train_tokens[starts[:, None] + np.arange(window)]),)

    def eval_batch(self, max_windows: int | None = None) -> Batch:
        """The held-out split as consecutive non-overlapping windows of ``seq_len + 1`` tokens (the first
        ``max_windows`` if given)."""
        window = self.config.seq_len + 1
        count = len(self.eval_tokens) // window
        if max_windows is not None:
            count = min(count, max_windows)
        return (torch.from_numpy(self.eval_tokens[: count * window].reshape(count, window)),)

    def eval_loss(self, model: nn.Module | None = None, max_windows: int | None = None) -> float:
        """Mean next-token loss of ``model`` (default: this workload's) on the held-out windows."""
        with torch.no_grad():
            return self.loss(self.model if model is None else model, self.eval_batch(max_windows)).item()


def make(data: str | Path | None = None, seed: int = 0, tiny: bool = False, **overrides) -> GPTWorkload:
    return GPTWorkload(data, seed, make_config(Config, TINY, tiny, overrides))
