"""A small convolutional classifier with BatchNorm, on seeded synthetic images.

Its BatchNorm layers normalise over the whole batch, which is what makes a data-parallel split of a
batch change the training unless the statistics are shared (``train/batch_norm.py``). The images
need no download: image ``i`` is noise from a generator seeded by ``i``, plus a bright square in
quadrant ``i % 4``, its label.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hetero_ray.workloads.base import Workload

CLASSES = 4


class QuadrantImages(Dataset):
    """``samples`` images of ``channels`` × ``size`` × ``size``; label: the quadrant holding the square."""

    def __init__(self, samples: int, size: int, seed: int = 0, channels: int = 1):
        self.samples, self.size, self.seed, self.channels = samples, size, seed, channels

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        image = 0.5 * torch.randn(self.channels, self.size, self.size, generator=generator)
        label = i % CLASSES
        half = self.size // 2
        top, left = (label // 2) * half, (label % 2) * half
        image[:, top + half // 4 : top + 3 * half // 4, left + half // 4 : left + 3 * half // 4] += 1.0
        return image, torch.tensor(label)


def _conv_bn(channels_in: int, channels_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(),
    )


def build(*, width: int = 8, size: int = 16, samples: int = 4096) -> Workload:
    """Two conv-BatchNorm-ReLU blocks, global average pooling and a linear classifier."""
    model = nn.Sequential(
        _conv_bn(1, width, 1),
        _conv_bn(width, 2 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, CLASSES),
    )
    return Workload(
        model=model,
        loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        dataset=QuadrantImages(samples, size),
    )
