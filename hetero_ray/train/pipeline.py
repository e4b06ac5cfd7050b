"""Executing a pipelined Plan on Ray Train workers with ``torch.distributed.pipelining``.

Each worker runs the layers of its role's range as one ``PipelineStage``; the
stages of a pipeline talk over a process group of their ranks, and a GPipe
schedule runs the pipeline's micro-batches. Gradients are summed per layer over
the pipelines that hold it (one ``Bucket`` per distinct set of holders), so
pipelines may cut the model differently. Checkpoints hold the whole model and
the optimizer in the data-parallel format, so a run resumes on any plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.checkpoint import checkpoint

from hetero_ray.cluster.emulated_device import EmulatedDevice, PaddedModule
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.buckets import Bucket
from hetero_ray.train.data import collate
from hetero_ray.train.precision import autocast
from hetero_ray.workloads import Workload


def _layer_range(role: WorkerRole | None, n_layers: int) -> range:
    if role is None:
        return range(0)
    first, last = role.layers if role.layers is not None else (0, n_layers)
    return range(first, last)


def layer_holders(roles: Sequence[WorkerRole | None], n_layers: int) -> list[tuple[int, ...]]:
    """For each layer, the ranks that hold it (one per pipeline), ascending."""
    return [
        tuple(r for r, role in enumerate(roles) if layer in _layer_range(role, n_layers)) for layer in range(n_layers)
    ]


def gradient_buckets(layers: Sequence[nn.Module], roles: Sequence[WorkerRole | None], rank: int) -> list[Bucket]:
    """This rank's gradient buckets: its layers grouped by the set of ranks that also hold them.

    Every rank creates every group, in the same order, as ``dist.new_group`` requires.
    """
    by_holders: dict[tuple[int, ...], list[int]] = {}
    for layer, holders in enumerate(layer_holders(roles, len(layers))):
        by_holders.setdefault(holders, []).append(layer)
    buckets = []
    for holders in sorted(by_holders):
        group = dist.new_group(list(holders)) if len(holders) > 1 else None
        # A layer only one rank holds needs no sum (size 1).
        if rank in holders:
            params = [p for layer in by_holders[holders] for p in layers[layer].parameters()]
            buckets.append(Bucket(group=group, size=len(holders), params=params))
    return buckets


def pipeline_group(roles: Sequence[WorkerRole | None], rank: int) -> tuple[dist.ProcessGroup | None, list[int]]:
    """The process group of this rank's pipeline and its ranks in stage order (every rank creates every group)."""
    mine: tuple[dist.ProcessGroup | None, list[int]] = (None, [])
    for pipeline in sorted({r.pipeline for r in roles if r is not None}):
        stages = sorted(
            (role.stage, r) for r, role in enumerate(roles) if role is not None and role.pipeline == pipeline
        )
        ranks = [r for _, r in stages]
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (group, ranks)
    return mine


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class _Checkpointed(nn.Module):
    """A layer whose activations are recomputed in the backward instead of kept."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def sequence(layers: Sequence[nn.Module], *, checkpointing: bool) -> nn.Sequential:
    """The layers run one after another, each checkpointed when ``checkpointing``."""
    return nn.Sequential(*(_Checkpointed(layer) if checkpointing else layer for layer in layers))


class Stage:
    """This worker's pipeline stage: its layers, the schedule, and one step over its pipeline's micro-batches."""

    def __init__(
        self,
        workload: Workload,
        role: WorkerRole,
        group: dist.ProcessGroup,
        ranks: list[int],
        global_batch: int,
        device: torch.device,
        emu: EmulatedDevice | None,
        schedule: str = "gpipe",
        link: tuple[float, float] | None = None,
        precision: str = "fp32",
    ):
        layered = workload.layered
        layers = list(layered.layers(workload.model))
        first, last = role.layers
        self.role, self.workload, self.device, self.emu, self.precision = role, workload, device, emu, precision
        self.is_first, self.is_last = first == 0, last == len(layers)
        self.module = nn.Sequential(*layers[first:last])
        runnable = sequence(layers[first:last], checkpointing=role.activation_checkpointing)
        self.padded = (
            PaddedModule(runnable, emu, role.micro_batch, link=link, first=self.is_first, last=self.is_last)
            if emu
            else None
        )
        self.stage = PipelineStage(_Float32Output(self.padded or runnable), role.stage, len(ranks), device, group=group)
        # new_group orders a group's ranks ascending; stage s lives on ranks[s].
        ascending = sorted(ranks)
        self.stage.stage_index_to_group_rank = {s: ascending.index(r) for s, r in enumerate(ranks)}
        self.n_micro = role.local_batch // role.micro_batch

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Each micro-batch's mean loss weighted by its share of the global batch: summed
            # over micro-batches and pipelines, the gradient is the full-batch mean.
            return layered.output_loss(output, target) * (role.micro_batch / global_batch)

        self.global_batch = global_batch
        self.schedule = SCHEDULES[schedule](self.stage, n_microbatches=self.n_micro, loss_fn=loss_fn, scale_grads=False)

    def static_bytes(self, bytes_per_param: int) -> int:
        return sum(p.numel() for p in self.module.parameters()) * bytes_per_param

    def step(self, indices: torch.Tensor, memory_cap, sync) -> tuple[float, float]:
        """Run the pipeline's micro-batches through this stage, ``sync`` armed to reduce each gradient bucket as
        soon as their backward passes have filled it; return (summed loss, busy seconds)."""
        role, layered = self.role, self.workload.layered
        mine = indices[role.sample_offset : role.sample_offset + role.local_batch]
        batch = collate(self.workload.dataset, mine) if self.is_first or self.is_last else None
        args = (layered.inputs(batch).to(self.device),) if self.is_first else ()
        kwargs: dict = {}
        losses: list[torch.Tensor] = []
        if self.is_last:
            kwargs = {"target": layered.targets(batch).to(self.device), "losses": losses}
        if self.padded:
            self.padded.busy_s = 0.0
        sync.arm(self.n_micro)
        with memory_cap or nullcontext(), autocast(self.precision, self.device):
            self.schedule.step(*args, **kwargs)
        loss_sum = sum(float(x.detach()) for x in losses) * self.global_batch
        return loss_sum, self.padded.busy_s if self.padded else 0.0


class _Float32Output(nn.Module):
    """Stage boundaries carry fp32, so stages in different precisions can talk."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out.float() if out.is_floating_point() else out


