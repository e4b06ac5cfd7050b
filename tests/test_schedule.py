"""The learning-rate schedule as a pure function of the step, against torch's own schedulers."""

from __future__ import annotations

import pytest
import torch

from hetero_ray.config import parse_config
from hetero_ray.train.schedule import lr_at


def torch_rates(steps: int, lr: float, warmup: int, min_lr: float | None) -> list[float]:
    """The rate each step applies under LinearLR warm-up, then CosineAnnealingLR (or constant)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    after = (
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - 1 - warmup, eta_min=min_lr)
        if min_lr is not None
        else torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0)
    )
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup - 1)
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warm, after], milestones=[warmup])
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return rates


@pytest.mark.parametrize(("name", "min_lr"), [("cosine", 1e-4), ("constant", None)])
def test_rates_follow_torchs_warm_up_then_cosine_or_constant(name, min_lr):
    """Every step's rate as torch's schedulers give it; the cosine ends at min_lr on the last step."""
    schedule = {"name": name, "warmup_steps": 4} | ({"min_lr": min_lr} if min_lr is not None else {})
    train = parse_config({"devices": {"A100-80GB": 1}, "train": {"steps": 20, "lr": 1e-3, "lr_schedule": schedule}})
    ours = [lr_at(step, train.train) for step in range(20)]
    assert ours == pytest.approx(torch_rates(20, 1e-3, 4, min_lr), rel=1e-9)
    assert ours[3] == pytest.approx(1e-3) and ours[-1] == pytest.approx(min_lr or 1e-3)


def test_no_schedule_is_the_constant_rate():
    train = parse_config({"devices": {"A100-80GB": 1}, "train": {"steps": 5, "lr": 3e-4}}).train
    assert {lr_at(step, train) for step in range(5)} == {3e-4}
