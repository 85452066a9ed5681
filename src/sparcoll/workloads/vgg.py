"""Poseidon's VGG19-22K classifier head, trained on input features: the dense, communication-bound case.

Model: the three fully connected layers of VGG19 with a 21,841-class ImageNet-22K softmax, as in
Poseidon (Zhang et al., ATC 2017): 25088 -> 4096 -> 4096 -> 21841, ReLU and dropout (p=0.5) after
each hidden layer, cross-entropy.  About 209M parameters, all with dense gradients (``sparse_params``
is empty): 836 MB of fp32 per copy, so a ring AllReduce at 1 Gbit/s takes about 10 s while the
computation for 32 samples per worker takes about 1 s on a CPU core.  The convolutional trunk
is left out: its input to this head (VGG's pool5, 512x7x7 = 25088 features) is the batch.

Memory: nothing is shrunk.  A training process holds the parameters, their gradients and DDP's
flat copy of the gradients (its buckets): 3 x 836 MB, about 2.5 GB, plus SGD momentum if the
optimizer keeps any (836 MB more).  ``sparcoll train`` uses plain SGD, and its gradient probes
add transient boolean masks (one byte per parameter).  Measured with ``sparcoll train --workload
vgg --workers 4 --comm ddp --batch-size 32``: at most 3.4 GB resident per worker, 13.3 GB for the
four, which fits in 24 GiB; momentum would bring the four to about 17 GB.

Time: alone on a CPU core a process computes a step of 32 samples in about 1 s (forward 0.3 s,
backward 0.7 s).  With DDP on gloo, 4 workers on 2 cores shared with other work and a 1 Gbit/s
link, a step took 14-17 s, 9.7-10.6 s of it communication: 62-67% over three runs at 32 samples
per worker, 67-71% at 8 or 16 (the ring moves 1.25 GB per worker and step; its gloo and kernel
work, not the batch, makes most of the remaining 4-6 s), 82% at 500 Mbit/s.

Data: a ``.npz`` file with ``features [N, input_dim]`` (float) and ``labels [N]`` (integers in
``[0, num_classes)``), e.g. pool5 features extracted from images, or by default synthetic features:
a Zipf-distributed label (class 0 the most frequent, as ImageNet-22K's classes are unbalanced)
picks a fixed random ``signal_rank``-dimensional class code, mapped to the features by a fixed
random linear projection, plus Gaussian noise.  Features are scaled to unit mean square per row,
at which plain SGD with learning rate 0.1 trains the full-size head (scaled to unit norm instead,
its loss hardly moves at that rate).

Batches are ``(features [n, input_dim] float32, labels [n] int64, keep [n, sum(hidden)] bool)``
drawn per ``(seed, step)`` and sliced per rank as described in ``workloads.base``.  ``keep`` is
the dropout mask of each row (hidden layer after hidden layer), drawn with the batch, so dropout
is a deterministic function of ``(seed, step)`` and the rows a rank holds: ranks together compute
exactly the single-process reference's gradient.  The model applies it only in training mode
(``model.eval()`` disables dropout, as ``nn.Dropout`` would).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Batch, Workload, make_config, seeded
from .data import zipf


@dataclass(frozen=True)
class Config:
    sparse_embeddings: bool = False  # no embeddings: accepted so every workload takes it
    input_dim: int = 25_088  # VGG pool5: 512 x 7 x 7; read from the file when there is one
    hidden: tuple[int, ...] = (4096, 4096)
    num_classes: int = 21_841  # ImageNet-22K (fall 2011)
    dropout: float = 0.5
    signal_rank: int = 64  # dimension of the synthetic class codes
    noise_std: float = 1.0  # noise relative to the class signal, before row scaling
    label_zipf: float = 1.0
    data_seed: int = 0  # fixes the synthetic class codes and projection


TINY = dict(input_dim=48, hidden=(32, 32), num_classes=10, signal_rank=8)


def read_features(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Load ``features [N, D]`` and ``labels [N]`` from an ``.npz`` file."""
    expected = "expected an .npz archive with arrays features [N, D] and labels [N]"
    try:
        loaded = np.load(path)
    except ValueError as exc:        # text, or a pickle, which is not loaded
        raise ValueError(f"{path}: not an .npz archive ({exc}); {expected}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: holds one array ({type(loaded).__name__}), not an archive; {expected}")
    with loaded as f:
        missing = {"features", "labels"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: missing array(s) {', '.join(sorted(missing))}")
        features, labels = f["features"].astype(np.float32), f["labels"]
    if features.ndim != 2 or labels.shape != (len(features),) or not len(features):
        raise ValueError(f"{path}: need features [N, D] and labels [N] with N >= 1, "
                         f"got {features.shape} and {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise ValueError(f"{path}: labels must be non-negative integers")
    return features, labels.astype(np.int64)


class ClassifierHead(nn.Module):
    """Linear + ReLU + dropout per hidden width, then the linear classifier."""

    def __init__(self, cfg: Config):
        super().__init__()
        widths = (cfg.input_dim, *cfg.hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.out = nn.Linear(widths[-1], cfg.num_classes)
        for layer in (*self.hidden, self.out):
            nn.init.zeros_(layer.bias)
        self.dropout = cfg.dropout

    def forward(self, features: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[n, num_classes]``; ``keep [n, sum(hidden)]`` is the dropout mask (training mode only)."""
        x, start = features, 0
        for layer in self.hidden:
            x = F.relu(layer(x))
            if self.training and keep is not None and self.dropout > 0:
                x = x * keep[:, start : start + x.shape[1]] / (1 - self.dropout)
            start += x.shape[1]
        return self.out(x)


class VGGHead(Workload):
    name = "vgg"

    def __init__(self, data: str | Path | None, seed: int, cfg: Config):
        if not 0 <= cfg.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {cfg.dropout}")
        if data is None:
            self.file = None
            rng = np.random.default_rng(cfg.data_seed)
            self.codes = rng.standard_normal((cfg.num_classes, cfg.signal_rank), dtype=np.float32)
            self.projection = rng.standard_normal((cfg.signal_rank, cfg.input_dim), dtype=np.float32)
            self.projection /= np.float32(np.sqrt(cfg.signal_rank))
        else:
            features, labels = read_features(data)
            self.file = (features, labels)
            cfg = dataclasses.replace(cfg, input_dim=features.shape[1],
                                      num_classes=max(cfg.num_classes, int(labels.max()) + 1))
        with seeded(seed):
            model = ClassifierHead(cfg)
        super().__init__(model, cfg, ())

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        cfg = self.config
        if self.file is not None:
            rows = rng.integers(0, len(self.file[0]), n)
            features, labels = (a[rows] for a in self.file)
        else:
            labels = zipf(rng, cfg.num_classes, n, cfg.label_zipf)
            features = self.codes[labels] @ self.projection
            features += np.float32(cfg.noise_std) * rng.standard_normal(features.shape, dtype=np.float32)
            features /= np.sqrt(np.mean(np.square(features), 1, keepdims=True))
        keep = rng.random((n, sum(cfg.hidden)), dtype=np.float32) >= cfg.dropout
        return torch.from_numpy(features), torch.from_numpy(labels), torch.from_numpy(keep)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        features, labels, keep = batch
        return F.cross_entropy(model(features, keep), labels)


def make(data: str | Path | None = None, seed: int = 0, tiny: bool = False, **overrides) -> VGGHead:
    return VGGHead(data, seed, make_config(Config, TINY, tiny, overrides))
