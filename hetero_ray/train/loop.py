"""The training function every Ray Train worker runs: plan, then step, report, checkpoint.

One step on one worker (rank r with local batch b_r of a global batch B):
forward/backward each micro-batch with its loss scaled by ``size / B``, so the
sum over all workers of the local gradients is the full-batch mean gradient;
pad to the emulated device's modelled time; one all-reduce (SUM) of the flat
gradients (plus the loss and a stop flag, which ride along for free); step.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.emulated_device import EmulatedDevice
from hetero_ray.config import RunConfig
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.data_parallel import plan_data_parallel
from hetero_ray.plan.plan import Infeasible, Plan, PlanError, WorkerRole
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.device import torch_device, worker_gpu_type
from hetero_ray.train.precision import autocast, needs_loss_scaling
from hetero_ray.workloads import build_workload

MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.pt", "optimizer.pt", "state.json"


@dataclass
class Window:
    """Per-worker timings since the last report."""

    step_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        n = max(len(self.step_s), 1)
        return {"step_s": sum(self.step_s) / n, "busy_s": sum(self.busy_s) / n, "comm_s": sum(self.comm_s) / n}


def train_worker(payload: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: everything one worker does in a run."""
    cfg = RunConfig.model_validate(payload["config"])
    footprint = Footprint(**payload["footprint"])
    catalog = load_catalog(cfg.gpus_file)
    rank, world = dist.get_rank(), dist.get_world_size()

    gpu_type, emulated = worker_gpu_type(catalog)
    rank_types: list[str] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(rank_types, gpu_type)
    plan = plan_data_parallel(
        rank_types,
        catalog,
        footprint,
        global_batch=cfg.train.global_batch,
        split=cfg.train.split,
        precision=cfg.train.precision,
        efficiency=payload["efficiency"],
        max_micro=cfg.train.max_micro_batch,
        emulated=emulated,
    )
    if isinstance(plan, Infeasible):
        raise PlanError(plan.reason)
    role = plan.roles_for(rank_types)[rank]

    device = torch_device(emulated)
    if emulated:
        # Workers share this machine's cores; one thread each keeps them from fighting.
        torch.set_num_threads(1)
    # Same seed on every rank: identical initial weights without a broadcast.
    torch.manual_seed(cfg.train.seed)
    workload = build_workload(cfg.workload.name, cfg.workload.options)
    model = workload.model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    start_step, history = _restore(model, optimizer)
    emu = (
        EmulatedDevice(
            spec=catalog.get(gpu_type),
            precision=role.precision,
            flops_per_sample=footprint.flops_per_sample,
            efficiency=payload["efficiency"],
            dilation=payload["dilation"],
        )
        if emulated and role
        else None
    )
    scaler = torch.amp.GradScaler("cuda") if role and needs_loss_scaling(role.precision, device) else None
    batches = GlobalBatches(len(workload.dataset), cfg.train.global_batch, cfg.train.seed)
    progress = payload.get("progress")

    params = list(model.parameters())
    window, started = Window(), time.monotonic()
    step = start_step
    for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        loss_sum = _local_backward(
            model, workload, batches.indices(step), role, cfg.train.global_batch, device, emu, footprint, scaler
        )
        busy = emu.pad(t0, role.local_batch) if emu else time.perf_counter() - t0
        if scaler:
            scaler.unscale_(optimizer)
        t1 = time.perf_counter()
        stop = rank == 0 and cfg.train.duration_s is not None and time.monotonic() - started > cfg.train.duration_s
        loss_total, stop_all, finite = _all_reduce_grads(params, loss_sum, stop)
        loss = loss_total / cfg.train.global_batch
        comm = time.perf_counter() - t1
        if finite:
            optimizer.step()
        if scaler:
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        window.step_s.append(time.perf_counter() - t0)
        window.busy_s.append(busy)
        window.comm_s.append(comm)
        last = step + 1 == cfg.train.steps or stop_all
        if (step + 1) % cfg.train.report_every == 0 or (step + 1) % cfg.train.checkpoint_every == 0 or last:
            history.append((step, loss))
            save = (step + 1) % cfg.train.checkpoint_every == 0 or last
            metrics = _metrics(step, loss, window, plan, role, rank_types, emu, start_step, history, started)
            _report(metrics, model, optimizer, history, step, plan, save=save)
            if rank == 0 and progress is not None:
                progress.put_nowait(metrics)
            window = Window()
        if stop_all:
            break


