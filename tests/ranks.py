"""Run a function on several gloo ranks in spawned processes, as a launcher would (no Ray); the roles such
ranks play, and the one-process run they must reproduce."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.data import GlobalBatches, collate
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
    options: dict, global_batch: int, steps: int, seed: int, lr: float, clip: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """The GPT of ``options`` trained in one process on the full global batch every step (AdamW, no weight
    decay; ``clip``: ``clip_grad_norm_`` to it): (losses, model state, optimizer state)."""
    torch.manual_seed(seed)
    workload = build_workload("gpt", options)
    opt = torch.optim.AdamW(workload.model.parameters(), lr=lr, weight_decay=0.0)
    batches = GlobalBatches(len(workload.dataset), global_batch, seed)
    losses = []
    for step in range(steps):
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
