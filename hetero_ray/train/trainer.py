"""Launch a run on Ray Train v2: one worker per device, placed by its GPU-type label, each running the built-in
loop or a user's own."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
from ray.train import RunConfig as RayRunConfig
from ray.train.torch import TorchTrainer

from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL
from hetero_ray.config import ConfigError, RunConfig, load_config, parse_config
from hetero_ray.train.context import active, setup_worker
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


class HeteroTrainer:
    """``TorchTrainer`` for a mixed cluster: one Ray Train worker per device of ``config.devices``, placed by
    its GPU-type label, each running ``train_loop_per_worker(train_loop_config)`` once the run is planned
    (``None``: the built-in loop, which trains the config's workload).

    ``config`` is hetero-ray's run config (a ``RunConfig``, its dict, or a YAML path): the devices, the workload
    the planner profiles (the model the loop builds), ``train.global_batch`` and the emulation. ``devices``
    replaces its devices; ``run_config`` (Ray Train's) its name, storage and failure policy. Inside the loop,
    ``get_context()``, ``prepare_model`` and ``prepare_data_loader`` give the worker its device and its share;
    ``ray.train.report`` and ``ray.train.get_checkpoint`` are Ray Train's. After a worker fails the group
    restarts and is planned anew for the devices it then has. ``prepared``: ``prepare(config)`` already done
    (the CLI's, with a plan file).
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., None] | None = None,
        *,
        config: RunConfig | Mapping[str, Any] | str | Path,
        train_loop_config: Mapping[str, Any] | None = None,
        devices: Mapping[str, int] | None = None,
        run_config: RayRunConfig | None = None,
        prepared: Prepared | None = None,
    ):
        cfg = config if isinstance(config, RunConfig) else _load(config)
        if devices is not None:
            cfg = parse_config({**cfg.model_dump(exclude_unset=True), "devices": dict(devices)}, "devices")
        if run_config is not None:
            cfg = _with_ray_run_config(cfg, run_config)
        if cfg.elastic and train_loop_per_worker not in (None, train_worker):
            raise ConfigError(
                "train.min_workers: elastic runs need the built-in loop (a worker left without samples would hang an "
                "own loop's collectives); drop min_workers"
            )
        self.config = cfg
        self.loop = train_loop_per_worker or train_worker
        self.loop_config = dict(train_loop_config or {})
        self.run_config = run_config
        self.prepared = prepared or prepare(cfg)

    def fit(self) -> ray.train.Result:
        """Run the loop on the Ray cluster this process is connected to; Ray Train's ``Result``."""
        cfg, prepared = self.config, self.prepared
        emulated = cfg.emulation is not None
        if emulated:
            check_capacity(cfg)
        if cfg.elastic:
            if self.loop is not train_worker:
                raise ConfigError(
                    "train.min_workers: elastic runs need the built-in loop; own loops run on a fixed set"
                )
            # Any device of the run's types: after a loss the workers that remain are re-planned on
            # (a per-worker list would keep asking for the lost type and wait forever).
            workers = (cfg.train.min_workers, cfg.num_workers)
            selector = {GPU_TYPE_LABEL: f"in({','.join(cfg.devices)})"}
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
        given = self.run_config
        trainer = TorchTrainer(
            _worker(self.loop),
            train_loop_config={
                "hetero_ray": {
                    # The workers measure their speeds; the emulation's shares stay with the cluster.
                    "config": cfg.hidden().model_dump(),
                    "footprint": asdict(prepared.footprint),
                    "efficiency": prepared.efficiency,
                    "dilation": prepared.dilation,
                    "plan": prepared.plan.to_dict(),
                },
                "loop": self.loop_config,
            },
            scaling_config=scaling,
            run_config=RayRunConfig(
                name=cfg.run.name,
                storage_path=cfg.run.storage,
                checkpoint_config=given.checkpoint_config if given else CheckpointConfig(num_to_keep=3),
                failure_config=FailureConfig(max_failures=cfg.train.max_failures),
                callbacks=given.callbacks if given else None,
            ),
        )
        return trainer.fit()


def _worker(loop: Callable[..., None]) -> Callable[[dict[str, Any]], None]:
    """Ray Train's loop function: set the worker up, then run ``loop`` with the user's config (or none, when it
    takes no argument, as ``TorchTrainer`` allows)."""

    def train_loop_per_worker(config: dict[str, Any]) -> None:
        with active(setup_worker(config["hetero_ray"])):
            if inspect.signature(loop).parameters:
                loop(config["loop"])
            else:
                loop()

    return train_loop_per_worker


def _load(config: Mapping[str, Any] | str | Path) -> RunConfig:
    return load_config(config) if isinstance(config, (str, Path)) else parse_config(dict(config), "config")


def _with_ray_run_config(cfg: RunConfig, given: RayRunConfig) -> RunConfig:
    """``cfg`` with Ray Train's run name, storage and failure policy where ``given`` sets them."""
    run = {"name": given.name or cfg.run.name, "storage_path": given.storage_path or cfg.run.storage_path}
    train = {}
    if given.failure_config is not None:
        train["max_failures"] = given.failure_config.max_failures
    data = cfg.model_dump(exclude_unset=True)
    return parse_config({**data, "run": run, "train": {**data.get("train", {}), **train}}, "run_config")


def run_training(cfg: RunConfig, prepared: Prepared | None = None, progress: Any = None) -> TrainResult:
    """Run ``cfg``'s built-in loop on the Ray cluster this process is connected to, one worker per device."""
    trainer = HeteroTrainer(train_worker, config=cfg, train_loop_config={"progress": progress}, prepared=prepared)
    result = trainer.fit()
    return TrainResult(
        metrics=result.metrics or {},
        checkpoint_path=result.checkpoint.path if result.checkpoint else None,
        dilation=trainer.prepared.dilation,
    )
