"""The learning rate of each step, a pure function of the step: a resumed or re-planned run continues the
schedule exactly where it was, with nothing to checkpoint."""

from __future__ import annotations

import math

import torch

from hetero_ray.config import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The rate step ``step`` (from 0) applies: ``train.lr`` × (step + 1) / warm-up during the warm-up, then
    ``train.lr`` (constant) or a cosine from ``train.lr`` down to ``min_lr`` at the last step (as
    ``torch.optim.lr_scheduler.LinearLR`` then ``CosineAnnealingLR`` over the steps after the warm-up)."""
    schedule = train.lr_schedule
    warmup = schedule.warmup_steps
    if step < warmup:
        return train.lr * (step + 1) / warmup
    if schedule.name == "constant":
        return train.lr
    progress = (step - warmup) / max(1, train.steps - 1 - warmup)
    return schedule.min_lr + (train.lr - schedule.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The rate ``optimizer``'s next step applies (torch's AdamW and DeepSpeed's 1-bit optimizers alike)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