def gather_whole_state(
    model: nn.Module, layers: Sequence[nn.Module], sync, roles: Sequence[WorkerRole | None], rank: int
) -> tuple[dict, dict] | None:
    """On rank 0, the whole model's and optimizer's state, assembled from pipeline 0's stages (None elsewhere).

    Every rank must call it: it is one ``gather_object``.
    """
    part = None
    role = roles[rank]
    if role is not None and role.pipeline == 0:
        # By tensor, not by module path: a layer may be a wrapper the model does not hold (the cut points of
        # transformers' models), and a tied tensor has a key per name.
        keys: dict[int, list[str]] = {}
        for k, t in model.state_dict(keep_vars=True).items():
            keys.setdefault(id(t), []).append(k)
        # Pipeline 0 may be one whole-model replica beside staged pipelines.
        first, last = role.layers or (0, len(layers))
        mine = [t for layer in layers[first:last] for t in layer.state_dict(keep_vars=True).values()]
        part = ({k: t.detach() for t in mine for k in keys[id(t)]}, sync.state_dict())
    parts: list = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    if rank != 0:
        return None
    model_state: dict = {}
    optimizer_state: dict = {"state": {}, "param_groups": []}
    for piece in filter(None, parts):
        model_state |= piece[0]
        optimizer_state["state"] |= piece[1]["state"]
        group = piece[1]["param_groups"][0]
        known = optimizer_state["param_groups"][0]["params"] if optimizer_state["param_groups"] else []
        optimizer_state["param_groups"] = [{**group, "params": sorted(known + group["params"])}]
    return model_state, optimizer_state