def _local_backward(model, workload, indices, role: WorkerRole | None, global_batch, device, emu, footprint, scaler):
    """Accumulate this worker's share of the full-batch mean gradient; return its summed loss."""
    if role is None:
        return 0.0
    loss_sum = 0.0
    for start, size in role.micro_batches():
        batch = tree_map(lambda t: t.to(device), collate(workload.dataset, indices[start : start + size]))
        cap = emu.memory_cap(model, footprint.static_bytes) if emu else nullcontext()
        with cap, autocast(role.precision, device):
            loss = workload.loss_fn(model, batch)
        scaled = loss * (size / global_batch)
        (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.item() * size
    return loss_sum


def _all_reduce_grads(params: list[torch.Tensor], loss_sum: float, stop: bool) -> tuple[float, bool, bool]:
    """One SUM all-reduce of every gradient, the loss and the stop flag; returns (summed loss, stop, finite)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat(
        [g.reshape(-1).float() for g in grads] + [torch.tensor([loss_sum, float(stop)], device=grads[0].device)]
    )
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n
    finite = bool(torch.isfinite(flat[:offset]).all())
    return float(flat[offset]), bool(flat[offset + 1] > 0), finite


def _metrics(step, loss, window: Window, plan: Plan, role, rank_types, emu, start_step, history, started) -> dict:
    """Per-device figures gathered on every rank (one small collective per report)."""
    mine = {**window.summary(), "overrun_steps": emu.overrun_steps if emu else 0}
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    roles = plan.roles_for(rank_types)
    devices = []
    for rank, (gpu_type, r, m) in enumerate(zip(rank_types, roles, everyone)):
        devices.append(
            {
                "rank": rank,
                "gpu_type": gpu_type,
                "local_batch": r.local_batch if r else 0,
                "share": (r.local_batch if r else 0) / plan.global_batch,
                "micro_batch": r.micro_batch if r else 0,
                "precision": r.precision if r else None,
                "step_s": m["step_s"],
                "samples_per_s": (r.local_batch if r else 0) / m["step_s"],
                "utilisation": m["busy_s"] / m["step_s"],
                "comm_s": m["comm_s"],
                "overrun_steps": m["overrun_steps"],
            }
        )
    step_s = max(d["step_s"] for d in devices)
    return {
        "step": step,
        "loss": loss,
        "step_s": step_s,
        "samples_per_s": plan.global_batch / step_s,
        "emulated": plan.emulated,
        "devices": devices,
        "plan": plan.to_dict(),
        "resumed_from_step": start_step,
        "losses": [list(x) for x in history],
        "elapsed_s": time.monotonic() - started,
    }


def _report(metrics, model, optimizer, history, step, plan: Plan, *, save: bool) -> None:
    """``ray.train.report`` on every rank; rank 0 attaches the checkpoint when one is due."""
    if not (save and dist.get_rank() == 0):
        ray.train.report(metrics)
        return
    tmp = Path(tempfile.mkdtemp(prefix="hetero-ray-ckpt-"))
    try:
        torch.save(model.state_dict(), tmp / MODEL_FILE)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "history": history, "plan": plan.to_dict()}))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _restore(model, optimizer) -> tuple[int, list]:
    """Load the latest checkpoint if Ray Train has one; return (first step to run, loss history)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, []
    with checkpoint.as_directory() as d:
        d = Path(d)
        model.load_state_dict(torch.load(d / MODEL_FILE, map_location="cpu"))
        optimizer.load_state_dict(torch.load(d / OPTIMIZER_FILE, map_location="cpu"))
        state = json.loads((d / STATE_FILE).read_text())
    return state["step"] + 1, [tuple(x) for x in state["history"]]
