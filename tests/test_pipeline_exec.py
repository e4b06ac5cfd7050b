"""Pipelined plans executed on gloo ranks (spawned processes, no Ray): the same training as one process.

Two plans, each cutting the GPT's four layers (embedding, two blocks, head) into
pipelines of different shapes, so gradients are summed per layer over different
sets of ranks; every plan must end where full-batch AdamW in one process ends.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from ranks import one_process, run_ranks, worker_role

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.emulated_device import EmulatedDevice, PaddedModule
from hetero_ray.config import parse_config
from hetero_ray.plan.cost import p2p_seconds
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.loop import local_backward
from hetero_ray.train.pipeline import Stage, gather_whole_state, gradient_buckets, layer_holders, pipeline_group
from hetero_ray.train.sync import TorchAdam
from hetero_ray.workloads import build_workload

OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_bytes": 50_000}
GLOBAL_BATCH, STEPS, SEED = 12, 6, 3
CONFIG = {"devices": {"A100-80GB": 1}, "train": {"global_batch": GLOBAL_BATCH, "lr": 1e-3, "seed": SEED}}


def role(
    pipeline: int, stage: int, layers: tuple[int, int] | None, local: int, micro: int, offset: int, ckpt: bool = False
) -> WorkerRole:
    return worker_role(
        local, offset, micro=micro, pipeline=pipeline, stage=stage, layers=layers, activation_checkpointing=ckpt
    )


PLANS = {
    # A two-stage pipeline beside one worker holding the whole model (a one-stage pipeline).
    "two-stage + whole": (
        "gpipe",
        [role(0, 0, (0, 2), 8, 2, 0), role(0, 1, (2, 4), 8, 2, 0), role(1, 0, (0, 4), 4, 2, 8)],
    ),
    # Two two-stage pipelines cut at different layers, stages listed out of rank order.
    "cut differently": (
        "gpipe",
        [
            role(0, 1, (1, 4), 6, 3, 0),
            role(1, 0, (0, 3), 6, 2, 6),
            role(0, 0, (0, 1), 6, 3, 0),
            role(1, 1, (3, 4), 6, 2, 6),
        ],
    ),
    # Pipeline 0 a whole-model replica as the planner writes one (no layer range), before a two-stage one:
    # the whole state is gathered from pipeline 0.
    "whole first": (
        "1f1b",
        [role(0, 0, None, 4, 2, 0), role(1, 0, (0, 2), 8, 2, 4), role(1, 1, (2, 4), 8, 2, 4)],
    ),
    # 1F1B with activation checkpointing in the pipeline and in the whole-model worker.
    "1f1b checkpointed": (
        "1f1b",
        [role(0, 0, (0, 3), 8, 2, 0, True), role(0, 1, (3, 4), 8, 2, 0), role(1, 0, (0, 4), 4, 1, 8, True)],
    ),
}


def pipeline_rank(rank: int, world: int, roles: list[WorkerRole], schedule: str) -> dict:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = parse_config(CONFIG)
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    model, cpu = workload.model, torch.device("cpu")
    layers = list(workload.layered.layers(model))
    group, ranks = pipeline_group(roles, rank)
    sync = TorchAdam(model, cfg, cpu, "fp32", gradient_buckets(layers, roles, rank))
    stage = Stage(workload, roles[rank], group, ranks, GLOBAL_BATCH, cpu, None, schedule) if len(ranks) > 1 else None
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    losses = []
    for step in range(STEPS):
        indices = batches.indices(step)
        if stage:
            loss_sum, _ = stage.step(indices, None, sync)
        else:
            loss_sum, _ = local_backward(model, workload, indices, roles[rank], GLOBAL_BATCH, cpu, None, sync, "fp32")
        losses.append(sync.step(loss_sum, False).loss_total / GLOBAL_BATCH)
    whole = gather_whole_state(model, layers, sync, roles, rank)
    return {"losses": losses, "whole": whole}


@pytest.fixture(scope="module")
def expected():
    """One process, full global batch every step."""
    return one_process(OPTIONS, GLOBAL_BATCH, STEPS, SEED, 1e-3)


@pytest.mark.parametrize("name", PLANS)
def test_pipelined_plan_trains_like_one_process(name: str, expected, tmp_path) -> None:
    schedule, roles = PLANS[name]
    results = run_ranks(pipeline_rank, len(roles), tmp_path, roles, schedule)
    ref_losses, ref_model, ref_optimizer = expected
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
    model, optimizer = results[0]["whole"]
    assert model.keys() == ref_model.keys()
    assert max(float((model[k] - ref_model[k]).abs().max()) for k in model) <= 1e-5
    # The gathered optimizer state is the one-process AdamW's, position for position.
    assert sorted(optimizer["state"]) == sorted(ref_optimizer["state"])
    for i, state in optimizer["state"].items():
        assert float((state["exp_avg"] - ref_optimizer["state"][i]["exp_avg"]).abs().max()) <= 1e-6


def test_layer_holders_name_one_rank_per_pipeline() -> None:
    assert layer_holders(PLANS["cut differently"][1], 4) == [(1, 2), (0, 1), (0, 1), (0, 3)]
    assert layer_holders(PLANS["two-stage + whole"][1], 4) == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_padded_stage_takes_its_modelled_forward_and_backward_time() -> None:
    """A stage's micro-batch takes at least a third of its modelled time forward and two thirds backward.

    Lower bounds only: padding makes a pass last at least its modelled time, and how much longer this
    host takes on top is its load, not the padding."""
    torch.manual_seed(0)
    workload = build_workload("gpt", OPTIONS)
    emu = EmulatedDevice(
        spec=load_catalog().get("V100-16GB"),
        precision="fp32",
        flops_per_sample=3e9,
        efficiency=0.5,
        dilation=500.0,
    )
    modelled = emu.modelled_seconds(2)
    assert 0.2 < modelled < 2, "pick flops so the padding dominates the real compute"
    stage = PaddedModule(torch.nn.Sequential(*workload.layered.layers(workload.model)[:2]), emu, 2)
    x = collate(workload.dataset, torch.arange(2))[0]
    t0 = time.perf_counter()
    out = stage(x)
    t1 = time.perf_counter()
    out.sum().backward()
    t2 = time.perf_counter()
    assert t1 - t0 >= modelled / 3
    assert t2 - t1 >= 2 * modelled / 3
    assert stage.busy_s == pytest.approx(modelled)


def test_a_middle_stage_waits_out_its_messages_on_the_named_link() -> None:
    """A middle stage on a throttled device pads nothing but the link: its received activations and their
    gradient each take bytes ÷ bandwidth + latency, the planner's price of a stage-to-stage message."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(256, 256))
    emu = EmulatedDevice(
        spec=load_catalog().get("V100-16GB"),
        precision="fp32",
        flops_per_sample=1.0,
        efficiency=1.0,
        dilation=1.0,
        padded=False,
    )
    bandwidth, latency = 2e6, 0.01  # 16 samples × 256 fp32 = 16 KiB: 8.2 ms + 10 ms each way
    message = p2p_seconds(256 * 4, 16, bandwidth, latency)
    stage = PaddedModule(layers, emu, 16, link=(bandwidth, latency), first=False, last=False)
    x = torch.randn(16, 256, requires_grad=True)
    t0 = time.perf_counter()
    out = stage(x)
    t1 = time.perf_counter()
    out.backward(torch.ones_like(out))
    t2 = time.perf_counter()
    assert t1 - t0 >= message and t2 - t1 >= message
    assert 0 < stage.busy_s < (t2 - t0) - 2 * message + 1e-3  # compute is timed, the link is not compute
