"""Everything decided before launch: validate the run against the catalog and the workload, plan it, calibrate emulation.

Nothing here touches Ray, so bad input is rejected in seconds, before any cluster is reached.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hetero_ray.cluster.catalog import Catalog, UnknownGpuType, load_catalog
from hetero_ray.config import ONEBIT_OPTIMIZERS, ConfigError, RunConfig
from hetero_ray.perf.footprint import Footprint, cpu_seconds_per_sample, measure_footprint
from hetero_ray.perf.history import load as load_history
from hetero_ray.perf.history import options_hash
from hetero_ray.perf.model import fit_perf_model
from hetero_ray.plan import search
from hetero_ray.plan.data_parallel import fastest_zero_stage, plan_data_parallel, zero_stage_plans
from hetero_ray.plan.plan import Infeasible, Plan, PlanError
from hetero_ray.plan.plan_file import load_plan
from hetero_ray.plan.stages import MeasuredSpeeds
from hetero_ray.plan.topology import MixedNodeKind, NodeKind, Topology
from hetero_ray.train.precision import choose_precision
from hetero_ray.train.sync import deepspeed_config
from hetero_ray.workloads import build_workload

# Modelled step times are stretched to this multiple of what the CPU needs, so
# that padding (not CPU contention) sets every emulated step time.
DILATION_HEADROOM = 3.0
# Speed of a type = catalog peak at its precision × this, until profiles say better.
DEFAULT_EFFICIENCY = 0.4


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """Everything decided before launch: the catalog, the workload's footprint, the plan, the emulation."""

    catalog: Catalog
    footprint: Footprint
    plan: Plan
    efficiency: float
    dilation: float | None


def _workload_factory(cfg: RunConfig):
    def factory():
        torch.manual_seed(cfg.train.seed)
        return build_workload(cfg.workload.name, cfg.workload.options)

    return factory


def rank_types(cfg: RunConfig) -> list[str]:
    """One GPU type per worker, in the config's order (the label selector list)."""
    return [t for t, n in cfg.devices.items() for _ in range(n)]


def reserved_types(cfg: RunConfig, plan: Plan) -> list[str]:
    """The workers to start, one GPU type each in the config's order: every device but those the plan leaves
    without samples (they would hold a GPU and do nothing). An elastic run reserves them all: after a loss
    its re-plan may need them."""
    if cfg.elastic:
        return rank_types(cfg)
    left = Counter({e.gpu_type: e.count for e in plan.excluded})
    reserved = []
    for t in rank_types(cfg):
        if left[t]:
            left[t] -= 1
        else:
            reserved.append(t)
    return reserved


def topology_for(cfg: RunConfig, catalog: Catalog, types: list[str]) -> Topology:
    """The links the planner prices: every link is ``cfg.link`` (the slowest link, which an emulated
    cluster pads every synchronisation to), or free when the config names none (nothing is priced
    or emulated). The types of each of ``train.tensor_parallel_across`` also share nodes, one device of each
    per node, as many nodes as the workers of ``types`` allow."""
    link = cfg.link
    bandwidth = link.bandwidth_bytes_s if link else math.inf
    latency = link.latency_s if link else 0.0
    per_node = cfg.emulation.gpus_per_node if cfg.emulation else max(cfg.devices.values())
    mixed = tuple(
        MixedNodeKind(
            gpu_types=tuple(group),
            nodes=min(types.count(t) for t in group),
            intra_bandwidth_bytes_s=bandwidth,
            nic_bandwidth_bytes_s=bandwidth,
            intra_latency_s=latency,
        )
        for group in cfg.train.tensor_parallel_across
    )
    return Topology(
        mixed=tuple(m for m in mixed if m.nodes > 0),
        nodes={
            t: NodeKind(
                gpu_type=t,
                gpus_per_node=per_node,
                intra_bandwidth_bytes_s=bandwidth,
                nic_bandwidth_bytes_s=bandwidth,
                intra_latency_s=latency,
            )
            for t in set(types)
        },
        inter_latency_s=latency,
    )


