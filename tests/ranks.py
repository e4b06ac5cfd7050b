"""Run a function on several gloo ranks in spawned processes, as a launcher would (no Ray); the roles such
ranks play, a pipelined plan's steps on them, and the one-process run they must reproduce."""

from __future__ import annotations

import copy
import math
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetero_ray.config import RunConfig
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.pipeline import (
    Stage,
    boundary,
    gather_whole_state,
    gradient_buckets,
    local_optimizer_state,
    pipeline_group,
    shard_group,
    tensor_group,
)
from hetero_ray.train.sync import TorchAdam
from hetero_ray.workloads import build_workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable[..., dict], world: int, port: int, out: Path, args: tuple) -> None:
    """Entry point of one spawned rank: a launcher's environment, then ``fn``, then its result to disk."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        result = fn(rank, world, *args)
        if dist.is_initialized():
            # No rank tears its group down while another still talks to it: gloo can abort the process then.
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")


def run_ranks(fn: Callable[..., dict], world: int, out: Path, *args: Any) -> list[dict]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; each rank's returned dict, by rank."""
    mp.spawn(_rank_main, args=(fn, world, free_port(), out, args), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def worker_role(local: int, offset: int, *, micro: int | None = None, precision: str = "fp32", **layout) -> WorkerRole:
    """An A100-80GB's role: ``local`` samples from ``offset``, in micro-batches of ``micro`` (default: all at
    once); ``layout``: pipeline, stage, layers, activation_checkpointing. Predictions are placeholders."""
    return WorkerRole(
        gpu_type="A100-80GB",
        local_batch=local,
        micro_batch=micro or local,
        sample_offset=offset,
        precision=precision,
        predicted_compute_s=1.0,
        predicted_memory_bytes=1.0,
        memory_cap_bytes=1,
        **layout,
    )


def one_process(
    options: dict,
    global_batch: int,
    steps: int,
    seed: int,
    lr: float,
    clip: float | None = None,
    resume: tuple[int, dict, dict] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """The GPT of ``options`` trained in one process on the full global batch every step (AdamW, no weight
    decay; ``clip``: ``clip_grad_norm_`` to it): (losses, model state, optimizer state). ``resume``: (first
    step, model state, optimizer state) to go on from, as a checkpoint loads."""
    torch.manual_seed(seed)
    workload = build_workload("gpt", options)
    opt = torch.optim.AdamW(workload.model.parameters(), lr=lr, weight_decay=0.0)
    first = 0
    if resume:
        first, model_state, optimizer_state = resume
        workload.model.load_state_dict(model_state)
        opt.load_state_dict(optimizer_state)
    batches = GlobalBatches(len(workload.dataset), global_batch, seed)
    losses = []
    for step in range(first, steps):
        loss = workload.loss_fn(workload.model, collate(workload.dataset, batches.indices(step)))
        loss.backward()
        losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(workload.model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, workload.model.state_dict(), opt.state_dict()


def poisonable(workload) -> list[bool]:
    """Make ``workload``'s loss infinite while the returned flag's one element is True, as an fp16 overflow
    would make it."""
    base_loss, poisoned = workload.loss_fn, [False]
    workload.loss_fn = lambda m, b: base_loss(m, b) * (math.inf if poisoned[0] else 1.0)
    return poisoned


@dataclass
class PipelinedRun:
    """What ``run_pipelined`` leaves on one rank: the losses, the whole state gathered as a checkpoint is (on
    rank 0), and the rank's stage and synchroniser."""

    losses: list[float]
    whole: tuple[dict, dict] | None
    stage: Stage
    sync: TorchAdam
    shard_ranks: list[int] | None


def run_pipelined(
    rank: int,
    roles: Sequence[WorkerRole],
    cfg: RunConfig,
    options: dict,
    schedule: str,
    steps: range,
    resume: tuple[dict, dict] | None = None,
    zero_stage: int = 0,
) -> PipelinedRun:
    """``steps`` of ``roles``' pipelined plan of the GPT of ``options`` on this gloo rank, every stage a
    ``Stage``, as the built-in loop runs it: the groups made in its order, ``resume`` (a gathered whole (model,
    optimizer) state) loaded as it loads a checkpoint (the model before a tensor-parallel stage cuts its
    shards, the optimizer after), ZeRO ``zero_stage`` sharding over each stage's replicas."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(cfg.train.seed)
    workload = build_workload("gpt", options)
    model, cpu, role = workload.model, torch.device("cpu"), roles[rank]
    if resume:
        # Spawned ranks get the parent's tensors in shared memory: a copy of its own, as from a file.
        resume = copy.deepcopy(resume)
        model.load_state_dict(resume[0])
    group, ranks = pipeline_group(roles, rank)
    tp = tensor_group(roles, rank)
    global_batch = cfg.train.global_batch
    edge = boundary(roles, rank)
    stage = Stage(workload, role, group, ranks, global_batch, cpu, None, schedule, tp_group=tp, edge=edge)
    layers = list(workload.layered.layers(model))
    buckets = gradient_buckets(layers, roles, rank)
    shards = shard_group(roles, rank) if zero_stage else None
    sync = TorchAdam(
        model, cfg, cpu, "fp32", buckets, tp_degree=role.tp_degree, zero_stage=zero_stage, shard_group=shards
    )
    if resume:
        sync.load_state_dict(local_optimizer_state(model, resume[1]))
    batches = GlobalBatches(len(workload.dataset), global_batch, cfg.train.seed)
    losses = []
    for step in steps:
        loss_sum, _ = stage.step(batches.indices(step), None, sync)
        losses.append(sync.step(loss_sum, False).loss_total / global_batch)
    whole = gather_whole_state(model, layers, sync, roles, rank)
    return PipelinedRun(losses, whole, stage, sync, shards[1] if shards else None)
