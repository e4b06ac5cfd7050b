"""The training function every Ray Train worker runs: plan, then step, report, checkpoint.

One step on one worker (rank r with local batch b_r of a global batch B):
forward/backward each micro-batch with its loss scaled by ``size / B`` (times the
synchroniser's ``loss_weight``), so the reduced
gradient is the full-batch mean; pad to the emulated device's modelled time;
synchronise and update (``train/sync.py``), padded to the emulated link's time.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from hetero_ray.cluster.cpu_slices import free_comm_threads
from hetero_ray.config import RunConfig
from hetero_ray.monitor.health import HealthPolicy
from hetero_ray.monitor.worker import WorkerMonitor
from hetero_ray.perf.footprint import OPTIMIZER_STATE_BYTES_PER_PARAM, STATIC_BYTES_PER_PARAM, Footprint
from hetero_ray.plan.data_parallel import memory_fits, zero_bytes
from hetero_ray.plan.plan import Exclusion, Plan, WorkerRole
from hetero_ray.train.batch_norm import share_batch_norm
from hetero_ray.train.buckets import EmulatedLink
from hetero_ray.train.checkpoint import MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, restore_dir, write_checkpoint
from hetero_ray.train.context import get_context
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.pipeline import (
    Stage,
    boundary,
    gather_whole_state,
    gradient_buckets,
    local_optimizer_state,
    pipeline_group,
    sequence,
    shard_group,
    tensor_group,
)
from hetero_ray.train.precision import autocast, choose_precision
from hetero_ray.train.rebalance import Rebalancer, halve
from hetero_ray.train.schedule import lr_at, set_lr
from hetero_ray.train.sync import Synced, make_sync
from hetero_ray.train.zero import spare_memory
from hetero_ray.workloads import build_workload

GiB = 2**30


@dataclass
class Window:
    """Per-worker timings since the last report."""

    step_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)
    bytes_sent: list[float] = field(default_factory=list)
    compressed: bool = False

    def add(self, step_s: float, busy_s: float, comm_s: float, synced: Synced) -> None:
        self.step_s.append(step_s)
        self.busy_s.append(busy_s)
        self.comm_s.append(comm_s)
        self.bytes_sent.append(synced.bytes_sent)
        self.compressed = synced.compressed

    def summary(self) -> dict[str, float]:
        """Means per step over the window; ``compressed`` is the phase at its end."""
        n = max(len(self.step_s), 1)
        means = {k: sum(getattr(self, k)) / n for k in ("step_s", "busy_s", "comm_s", "bytes_sent")}
        return {**means, "compressed": self.compressed}


def train_worker(config: dict[str, Any]) -> None:
    """The built-in loop, a ``HeteroTrainer``'s ``train_loop_per_worker``: the configured workload, stepped,
    reported and checkpointed. ``config["progress"]``: a queue rank 0 puts each report's metrics on."""
    ctx = get_context()
    cfg, footprint, catalog, plan, rank_types = ctx.config, ctx.footprint, ctx.catalog, ctx.plan, ctx.rank_types
    rank, roles, role, device, emu, precision = ctx.rank, ctx.roles, ctx.role, ctx.device, ctx.emu, ctx.precision
    device_slice = ctx.device_slice
    # Same seed on every rank: identical initial weights without a broadcast.
    torch.manual_seed(cfg.train.seed)
    workload = build_workload(cfg.workload.name, cfg.workload.options)
    # The whole model's state goes in before a tensor-parallel stage cuts its shards from it.
    restored = _latest_checkpoint(cfg.run.run_dir)
    if restored:
        workload.model.load_state_dict(restored[0])
    stage_layers = range(*role.layers) if role and role.layers else range(len(footprint.layers))
    stage, buckets = None, None
    if plan.is_pipelined:
        group, ranks = pipeline_group(roles, rank)
        tp_group = tensor_group(roles, rank)
        edge = boundary(roles, rank)
        layers = list(workload.layered.layers(workload.model))
        for i in stage_layers if role else ():
            layers[i].to(device)
        if len(ranks) > 1 or (role and role.tp_degree > 1) or edge:
            link = (cfg.link.bandwidth_bytes_s, cfg.link.latency_s) if cfg.link else None
            # Before the buckets: a tensor-parallel stage cuts its shards into the model.
            stage = Stage(
                workload,
                role,
                group,
                ranks,
                cfg.train.global_batch,
                device,
                emu,
                plan.schedule,
                link,
                precision,
                tp_group,
                edge,
            )
        buckets = gradient_buckets(list(workload.layered.layers(workload.model)), roles, rank)
        model = workload.model
    else:
        model = workload.model.to(device)
    if footprint.batch_coupled:
        # Every rank makes the group (new_group's rule); the ranks with samples normalise over it.
        holders = [r for r, x in enumerate(roles) if x is not None]
        group = dist.new_group(holders)
        if role is not None and len(holders) > 1:
            share_batch_norm(model, group)
    link = (
        EmulatedLink(cfg.link.bandwidth_bytes_s, cfg.link.latency_s, emu.dilation, overlapped=not emu.padded)
        if emu and cfg.link
        else None
    )
    zero_stage = plan.zero_stage
    sync = make_sync(
        model,
        cfg,
        device,
        precision,
        buckets,
        link,
        spare_memory(roles, rank_types, catalog, footprint, zero_stage),
        role.tp_degree if role else 1,
        zero_stage,
        list(workload.layered.layers(model)) if workload.layered and not plan.is_pipelined else None,
        # ZeRO-1 in a pipeline shards over each stage's replicas (every rank makes every group).
        shard_group(roles, rank) if plan.is_pipelined and zero_stage else None,
    )
    # Weights, gradients and optimizer state this rank holds: under ZeRO what every rank holds whole, and its
    # shard's fraction of the rest (the optimizer's slices are the shard); a stage, its layers' weights and
    # gradients and Adam's state of what its optimizer holds (its shard under ZeRO-1).
    if stage is None:
        held_whole, sharded = zero_bytes(footprint, zero_stage)
        static_bytes = int(held_whole + sharded * sync.optimizer_elements / footprint.param_count)
    elif zero_stage:
        static_bytes = (
            stage.static_bytes(STATIC_BYTES_PER_PARAM - OPTIMIZER_STATE_BYTES_PER_PARAM)
            + OPTIMIZER_STATE_BYTES_PER_PARAM * sync.optimizer_elements
        )
    else:
        static_bytes = stage.static_bytes(STATIC_BYTES_PER_PARAM)
    # gloo's threads leave the device's slice (they are its host's). A thread is named only once it runs, so
    # those of the groups just made may not show yet: again after the first step.
    free_comm_threads(device_slice)
    start_step, history = 0, []
    if restored:
        sync.load_state_dict(local_optimizer_state(model, restored[1]))
        start_step, history = restored[2]["step"] + 1, [tuple(x) for x in restored[2]["history"]]
    gpu_ids = ray.get_gpu_ids() if device.type == "cuda" else []
    monitor = WorkerMonitor(
        run=cfg.run.name,
        rank=rank,
        node=ray.get_runtime_context().get_node_id(),
        gpu_type=ctx.gpu_type,
        emu=emu,
        gpu_index=int(gpu_ids[0]) if gpu_ids else None,
    )
    if start_step > 0:
        monitor.restarted()
    # With evaluation, the dataset's last eval_samples are held out: never drawn for training.
    held = cfg.train.eval_samples if cfg.train.eval_every else 0
    batches = GlobalBatches(len(workload.dataset) - held, cfg.train.global_batch, cfg.train.seed)
    evaluated = None  # (step, mean held-out loss) of the last evaluation
    progress = config.get("progress")

    # A re-split could cut a share into micro-batches, which batch statistics cannot span (prepare refuses
    # rebalance_every for such models; out-of-memory re-splits are off too).
    rebalancer = (
        None
        if plan.is_pipelined or footprint.batch_coupled
        else Rebalancer(
            roles,
            _micro_caps(cfg, catalog, rank_types, roles, footprint, zero_stage),
            global_batch=cfg.train.global_batch,
            footprint=footprint,
            policy=HealthPolicy(),
            every=cfg.train.rebalance_every,
            threshold=cfg.train.rebalance_threshold,
            damping=cfg.train.rebalance_damping,
        )
    )
    events = _my_events(cfg, rank_types, rank) if emu else []
    rebalances = 0

    window, started = Window(), time.monotonic()
    for step in range(start_step, cfg.train.steps):
        for event in (e for e in events if e.step == step):
            emu.speed = event.speed or emu.speed
            emu.memory_bytes = int(event.memory_gib * GiB) if event.memory_gib else emu.memory_bytes
        t0 = time.perf_counter()
        fitted = None
        if stage is not None:
            cap = emu.memory_cap(stage.module, static_bytes) if emu else None
            loss_sum, busy = stage.step(batches.indices(step), cap, sync)
            busy = busy if emu else time.perf_counter() - t0
        else:
            loss_sum, fitted = local_backward(
                model,
                workload,
                batches.indices(step),
                role,
                cfg.train.global_batch,
                device,
                emu,
                sync,
                precision,
                static_bytes=static_bytes,
                # Halves would change the number of passes, which ZeRO-2/3 makes every rank run alike.
                retry_in_halves=not footprint.batch_coupled and zero_stage < 2,
                passes=equal_passes(roles, zero_stage),
            )
            busy = emu.pad(t0, role.local_batch) if emu and role else time.perf_counter() - t0
        t1 = time.perf_counter()
        stop = rank == 0 and cfg.train.duration_s is not None and time.monotonic() - started > cfg.train.duration_s
        set_lr(sync.optimizer, lr_at(step, cfg.train))
        synced = sync.step(loss_sum, stop)
        if step == start_step:
            free_comm_threads(device_slice)
        loss = synced.loss_total / cfg.train.global_batch
        window.add(time.perf_counter() - t0, busy, time.perf_counter() - t1, synced)
        last = step + 1 == cfg.train.steps or synced.stop
        if cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or last):
            held_out = torch.arange(len(workload.dataset) - held, len(workload.dataset))
            # ZeRO-3's forwards gather each layer from every rank.
            alike = plan.zero_stage == 3
            evaluated = (
                step,
                evaluate(model, workload, held_out, roles, rank, device, precision, forwards_alike=alike),
            )
        if (step + 1) % cfg.train.report_every == 0 or (step + 1) % cfg.train.checkpoint_every == 0 or last:
            history.append((step, loss))
            save = (step + 1) % cfg.train.checkpoint_every == 0 or last
            metrics = _metrics(step, loss, window, plan, roles, rank_types, emu, link, start_step, history, started)
            metrics["rebalances"] = rebalances
            metrics["eval"] = {"step": evaluated[0], "loss": evaluated[1]} if evaluated else None
            whole = _whole_state(model, workload, sync, roles, rank, plan) if save else None
            _report(metrics, whole, history, step, plan, save=save)
            monitor.report(metrics)
            if rank == 0 and progress is not None:
                progress.put_nowait(metrics)
            window = Window()
        # Re-split after the report, whose window ran on the split before; compute is measured in
        # the planner's (undilated) seconds, comparable with its predictions.
        modelled_busy = busy / (ctx.dilation or 1.0) if emu else busy
        change = rebalancer.step_done(step, rank, modelled_busy, fitted, monitor.last_reading) if rebalancer else None
        if change is not None:
            roles, role = change.roles, change.roles[rank]
            plan = _rebalanced(plan, roles, rank_types, [text for _, text in change.reasons])
            monitor.decided(change)
            rebalances += 1
        if synced.stop:
            break
    monitor.close()