def profiled_speeds(cfg: RunConfig, catalog: Catalog, workers: list[str] | None = None) -> MeasuredSpeeds | None:
    """Seconds per sample by (type, precision, micro-batch), and each type's fixed cost of a step, from the
    performance model fitted to ``profile_history``; ``None`` without a history.

    Micro-batch ``None`` prices a data-parallel worker, at an even share of the global batch. Every time is the
    expected slowest of the ``workers``' (GPU types; default the config's) by ``PerfModel.straggler_factor``:
    their steps meet at every synchronisation, and each varies as its type's profiled repeats did.
    """
    if cfg.profile_history is None:
        return None
    try:
        model = fit_perf_model(
            load_history(cfg.profile_history),
            cfg.workload.name,
            workload_hash=options_hash(cfg.workload.options),
            emulated=cfg.emulation is not None,
            catalog=catalog,
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"profile_history: {cfg.profile_history}: {exc}") from None
    even = max(1, cfg.train.global_batch // cfg.num_workers)
    slowest = model.straggler_factor(
        [(t, choose_precision(catalog.get(t), cfg.train.precision)) for t in workers or rank_types(cfg)]
    )

    def seconds_per_sample(gpu_type: str, precision: str, micro_batch: int | None) -> float:
        micro = micro_batch or even
        return slowest * model.step_seconds(gpu_type, micro, precision) / micro

    def fixed_seconds(gpu_type: str, precision: str) -> float:
        return slowest * model.fixed_seconds(gpu_type, precision)

    return MeasuredSpeeds(per_sample=seconds_per_sample, fixed_seconds=fixed_seconds, straggler=slowest)


def plan_for(
    cfg: RunConfig, types: list[str], catalog: Catalog, footprint: Footprint, efficiency: float, *, emulated: bool
) -> Plan:
    """The plan for workers of ``types`` under ``cfg`` (before launch, and again on the workers Ray gave).

    A proportional split goes to the placement planner, which weighs pipelines
    against data parallelism; an equal or explicit split is data parallelism with
    that split, as asked. Runs that cannot be pipelined yet stay data-parallel
    (``data_parallel_only``). A ZeRO stage shards data parallelism's state; stage 1 also shards the state of
    each pipeline stage over its replicas, and takes the faster of the two; ``zero_stage: auto`` takes the
    fastest predicted step of the unsharded plan and stages 1–3.
    """
    stage = cfg.optimizer.zero_stage
    link = cfg.link
    speeds = profiled_speeds(cfg, catalog, types)

    def data_parallel(zero_stage: int) -> Plan | Infeasible:
        return plan_data_parallel(
            types,
            catalog,
            footprint,
            global_batch=cfg.train.global_batch,
            split=cfg.train.split,
            precision=cfg.train.precision,
            efficiency=efficiency,
            max_micro=cfg.train.max_micro_batch,
            emulated=emulated,
            link=(link.bandwidth_bytes_s, link.latency_s) if link else None,
            compressed=cfg.optimizer.name in ONEBIT_OPTIMIZERS,
            reduce_dtype=cfg.train.reduce_dtype,
            zero_stage=zero_stage,
            seconds_per_sample=speeds,
        )

    def searched(zero_stage: int) -> Plan | Infeasible:
        # The placement search shards within pipeline stages at ZeRO-1 only (stages 2 and 3 reduce and gather
        # on every pass, which would tie the pipelines' schedules together), without tensor parallelism.
        if cfg.train.split != "proportional" or not footprint.layers:
            return data_parallel(0) if zero_stage == 0 else Infeasible("no pipeline stages: an even or fixed split")
        plans = search.plan(
            types,
            catalog,
            footprint,
            global_batch=cfg.train.global_batch,
            topology=topology_for(cfg, catalog, types),
            optimizer=cfg.optimizer.name,
            precision=cfg.train.precision,
            efficiency=efficiency,
            emulated=emulated,
            seconds_per_sample=speeds,
            reduce_dtype=cfg.train.reduce_dtype,
            tensor_parallel=search.powers_of_two(cfg.train.max_tensor_parallel) if zero_stage == 0 else (1,),
            zero_stage=zero_stage,
            top_k=1,
            **({"max_stages": 1} if data_parallel_only(cfg, footprint) else {}),
        )
        return plans if isinstance(plans, Infeasible) else plans[0]

    def at_stage(zero_stage: int) -> Plan | Infeasible:
        plans = zero_stage_plans(zero_stage, searched, data_parallel)
        return plans[0] if isinstance(plans, list) else plans

    plan = fastest_zero_stage({k: at_stage(k) for k in (0, 1, 2, 3)}) if stage == "auto" else at_stage(stage)
    if isinstance(plan, Infeasible):
        raise PlanError(plan.reason)
    if speeds is not None and speeds.straggler > 1:
        why = (
            f"times priced at the slowest of {len(types)} workers: {speeds.straggler - 1:.1%} over one worker's "
            "profiled step, from how much the profile's repeats varied"
        )
        plan = replace(plan, explanation=f"{plan.explanation}; {why}")
    return check_plan(plan, footprint, cfg)


def data_parallel_only(cfg: RunConfig, footprint: Footprint) -> bool:
    """Whether the run cannot be pipelined yet: 1-bit optimizers, ZeRO and batch statistics run on data
    parallelism only."""
    return cfg.optimizer.name in ONEBIT_OPTIMIZERS or bool(footprint.batch_coupled)


def check_held_out(cfg: RunConfig, footprint: Footprint) -> None:
    """With evaluation, the held-out samples must leave a global batch to train on and one for every worker."""
    train = cfg.train
    if not train.eval_every:
        return
    left = footprint.dataset_samples - train.eval_samples
    if left < train.global_batch:
        raise ConfigError(
            f"train.eval_samples: holding out {train.eval_samples} of the workload's {footprint.dataset_samples} "
            f"samples leaves {max(left, 0)}, fewer than train.global_batch {train.global_batch}; hold out fewer"
        )
    if train.eval_samples < cfg.num_workers:
        raise ConfigError(
            f"train.eval_samples: {train.eval_samples} is fewer than the {cfg.num_workers} workers that share "
            "the evaluation; hold out at least one sample per worker"
        )


def workload_of(cfg: RunConfig) -> dict:
    """The workload a plan for ``cfg`` is made for, as plans record it."""
    return {"name": cfg.workload.name, "options": dict(cfg.workload.options)}


def check_plan(plan: Plan, footprint: Footprint, cfg: RunConfig) -> Plan:
    """``plan``, unless it cuts what the run needs whole: the evaluation runs on devices holding the whole
    model; a workload that normalises over the batch (BatchNorm) needs each device's whole share at once
    (``train/batch_norm.py`` shares statistics across devices exactly, but not across one device's
    micro-batches, pipeline stages or a re-split mid-run). Returned with the workload recorded."""
    plan = replace(plan, workload=workload_of(cfg))
    if plan.is_pipelined and cfg.train.eval_every:
        raise PlanError(
            "train.eval_every: the evaluation runs on devices holding the whole model, and this plan pipelines "
            "it or splits its layers; drop eval_every, or make data parallelism fit (a smaller "
            "train.max_micro_batch, train.max_tensor_parallel: 1)"
        )
    if not footprint.batch_coupled:
        return plan
    layer = f"workload layer {footprint.batch_coupled[0]} normalises over the whole batch"
    if cfg.train.rebalance_every is not None:
        raise ConfigError(
            f"train.rebalance_every: {layer}, and a re-split may cut a device's share into micro-batches; "
            "drop rebalance_every, or use GroupNorm/LayerNorm"
        )
    if plan.is_pipelined:
        raise PlanError(f"{layer}, which pipeline stages cannot share; use data parallelism, or GroupNorm/LayerNorm")
    split = next((r for r in plan.roles if r.micro_batch < r.local_batch), None)
    if split is not None:
        capped = cfg.train.max_micro_batch is not None and split.micro_batch == cfg.train.max_micro_batch
        raise PlanError(
            f"{layer}, so each device must run its share in one forward pass, but {split.gpu_type}'s "
            f"{split.local_batch} samples run in micro-batches of {split.micro_batch} "
            f"({'train.max_micro_batch' if capped else 'its memory'}); "
            f"{'raise train.max_micro_batch, ' if capped else ''}lower train.global_batch, or use GroupNorm/LayerNorm"
        )
    return plan


def given_plan(path: str, cfg: RunConfig, catalog: Catalog, footprint: Footprint) -> Plan:
    """A plan from a file (``hetero-ray plan --output``), checked against this run's devices and batch."""
    plan = load_plan(path, catalog=catalog, n_layers=len(footprint.layers) or None)
    planned = sorted([r.gpu_type for r in plan.roles] + [e.gpu_type for e in plan.excluded for _ in range(e.count)])
    if planned != sorted(rank_types(cfg)):
        raise PlanError(
            f"{path}: the plan is for devices {dict(Counter(planned))}, the config has {dict(cfg.devices)}; "
            "plan for the config's devices (hetero-ray plan)"
        )
    if plan.workload is not None and plan.workload != workload_of(cfg):
        made, given = plan.workload, workload_of(cfg)
        raise PlanError(
            f"{path}: the plan is for workload {made['name']} {json.dumps(made['options'], sort_keys=True)}, the "
            f"config trains {given['name']} {json.dumps(given['options'], sort_keys=True)}; plan from the config "
            "(hetero-ray plan --config)"
        )
    if plan.global_batch != cfg.train.global_batch:
        raise PlanError(
            f"{path}: global_batch {plan.global_batch} differs from the config's train.global_batch "
            f"{cfg.train.global_batch}; use the same batch in both"
        )
    if plan.is_pipelined and not footprint.layers:
        raise PlanError(
            f"{path}: the plan has pipeline stages but workload {cfg.workload.name!r} cannot be cut into layers"
        )
    if cfg.optimizer.zero_stage != "auto" and plan.zero_stage != cfg.optimizer.zero_stage:
        raise PlanError(
            f"{path}: the plan is for ZeRO stage {plan.zero_stage}, the config's optimizer.zero_stage is "
            f"{cfg.optimizer.zero_stage}; plan with the config (hetero-ray plan) or set the same stage"
        )
    if plan.is_pipelined and plan.zero_stage > 1:
        raise PlanError(
            f"{path}: the plan has pipeline stages, and ZeRO stage {plan.zero_stage} reduces and gathers on every "
            "pass, which would tie the pipelines' schedules together; use zero_stage: 1 or 0, or a data-parallel plan"
        )
    if plan.tensor_parallel > 1 and plan.zero_stage:
        raise PlanError(
            f"{path}: the plan has tensor-parallel stages, which ZeRO does not shard; use zero_stage: 0 or a plan "
            "without tensor parallelism"
        )
    return check_plan(plan, footprint, cfg)


def check_storage(storage_path: str) -> None:
    """A local ``run.storage_path`` must be a directory or not exist yet (Ray Train creates it); a URI
    (``s3://…``) is the storage's to check."""
    if "://" in storage_path:
        return
    path = Path(storage_path).expanduser()
    blocker = next((p for p in (path, *path.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        inside = "" if blocker == path else f", so {path} cannot be created"
        raise ConfigError(
            f"run.storage_path: {blocker} is a file{inside}; name a directory (Ray Train keeps checkpoints under it)"
        )


def prepare(cfg: RunConfig, plan_path: str | None = None) -> Prepared:
    """Validate the run against the catalog and the workload, and plan it (or check ``plan_path``'s plan);
    raise on bad input."""
    catalog = load_catalog(cfg.gpus_file)
    for name in cfg.devices:
        try:
            spec = catalog.get(name)
        except UnknownGpuType as exc:
            raise ConfigError(f"devices: {exc}") from None
        if isinstance(cfg.train.precision, dict):
            problem = spec.precision_problem(choose_precision(spec, cfg.train.precision))
            if problem:
                raise ConfigError(f"train.precision.{name}: {problem}")
    check_storage(cfg.run.storage_path)
    footprint = measure_footprint(_workload_factory(cfg))
    problem = footprint.batch_problem(cfg.train.global_batch)
    if problem:
        raise ConfigError(f"train.global_batch: {problem}")
    check_held_out(cfg, footprint)
    if cfg.optimizer.name in ONEBIT_OPTIMIZERS:
        # The user's DeepSpeed keys against ours, before any worker starts DeepSpeed.
        deepspeed_config(cfg, cfg.num_workers, on_gpu=cfg.emulation is None)
    efficiency = cfg.emulation.efficiency if cfg.emulation else DEFAULT_EFFICIENCY
    emulated = cfg.emulation is not None
    plan = (
        given_plan(plan_path, cfg, catalog, footprint)
        if plan_path
        else plan_for(cfg, rank_types(cfg), catalog, footprint, efficiency, emulated=emulated)
    )
    if plan.emulated != emulated:
        plan = replace(plan, emulated=emulated)
    dilation = None
    if cfg.emulation is not None:
        # Throttled devices are timed, not padded: their seconds are real ones.
        dilation = 1.0 if cfg.emulation.throttled else cfg.emulation.dilation
        if dilation == "auto":
            dilation = calibrate_dilation(cfg, plan)
    return Prepared(catalog=catalog, footprint=footprint, plan=plan, efficiency=efficiency, dilation=dilation)


def calibrate_dilation(cfg: RunConfig, plan: Plan) -> float:
    """A dilation that makes the fastest emulated device's modelled time ``DILATION_HEADROOM`` × the CPU's.

    The CPU's time is one timed forward+backward per sample, times the number of
    workers per core (they share this machine).
    """
    workload = _workload_factory(cfg)()
    cpu = cpu_seconds_per_sample(workload, min(r.micro_batch for r in plan.roles))
    contention = max(1.0, cfg.num_workers / (os.cpu_count() or 1))
    fastest = min(r.predicted_compute_s / r.local_batch for r in plan.roles)
    return DILATION_HEADROOM * cpu * contention / fastest
