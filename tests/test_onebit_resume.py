"""1-bit optimizers resumed from a checkpoint (spawned gloo ranks, no Ray): the ranks stay together.

Two ranks train a small GPT with DeepSpeed's OnebitAdam or ZeroOneAdam through hetero-ray's
synchroniser. Rank 0's model and optimizer state after ``RESUME_AT`` steps is what a checkpoint
holds; every rank then builds a fresh model and synchroniser, loads it, and trains on, as a
restarted run does. DeepSpeed resets the compression errors on load, so the resumed run is
close to the uninterrupted one, not equal; but its ranks must hold the same parameters, as the
uninterrupted run's do (OnebitAdam bit for bit, ZeroOneAdam to rounding).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from hetero_ray.config import parse_config
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.sync import make_sync
from hetero_ray.workloads import build_workload

OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_bytes": 50_000}
GLOBAL_BATCH, STEPS, WARMUP, SEED = 8, 14, 4, 11
OPTIMIZERS = {
    "onebit_adam": {"freeze_step": WARMUP},
    # The variance interval doubles after every second update, so some warm-up steps compress gradients.
    "zero_one_adam": {"var_freeze_step": WARMUP, "var_update_scaler": 2},
}
# After the warm-up (compressed), and inside it: for ZeroOneAdam before a variance step (its
# interval is then 4) and before a compressed-gradient one.
RESUME_AT = (9, 3, 2)


def train(rank: int, optimizer: str, steps: range, state: tuple[dict, dict] | None) -> dict:
    """Train ``steps`` from a fresh model (``state``: a checkpoint's model and optimizer state to load first);
    the losses, every rank's parameters, and rank 0's state as a checkpoint holds it."""
    cfg = parse_config(
        {
            "devices": {"A100-80GB": 2},
            "train": {"global_batch": GLOBAL_BATCH, "lr": 3e-3, "seed": SEED, "steps": STEPS},
            "optimizer": {"name": optimizer, "betas": [0.9, 0.95], **OPTIMIZERS[optimizer]},
        }
    )
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    model = workload.model
    if state is not None:
        model.load_state_dict(state[0])
    sync = make_sync(model, cfg, torch.device("cpu"), "fp32")
    if state is not None:
        sync.load_state_dict(state[1])
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    share = GLOBAL_BATCH // dist.get_world_size()
    losses = []
    for step in steps:
        indices = batches.indices(step)[rank * share : (rank + 1) * share]
        loss = workload.loss_fn(model, collate(workload.dataset, indices))
        sync.backward(loss * (share / GLOBAL_BATCH * sync.loss_weight))
        losses.append(sync.step(loss.item() * share, False).loss_total / GLOBAL_BATCH)
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    params = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(params, mine)
    checkpoint = [(model.state_dict(), sync.state_dict()) if rank == 0 else None]
    dist.broadcast_object_list(checkpoint, src=0)
    return {"losses": losses, "params": params, "checkpoint": checkpoint[0]}


def resume_rank(rank: int, world: int) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for optimizer in OPTIMIZERS:
        whole = train(rank, optimizer, range(STEPS), None)
        results[optimizer, None] = {"losses": whole["losses"], "params": whole["params"]}
        for at in RESUME_AT:
            before = train(rank, optimizer, range(at), None)
            after = train(rank, optimizer, range(at, STEPS), before["checkpoint"])
            results[optimizer, at] = {"losses": before["losses"] + after["losses"], "params": after["params"]}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_ranks(resume_rank, 2, tmp_path_factory.mktemp("onebit-resume"))[0]


@pytest.mark.parametrize("at", RESUME_AT)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_resumed_ranks_hold_the_same_parameters(runs: dict, optimizer: str, at: int) -> None:
    for run in (runs[optimizer, None], runs[optimizer, at]):
        first, second = run["params"]
        if optimizer == "onebit_adam":
            assert torch.equal(first, second), (first - second).abs().max()
        else:
            torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("at", RESUME_AT)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_resumed_run_trains_on(runs: dict, optimizer: str, at: int) -> None:
    whole, resumed = runs[optimizer, None], runs[optimizer, at]
    assert resumed["losses"][:at] == whole["losses"][:at]
    # With fresh compression errors (and, for ZeroOneAdam, fresh intervals) the run goes its own way,
    # still learning; within the warm-up OnebitAdam has no errors to lose and resumes exactly.
    assert max(resumed["losses"][-3:]) < resumed["losses"][0], resumed["losses"]
    if optimizer == "onebit_adam" and at < WARMUP:
        assert resumed["losses"] == whole["losses"]
