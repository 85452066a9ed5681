"""Small ResNet on synthetic CIFAR-shaped images: the dense control case.

Model: a CIFAR ResNet (3x3 stem, stages of basic residual blocks with
BatchNorm, global average pooling, linear classifier), cross-entropy.  The
defaults (widths 16-32-64, 3 blocks per stage) are ResNet-20, about 0.27M
parameters, all with dense gradients; ``sparse_params`` is empty.

Data: synthetic only.  Each of the 10 classes has a fixed random 3x32x32
prototype; an image is its class prototype plus Gaussian noise.

Batches are ``(images [n, 3, s, s] float32, labels [n] int64)``, drawn per
``(seed, step)`` and sliced per rank as described in ``workloads.base``.
BatchNorm normalizes over each rank's slice, so unlike the other workloads
the distributed gradient only matches the single-process one with
``SyncBatchNorm`` (or in eval mode), and the running statistics differ per
rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .base import Batch, Workload, make_config, seeded


@dataclass(frozen=True)
class Config:
    sparse_embeddings: bool = False  # no embeddings: accepted so every workload takes it
    widths: tuple[int, ...] = (16, 32, 64)
    blocks_per_stage: int = 3
    image_size: int = 32
    num_classes: int = 10
    noise_std: float = 1.0
    data_seed: int = 0  # fixes the class prototypes


TINY = dict(widths=(4, 8), blocks_per_stage=1, image_size=8)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        w = cfg.widths
        self.stem = nn.Sequential(nn.Conv2d(3, w[0], 3, 1, 1, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU())
        blocks, cin = [], w[0]
        for i, cout in enumerate(w):
            for j in range(cfg.blocks_per_stage):
                blocks.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class CNN(Workload):
    name = "cnn"

    def __init__(self, data: str | Path | None, seed: int, cfg: Config):
        if data is not None:
            raise ValueError("the cnn workload has synthetic data only")
        rng = np.random.default_rng(cfg.data_seed)
        shape = (cfg.num_classes, 3, cfg.image_size, cfg.image_size)
        self.prototypes = rng.standard_normal(shape, dtype=np.float32)
        with seeded(seed):
            model = ResNet(cfg)
        super().__init__(model, cfg, ())

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        labels = rng.integers(0, self.config.num_classes, n)
        noise = rng.standard_normal((n, *self.prototypes.shape[1:]), dtype=np.float32)
        images = self.prototypes[labels] + np.float32(self.config.noise_std) * noise
        return torch.from_numpy(images), torch.from_numpy(labels)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)


def make(data: str | Path | None = None, seed: int = 0, tiny: bool = False, **overrides) -> CNN:
    return CNN(data, seed, make_config(Config, TINY, tiny, overrides))