def local_backward(
    model,
    workload,
    indices,
    role: WorkerRole | None,
    global_batch,
    device,
    emu,
    sync,
    precision,
    *,
    static_bytes: int = 0,
    retry_in_halves: bool = True,
    passes: int | None = None,
) -> tuple[float, int | None]:
    """Accumulate this worker's share of the full-batch mean gradient, computing in ``precision``; return its
    summed loss and, after an out-of-memory, the micro-batch size that then fitted (else ``None``).
    ``static_bytes``: what the emulated device holds besides activations.

    A micro-batch whose forward runs out of memory is retried in halves, so the step
    keeps all its samples; nothing of the failed forward reached the gradients. An
    out-of-memory in the backward would leave a partial gradient: it propagates, as
    one without ``retry_in_halves`` (a model whose batch statistics the ranks share: halves would
    not span the share).

    ``passes``: the backward passes every rank runs (ZeRO-2/3, whose passes make collectives every rank must
    make alike). A rank with fewer micro-batches, or none, runs the rest on one sample (its first, or the
    batch's) at loss weight 0: the same graph, exactly zero gradients, no sample counted.
    """
    if role is None and not passes:
        return 0.0, None
    loss_sum, fitted = 0.0, None
    # (start, size, samples it counts for)
    pending = [(start, size, size) for start, size in role.micro_batches()] if role else []
    pending += [(role.sample_offset if role else 0, 1, 0)] * ((passes or 0) - len(pending))
    checkpointing = role.activation_checkpointing if role else False
    while pending:
        start, size, counted = pending.pop(0)
        batch = tree_map(lambda t: t.to(device), collate(workload.dataset, indices[start : start + size]))
        try:
            with emu.memory_cap(model, static_bytes) if emu else nullcontext():
                with autocast(precision, device):
                    loss = _forward(model, workload, batch, checkpointing)
        except torch.OutOfMemoryError:
            half = halve(size)
            if not half or not retry_in_halves:
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            fitted = min(fitted or half, half)
            pending[:0] = [(start, half, half), (start + half, size - half, size - half)]
            continue
        if not pending:
            sync.arm()  # the step's last backward: its gradients go on the wire as they are ready
        sync.backward(loss * (counted / global_batch * sync.loss_weight))
        loss_sum += loss.item() * counted
    return loss_sum, fitted


