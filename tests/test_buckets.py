"""The gradient engine (``train/buckets.py`` under ``train/sync.py::TorchAdam``) on real gloo ranks: buckets
reduced while the backward runs, gradients as views into them, the wire dtype, and the step all ranks skip."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from hetero_ray.config import parse_config
from hetero_ray.train.sync import TorchAdam

WIDTH, LAYERS = 256, 6
# Three layers' weights (256 × 256 fp32 each) per chunk: the model's 6 layers make 2 or more chunks.
BUCKET_MB = 3 * WIDTH * WIDTH * 4 / 2**20


def config(**train) -> object:
    return parse_config({"devices": {"A100-80GB": 2}, "train": {"global_batch": 8, "bucket_mb": BUCKET_MB, **train}})


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def one_step(rank: int, world: int, train: dict, poison: bool = False, samples: bool = True) -> dict:
    """One weighted step of a rank's half of a batch of 8: each rank's loss weighted by its share (rank 0 holds
    6 samples, rank 1 two), the last backward armed as the training loop arms it."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    net = model()
    sync = TorchAdam(net, config(**train), torch.device("cpu"), "fp32")
    flats = {c.flat.untyped_storage().data_ptr() for c in sync.grads.chunks}
    torch.manual_seed(1)
    x = torch.randn(8, WIDTH)
    mine = (x[:6] if rank == 0 else x[6:]).clone()
    if poison:
        mine[0, 0] = float("inf")  # the backward makes the gradients non-finite, as an overflow would
    before = [p.detach().clone() for p in net.parameters()]
    backward_done = None
    if samples:
        sync.arm()
        sync.backward(net(mine).pow(2).mean() * (len(mine) / 8))
        backward_done = time.perf_counter()
    views = all(p.grad.untyped_storage().data_ptr() in flats for p in net.parameters())
    synced = sync.step(0.0, False)
    return {
        "chunks": len(sync.grads.chunks),
        "launched": [x.at for x in synced.launches],
        "backward_done": backward_done,
        "bytes": synced.bytes_sent,
        "grad_bytes": sum(x.bytes_sent for x in synced.launches),
        "views": views,
        "still_views": all(p.grad.untyped_storage().data_ptr() in flats for p in net.parameters()),
        "changed": [not torch.equal(a, b) for a, b in zip(before, net.parameters())],
        "params": [p.detach().clone() for p in net.parameters()],
        "zeroed": all(not p.grad.any() for p in net.parameters()),
    }


def reference_step() -> list[torch.Tensor]:
    """One process, the whole batch of 8, the same AdamW step."""
    net = model()
    torch.manual_seed(1)
    x = torch.randn(8, WIDTH)
    net(x).pow(2).mean().backward()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
    opt.step()
    return [p.detach() for p in net.parameters()]


def test_buckets_go_on_the_wire_during_the_backward(tmp_path):
    """Several chunks, the first launched before the backward returned; gradients are views into the chunks
    before and after the step (no second copy), zeroed in place; the step is the one-process step (1e-5)."""
    out = run_ranks(one_step, 2, tmp_path, {})
    for r in out:
        assert r["chunks"] >= 2 and r["views"] and r["still_views"] and r["zeroed"]
        assert r["launched"][0] < r["backward_done"], r
        assert r["launched"] == sorted(r["launched"])
    for got, want in zip(out[0]["params"], reference_step()):
        assert (got - want).abs().max() <= 1e-5


def test_a_rank_without_samples_still_sums(tmp_path):
    """A rank that runs no backward (no samples this step) launches every chunk at the step: the others'
    armed all-reduces find it, and both ranks apply the same update."""
    idle = run_ranks(_one_idle, 2, tmp_path)
    assert all(all(r["changed"]) for r in idle)
    for a, b in zip(idle[0]["params"], idle[1]["params"]):
        assert torch.equal(a, b)


def _one_idle(rank: int, world: int) -> dict:
    return one_step(rank, world, {}, samples=rank == 0)


def test_half_width_wire_sends_half_the_bytes_and_keeps_fp32_gradients(tmp_path):
    """reduce_dtype bf16 halves the gradient bytes on the wire; the summed gradients come back to fp32 chunks,
    within bf16's rounding (8 bits of mantissa) of the fp32 sums."""
    fp32 = run_ranks(one_step, 2, tmp_path, {})
    bf16 = run_ranks(one_step, 2, tmp_path, {"reduce_dtype": "bf16"})
    assert bf16[0]["grad_bytes"] / fp32[0]["grad_bytes"] == pytest.approx(0.5)
    # After one AdamW step the parameters differ by at most lr × a bf16 rounding of the update's direction.
    for a, b in zip(fp32[0]["params"], bf16[0]["params"]):
        assert (a - b).abs().max() <= 2e-3


def test_ranks_skip_the_step_together_when_one_gradient_is_not_finite(tmp_path):
    """An inf on rank 1's gradient reaches every rank through the sum: nobody updates."""
    out = run_ranks(_poisoned, 2, tmp_path)
    assert not any(any(r["changed"]) for r in out)


def _poisoned(rank: int, world: int) -> dict:
    return one_step(rank, world, {}, poison=rank == 1)
