"""1-bit Adam on a pipelined plan (spawned gloo ranks, no Ray): compression over each layer's data-parallel group.

Two identical two-stage pipelines on four ranks: ranks 0 and 2 hold the first two layers,
ranks 1 and 3 the last two, so each rank has one gradient bucket, summed over a pair of
ranks. DeepSpeed's OnebitAdam runs on that bucket with the pair as its data-parallel group
(an ``mpu``); after its warm-up only compressed momentum crosses each pair, and the loss
stays close to AdamW's on the same plan and data. A plan cut differently gets a one-line
ConfigError on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from test_pipeline_exec import OPTIONS, PLANS, role

from hetero_ray.config import ConfigError, parse_config
from hetero_ray.train.data import GlobalBatches
from hetero_ray.train.onebit import fused_allreduce_bytes
from hetero_ray.train.pipeline import Stage, gather_whole_state, gradient_buckets, pipeline_group
from hetero_ray.train.sync import make_sync
from hetero_ray.workloads import build_workload

GLOBAL_BATCH, STEPS, FREEZE, SEED = 12, 14, 4, 5
# Two pipelines cut alike: stage 0 holds layers 0-1, stage 1 layers 2-3.
ROLES = [
    role(0, 0, (0, 2), 6, 3, 0),
    role(0, 1, (2, 4), 6, 3, 0),
    role(1, 0, (0, 2), 6, 3, 6),
    role(1, 1, (2, 4), 6, 3, 6),
]


def run_config(optimizer: str) -> dict:
    return {
        "devices": {"A100-80GB": 1},
        "train": {"global_batch": GLOBAL_BATCH, "lr": 3e-3, "seed": SEED, "steps": STEPS},
        "optimizer": {"name": optimizer, "betas": [0.9, 0.95], "freeze_step": FREEZE},
    }


def train(rank: int, optimizer: str) -> dict:
    """STEPS steps of the two pipelines with ``optimizer``; what this rank saw."""
    cfg = parse_config(run_config(optimizer))
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    cpu = torch.device("cpu")
    layers = list(workload.layered.layers(workload.model))
    group, ranks = pipeline_group(ROLES, rank)
    buckets = gradient_buckets(layers, ROLES, rank)
    sync = make_sync(workload.model, cfg, cpu, "fp32", buckets)
    stage = Stage(workload, ROLES[rank], group, ranks, GLOBAL_BATCH, cpu, None, "gpipe")
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    losses, steps = [], []
    for step in range(STEPS):
        loss_sum, _ = stage.step(batches.indices(step), None, sync)
        synced = sync.step(loss_sum, False)
        losses.append(synced.loss_total / GLOBAL_BATCH)
        steps.append((synced.compressed, synced.bytes_sent, synced.messages))
    params = torch.cat([p.detach().reshape(-1) for p in stage.module.parameters()])
    result = {"losses": losses, "steps": steps, "params": params}
    if optimizer != "adam":
        backend = sync.backend
        result |= {
            "group": tuple(dist.get_process_group_ranks(backend.world_group)),
            "numels": [p.numel() for p in stage.module.parameters()],
            "bytes_per_call": backend.last_bytes_sent,
            "calls": backend.calls,
        }
        # Checkpoint format: per parameter by model position (as AdamW's), gathered whole on rank 0, and
        # loading it back restores the moments and drops the compression errors.
        state = sync.state_dict()
        (flat_state,) = sync.optimizer.state.values()
        before = flat_state["exp_avg"].clone()
        whole = gather_whole_state(workload.model, layers, sync, ROLES, rank)
        sync.load_state_dict(state)
        (loaded,) = sync.optimizer.state.values()
        result |= {
            "state_shapes": {g: tuple(s["exp_avg"].shape) for g, s in state["state"].items()},
            "param_shapes": {g: tuple(p.shape) for g, p in enumerate(workload.model.parameters())},
            "whole_positions": sorted(whole[1]["state"]) if whole else None,
            "restored": torch.equal(loaded["exp_avg"], before) and "worker_error" not in loaded,
        }
    return result


def onebit_pipeline_rank(rank: int, world: int) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {name: train(rank, name) for name in ("adam", "onebit_adam")}
    # A plan whose pipelines cut the model differently: some ranks have two buckets.
    workload = build_workload("gpt", OPTIONS)
    cut_differently = PLANS["cut differently"][1]
    buckets = gradient_buckets(list(workload.layered.layers(workload.model)), cut_differently, rank)
    try:
        make_sync(workload.model, parse_config(run_config("onebit_adam")), torch.device("cpu"), "fp32", buckets)
    except ConfigError as e:
        results["error"] = str(e)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(onebit_pipeline_rank, len(ROLES), tmp_path_factory.mktemp("onebit-pipeline"))


def test_onebit_compresses_over_each_stage_pair_only(runs: list[dict]) -> None:
    pairs = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    for rank, got in enumerate(runs):
        onebit = got["onebit_adam"]
        assert onebit["group"] == pairs[rank]
        # DeepSpeed's first step initialises, the next FREEZE - 1 are fp32 Adam, then 1-bit.
        assert [c for c, _, _ in onebit["steps"]] == [False] * FREEZE + [True] * (STEPS - FREEZE)
        # One fused call per step over the pair, with a scale per tensor; plus the loss vote over all four.
        expected = fused_allreduce_bytes(onebit["numels"], 2)
        assert onebit["bytes_per_call"] == expected != fused_allreduce_bytes(onebit["numels"], 4)
        vote = 2 * 3 / 4 * 8
        assert {b for c, b, _ in onebit["steps"] if c} == {expected + vote}
        assert {m for c, _, m in onebit["steps"] if c} == {2 * 1 + 2 * 3}
        fp32 = 2 * 1 / 2 * 4 * sum(onebit["numels"])
        assert (expected + vote) / (fp32 + vote) < 0.06
    # The pair's replicas stay identical (same compressed average applied on both).
    for a, b in pairs.values():
        assert torch.equal(runs[a]["onebit_adam"]["params"], runs[b]["onebit_adam"]["params"])


def test_onebit_trains_close_to_adam_on_the_same_plan(runs: list[dict]) -> None:
    adam, onebit = runs[0]["adam"]["losses"], runs[0]["onebit_adam"]["losses"]
    assert all(got["onebit_adam"]["losses"] == onebit for got in runs)
    # Warm-up: DeepSpeed's first step only initialises, so 1-bit lags Adam by a step.
    assert onebit[0] == adam[0]
    assert onebit[-1] < onebit[FREEZE] < onebit[0]
    assert onebit[-1] / adam[-1] == pytest.approx(1.0, abs=0.05), (onebit, adam)


def test_onebit_state_is_saved_per_parameter_and_restores(runs: list[dict]) -> None:
    for got in [r["onebit_adam"] for r in runs]:
        assert got["restored"]
        assert got["state_shapes"] == {g: got["param_shapes"][g] for g in got["state_shapes"]}
    held = [sorted(r["onebit_adam"]["state_shapes"]) for r in runs]
    assert held[0] == held[2] and held[1] == held[3] and not set(held[0]) & set(held[1])
    assert runs[0]["onebit_adam"]["whole_positions"] == sorted(runs[0]["onebit_adam"]["param_shapes"])


def test_pipelines_cut_differently_get_one_line_error_on_every_rank(runs: list[dict]) -> None:
    messages = {got.get("error") for got in runs}
    assert len(messages) == 1
    message = messages.pop()
    assert message is not None and "\n" not in message
    assert message.startswith("optimizer.name: onebit_adam on a pipelined plan needs each rank's layers")
    assert "rank 0's are summed over rank sets [(0, 1), (0, 3)]" in message
