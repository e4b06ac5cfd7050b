"""Launch a prepared run on Ray Train v2: one worker per device, placed by its GPU-type label."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
from ray.train import RunConfig as RayRunConfig
from ray.train.torch import TorchTrainer

from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL
from hetero_ray.config import ConfigError, RunConfig
from hetero_ray.train.loop import train_worker
from hetero_ray.train.prepare import Prepared, prepare, reserved_types


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a finished run hands back: rank 0's final metrics and where the last checkpoint is."""

    metrics: dict[str, Any]
    checkpoint_path: str | None
    dilation: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_capacity(cfg: RunConfig) -> None:
    """On an emulated cluster nodes never appear later: a missing type would wait forever, so fail now."""
    have: dict[str, float] = {}
    for node in ray.nodes():
        gpu_type = node.get("Labels", {}).get(GPU_TYPE_LABEL)
        if node["Alive"] and gpu_type:
            have[gpu_type] = have.get(gpu_type, 0) + node["Resources"].get(EMULATED_RESOURCE, 0)
    short = {t: (n, int(have.get(t, 0))) for t, n in cfg.devices.items() if have.get(t, 0) < n}
    if short:
        detail = ", ".join(f"{t}: asks {n}, cluster has {h}" for t, (n, h) in short.items())
        raise ConfigError(f"devices: the emulated cluster lacks devices ({detail})")


def run_training(cfg: RunConfig, prepared: Prepared | None = None, progress: Any = None) -> TrainResult:
    """Run ``cfg`` on the Ray cluster this process is connected to, one Ray Train worker per device."""
    prepared = prepared or prepare(cfg)
    emulated = cfg.emulation is not None
    if emulated:
        check_capacity(cfg)
    if cfg.elastic:
        # Any device of the run's types: after a loss the workers that remain are re-planned on
        # (a per-worker list would keep asking for the lost type and wait forever).
        workers, selector = (cfg.train.min_workers, cfg.num_workers), {GPU_TYPE_LABEL: f"in({','.join(cfg.devices)})"}
        elastic = {"elastic_resize_monitor_interval_s": cfg.train.resize_check_s}
    else:
        types = reserved_types(cfg, prepared.plan)
        workers, selector, elastic = len(types), [{GPU_TYPE_LABEL: t} for t in types], {}
    scaling = ScalingConfig(
        num_workers=workers,
        use_gpu=not emulated,
        resources_per_worker={"CPU": 1, EMULATED_RESOURCE: 1} if emulated else {"CPU": 1, "GPU": 1},
        label_selector=selector,
        **elastic,
    )
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            # The workers measure their speeds; the emulation's shares stay with the cluster.
            "config": cfg.hidden().model_dump(),
            "footprint": asdict(prepared.footprint),
            "efficiency": prepared.efficiency,
            "dilation": prepared.dilation,
            "plan": prepared.plan.to_dict(),
            "progress": progress,
        },
        scaling_config=scaling,
        run_config=RayRunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage,
            checkpoint_config=CheckpointConfig(num_to_keep=3),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
        ),
    )
    result = trainer.fit()
    return TrainResult(
        metrics=result.metrics or {},
        checkpoint_path=result.checkpoint.path if result.checkpoint else None,
        dilation=prepared.dilation,
    )