def equal_passes(roles: Sequence[WorkerRole | None], zero_stage: int) -> int | None:
    """The backward passes every rank runs under ZeRO-2/3 (the most micro-batches of any role); ``None``
    below, where each rank runs its own."""
    return max(r.accumulation_steps for r in roles if r) if zero_stage >= 2 else None


@torch.no_grad()
def evaluate(
    model, workload, indices: torch.Tensor, roles, rank: int, device, precision, *, forwards_alike: bool = False
) -> float:
    """The mean loss over ``indices`` (held-out samples) of the whole model in evaluation mode (BatchNorm on its
    running statistics): the ranks with samples each take an even part, in their micro-batch size; every rank
    must call it (one all-reduce). ``forwards_alike``: every rank runs as many forwards as the rank with the
    most, the extra ones on one sample and not counted (ZeRO-3, whose forwards gather each layer from all)."""
    holders = [r for r, role in enumerate(roles) if role is not None]
    parts = torch.tensor_split(indices, len(holders))
    mine = list(torch.split(parts[holders.index(rank)], roles[rank].micro_batch)) if rank in holders else []
    if forwards_alike:
        most = max(-(-len(part) // roles[r].micro_batch) for r, part in zip(holders, parts))
        mine += [None] * (most - len(mine))
    total = torch.zeros(1, dtype=torch.float64)
    model.eval()
    try:
        for part in mine:
            batch = tree_map(lambda t: t.to(device), collate(workload.dataset, indices[:1] if part is None else part))
            with autocast(precision, device):
                loss = float(workload.loss_fn(model, batch))
            total += 0.0 if part is None else loss * len(part)
    finally:
        model.train()
    dist.all_reduce(total)
    return float(total) / len(indices)


def _forward(model, workload, batch, checkpointing: bool) -> torch.Tensor:
    if not checkpointing:
        return workload.loss_fn(model, batch)
    layered = workload.layered
    run = sequence(layered.layers(model), checkpointing=True)
    return layered.output_loss(run(layered.inputs(batch)), layered.targets(batch))


def _micro_caps(cfg: RunConfig, catalog, rank_types, roles, footprint: Footprint, zero_stage: int) -> list[int]:
    """The largest micro-batch each rank fits, as the planner found it (under ZeRO, beside its shard)."""
    specs = [catalog.get(t) for t in rank_types]
    precisions = [r.precision if r else choose_precision(s, cfg.train.precision) for r, s in zip(roles, specs)]
    fits, _ = memory_fits(specs, precisions, footprint, zero_stage)
    return [f if r else 0 for f, r in zip(fits, roles)]


def _my_events(cfg: RunConfig, rank_types: list[str], rank: int) -> list:
    """The emulated events of this worker: the k-th worker of its type is ``index`` k."""
    index = [r for r, t in enumerate(rank_types) if t == rank_types[rank]].index(rank)
    return [e for e in cfg.emulation.events if e.gpu_type == rank_types[rank] and e.index == index]


def _rebalanced(plan: Plan, roles, rank_types, reasons: list[str]) -> Plan:
    """The plan the workers now follow, for reports and checkpoints."""
    dropped: dict[str, int] = {}
    for t, r in zip(rank_types, roles):
        if r is None:
            dropped[t] = dropped.get(t, 0) + 1
    return replace(
        plan,
        roles=tuple(r for r in roles if r is not None),
        predicted_compute_s=max(r.predicted_compute_s for r in roles if r is not None),
        excluded=tuple(Exclusion(gpu_type=t, count=n, reason="; ".join(reasons)) for t, n in dropped.items()),
        explanation=f"re-split during the run ({'; '.join(reasons)}); was: {plan.explanation}",
    )


def _metrics(
    step, loss, window: Window, plan: Plan, roles, rank_types, emu, link, start_step, history, started
) -> dict:
    """Per-device figures gathered on every rank (one small collective per report)."""
    mine = {
        **window.summary(),
        "overrun_steps": emu.overrun_steps if emu else 0,
        "comm_overruns": link.overruns if link else 0,
        # An emulated device's most bytes held under its cap (what it holds besides activations, plus live
        # saved activations); its cap.
        "peak_memory_bytes": emu.peak_bytes if emu else None,
        "memory_cap_bytes": emu.memory_bytes if emu else None,
    }
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
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
                "bytes_sent": m["bytes_sent"],
                "compressed": m["compressed"],
                "overrun_steps": m["overrun_steps"],
                "comm_overruns": m["comm_overruns"],
                "peak_memory_bytes": m["peak_memory_bytes"],
                "memory_cap_bytes": m["memory_cap_bytes"],
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
        "time": time.time(),
    }


def _whole_state(model, workload, sync, roles, rank, plan: Plan) -> tuple[dict, dict] | None:
    """(model, optimizer) state of the whole model on rank 0; a pipelined plan gathers it from its stages."""
    if plan.is_pipelined:
        return gather_whole_state(model, list(workload.layered.layers(model)), sync, roles, rank)
    optimizer_state = sync.state_dict()  # on every rank: a sharded optimizer gathers its state to rank 0
    model_state = sync.model_state(model, keep=rank == 0)  # on every rank: ZeRO-3 gathers chunk by chunk
    return (model_state, optimizer_state) if rank == 0 else None


def _report(metrics, whole: tuple[dict, dict] | None, history, step, plan: Plan, *, save: bool) -> None:
    """``ray.train.report`` on every rank; rank 0 attaches the checkpoint when one is due."""
    if not (save and dist.get_rank() == 0):
        ray.train.report(metrics)
        return
    tmp = Path(tempfile.mkdtemp(prefix="hetero-ray-ckpt-"))
    model_state, optimizer_state = whole
    state = {"step": step, "history": history, "plan": plan.to_dict()}
    try:
        # Written with a manifest of sizes and hashes, so a restore can tell a whole checkpoint
        # from one whose copy into storage was cut short.
        write_checkpoint(
            tmp / "checkpoint",
            step,
            {
                MODEL_FILE: lambda path: torch.save(model_state, path),
                OPTIMIZER_FILE: lambda path: torch.save(optimizer_state, path),
                STATE_FILE: lambda path: path.write_text(json.dumps(state)),
            },
        )
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp / "checkpoint"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _latest_checkpoint(run_dir: Path | None) -> tuple[dict, dict, dict] | None:
    """The run's newest checkpoint (``restore_dir``; ``run_dir`` None: storage behind a URI, Ray Train's own) as
    (whole model state, whole optimizer state, loop state), or None."""
    checkpoint = ray.train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else nullcontext() as latest:
        found = restore_dir(latest, run_dir)
        if found is None:
            return None
        d = found[0]
        return (
            torch.load(d / MODEL_FILE, map_location="cpu"),
            torch.load(d / OPTIMIZER_FILE, map_location="cpu"),
            json.loads((d / STATE_FILE).read_text()),
        )
