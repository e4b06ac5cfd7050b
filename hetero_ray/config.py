"""The one typed configuration of a training run, validated at the edge.

Every entry point (``jobs/train.py``, ``hetero-ray demo``, the benchmarks) loads a
YAML file into ``RunConfig``; everything downstream receives this object and never
re-parses the command line or the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetero_ray.cluster.cpu_slices import check_shares
from hetero_ray.strict_yaml import YamlError, load_yaml
from hetero_ray.suggest import did_you_mean


class ConfigError(ValueError):
    """Bad input: the message is one line saying what, where and what would be valid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LinkConfig(_Strict):
    """The slowest link of the gradient all-reduce: the planner prices communication on it, and an
    emulated cluster pads every synchronisation to bytes ÷ bandwidth + latency per message, × dilation."""

    bandwidth_gbps: float = Field(gt=0, description="Link bandwidth in Gbit/s (1 for 1 GbE, 100 for EDR InfiniBand).")
    latency_us: float = Field(10.0, ge=0, description="Latency per message in microseconds.")

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


class DeviceEvent(_Strict):
    """Something that happens to one emulated device mid-run: it throttles, or loses memory."""

    step: int = Field(ge=0, description="The step from which it holds.")
    gpu_type: str
    index: int = Field(0, ge=0, description="Which worker of that type: 0 is the first.")
    speed: float | None = Field(None, gt=0, description="Multiplies the device's speed (0.5: half speed).")
    memory_gib: float | None = Field(None, gt=0, description="The device's memory from then on.")

    @model_validator(mode="after")
    def _something_happens(self) -> DeviceEvent:
        if self.speed is None and self.memory_gib is None:
            raise ValueError("give speed and/or memory_gib")
        return self


class EmulationConfig(_Strict):
    """Emulated GPUs: real CPU computation, padded to each type's modelled time or throttled to a CPU share."""

    mode: Literal["padded", "throttled"] = Field(
        "padded",
        description="'padded': every step padded to the catalog's modelled time (speeds known in advance); "
        "'throttled': each device a cgroup with cpu_share of one core, so its speed is real and must be measured.",
    )
    cpu_share: dict[str, float] | None = Field(
        None,
        description="throttled: each GPU type's share of one core per device, e.g. {A100-80GB: 0.34}. Read only by "
        "the emulated cluster; the planner, the performance model and the training loop never see it.",
    )
    dilation: float | Literal["auto"] = Field(
        "auto",
        description="Multiplies every modelled GPU time so it exceeds this CPU's real compute time; "
        "'auto' calibrates it from a timed step of the workload.",
    )
    efficiency: float = Field(0.4, gt=0, le=1, description="Fraction of the catalog's peak FLOP/s a step achieves.")
    gpus_per_node: int = Field(2, ge=1, description="Emulated GPUs per emulated Ray node.")
    events: list[DeviceEvent] = Field(
        default_factory=list, description="Devices that throttle or lose memory mid-run (to test rebalancing)."
    )
    autocast: bool = Field(
        False,
        description="Emulated devices compute in their plan's precision (CPU autocast; fp16 with a loss scaler) "
        "instead of fp32. Off by default: CPU half precision is slower than fp32, not faster as on a GPU.",
    )

    @field_validator("dilation")
    @classmethod
    def _positive(cls, v: float | str) -> float | str:
        if v != "auto" and v <= 0:
            raise ValueError("must be > 0 or 'auto'")
        return v

    @model_validator(mode="after")
    def _shares_with_throttling(self) -> EmulationConfig:
        if self.mode == "throttled" and self.dilation != "auto":
            raise ValueError("throttled devices run in real time; drop emulation.dilation (it pads padded devices)")
        if self.mode == "padded" and self.cpu_share is not None:
            raise ValueError("cpu_share throttles devices; set emulation.mode: throttled, or drop cpu_share")
        return self

    @property
    def throttled(self) -> bool:
        return self.mode == "throttled"

    def hidden(self) -> EmulationConfig:
        """This section without ``cpu_share``: what the planner and the workers may see."""
        return self.model_copy(update={"cpu_share": None})


class WorkloadConfig(_Strict):
    """Which model to train: a built-in name (``gpt``) or ``module:function``."""

    name: str = "gpt"
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the workload factory.")


class ScheduleConfig(_Strict):
    """The learning rate step by step: a linear warm-up to ``train.lr``, then constant or a cosine decay."""

    name: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="Steps rising linearly to train.lr (step k: lr (k+1)/warmup).")
    min_lr: float = Field(0.0, ge=0, description="cosine: the rate the decay ends at, on the last step's update.")


class TrainConfig(_Strict):
    """The optimisation: batch, steps, optimiser, split, precision, checkpoints."""

    global_batch: int = Field(72, gt=0, description="Samples per optimiser step over all workers.")
    steps: int = Field(100, gt=0)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = 0
    precision: Literal["auto", "fp32"] | dict[str, Literal["auto", "fp32", "bf16", "fp16"]] = Field(
        "auto",
        description="'auto': bf16 on Ampere and newer, fp16 with loss scaling on Volta/Turing, fp32 otherwise; or "
        "per GPU type, e.g. {V100-16GB: fp32, A100-80GB: bf16} (types not named: auto).",
    )
    split: Literal["proportional", "equal"] | dict[str, float] = Field(
        "proportional",
        description="How the global batch is shared: by modelled speed, equally, or by explicit weights per GPU type.",
    )
    max_micro_batch: int | None = Field(
        None, gt=0, description="Cap on samples per forward pass (else memory decides)."
    )
    max_tensor_parallel: int = Field(
        1,
        ge=1,
        description="Largest tensor-parallel degree the planner may choose for a whole plan (a power of two): "
        "every stage a group of that many devices of one type on one node, splitting its GPT blocks. 1: none.",
    )
    tensor_parallel_across: list[list[str]] = Field(
        default_factory=list,
        description="GPU types whose devices share nodes, one of each per node, e.g. [[A100-80GB, V100-16GB]]: the "
        "planner may then also make a stage a group of one device of each, its GPT blocks split in proportion to "
        "their speeds, where max_tensor_parallel allows a group that large. Every emulated device is on one host.",
    )
    checkpoint_every: int = Field(20, gt=0, description="Steps between checkpoints.")
    report_every: int = Field(10, gt=0, description="Steps between metric reports.")
    duration_s: float | None = Field(
        None, gt=0, description="Stop early after this much wall time (the demo's minute)."
    )
    rebalance_every: int | None = Field(
        None,
        ge=1,
        description="Data parallelism: steps between re-derivations of the shares from each worker's measured "
        "compute time. None: the planned shares hold (an out-of-memory still re-splits).",
    )
    rebalance_threshold: float = Field(
        0.05, ge=0, description="Re-split when the slowest worker's compute exceeds the mean by this fraction."
    )
    rebalance_damping: float = Field(
        0.7, gt=0, le=1, description="How far each speed estimate moves toward its measurement (1: all the way)."
    )
    max_failures: int = Field(
        3, ge=-1, description="Restarts from the last checkpoint after a worker or node dies (-1: no limit)."
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        description="Elastic: after a loss, go on with as few as this many workers, re-planned for the same "
        "global batch; they grow back when devices return. None: all devices or none.",
    )
    eval_every: int | None = Field(
        None, ge=1, description="Steps between evaluations of the loss on held-out samples (and after the last step)."
    )
    eval_samples: int = Field(
        64, ge=1, description="With eval_every: the dataset's last this-many samples, never trained on, evaluated."
    )
    lr_schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    grad_clip: float | None = Field(
        None,
        gt=0,
        description="Scale the full-batch gradient down to this global L2 norm when it is larger (as "
        "clip_grad_norm_ on one process: the same under any split).",
    )
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Gradients on the wire (adam): cast for the all-reduce, kept and applied in fp32, as DDP's "
        "bf16/fp16 compression hooks do; bf16 and fp16 halve the bytes sent.",
    )
    bucket_mb: float = Field(
        25.0,
        gt=0,
        description="Gradient bucket size in MiB (DDP's bucket_cap_mb): each bucket is all-reduced as soon as "
        "the step's last backward has filled it.",
    )
    resize_check_s: float = Field(
        60.0,
        gt=0,
        description="Elastic: seconds between Ray Train's checks for returned devices; on finding more it "
        "restarts the group from the last checkpoint with them (ScalingConfig.elastic_resize_monitor_interval_s).",
    )

    @field_validator("max_tensor_parallel")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two; use 1, 2, 4 or 8")
        return v

    @field_validator("split")
    @classmethod
    def _weights_positive(cls, v: Any) -> Any:
        if isinstance(v, dict) and (not v or any(w <= 0 for w in v.values())):
            raise ValueError("weights per GPU type must be > 0")
        return v


ONEBIT_OPTIMIZERS = ("onebit_adam", "zero_one_adam")
OPTIMIZERS = ("adam", *ONEBIT_OPTIMIZERS)
ZeroStage = Literal[0, 1, 2, 3, "auto"]
# For the CLI's --zero-stage and the planner's request check, which read no config file.
ZERO_STAGES: tuple[int | str, ...] = get_args(ZeroStage)
# DeepSpeed's 1-bit Adam tutorial warms up for roughly 15-25% of training before compressing.
DEFAULT_FREEZE_FRACTION = 0.15


class OptimizerConfig(_Strict):
    """Adam (torch AdamW) or DeepSpeed's compressed-communication Adams."""

    name: Literal["adam", "onebit_adam", "zero_one_adam"] = "adam"
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's moment decay rates, for every optimizer.")
    freeze_step: int | None = Field(
        None, ge=1, description="onebit_adam: full-precision warm-up steps; default 15% of train.steps."
    )
    var_freeze_step: int | None = Field(
        None, ge=1, description="zero_one_adam: steps after which the variance is frozen; default 15% of train.steps."
    )
    var_update_scaler: int = Field(16, ge=1, description="zero_one_adam: variance update interval growth.")
    local_step_scaler: int = Field(32678, ge=1, description="zero_one_adam: local-step interval growth.")
    local_step_clipper: int = Field(16, ge=1, description="zero_one_adam: largest local-step interval.")
    zero_stage: ZeroStage = Field(
        0,
        description="ZeRO stage: 1 shards Adam's state across the data-parallel devices in proportion to the "
        "memory each has to spare, 2 also the gradients, 3 also the weights; 'auto': the planner picks the "
        "stage whose step it predicts fastest. Within pipelines only stage 1 (each stage's Adam state over its "
        "replicas); 1-bit optimizers need 0.",
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="onebit_adam / zero_one_adam: more DeepSpeed config, merged into the one hetero-ray writes "
        "(e.g. {optimizer: {params: {eps: 1.0e-6}}}); a key hetero-ray sets must keep its value.",
    )

    @model_validator(mode="after")
    def _fits_the_optimizer(self) -> OptimizerConfig:
        if self.zero_stage != 0 and self.name in ONEBIT_OPTIMIZERS:
            raise ValueError(
                f"{self.name} is not compatible with ZeRO (stage {self.zero_stage}); set optimizer.zero_stage: 0"
            )
        if self.deepspeed and self.name not in ONEBIT_OPTIMIZERS:
            raise ValueError(
                f"deepspeed: {self.name} runs on hetero-ray's own engine, not DeepSpeed; the DeepSpeed config "
                "applies to onebit_adam and zero_one_adam"
            )
        return self

    def warmup_steps(self, total_steps: int) -> int:
        """The uncompressed warm-up: freeze_step (1-bit Adam) or var_freeze_step (0/1 Adam), or the default fraction."""
        explicit = self.freeze_step if self.name == "onebit_adam" else self.var_freeze_step
        return explicit or max(1, round(DEFAULT_FREEZE_FRACTION * total_steps))


class RunStorage(_Strict):
    """Where Ray Train keeps checkpoints; the same name and path resume a run."""

    name: str = "hetero-ray"
    storage_path: str = "~/hetero-ray-runs"

    @property
    def is_uri(self) -> bool:
        """Whether the storage is a URI (``s3://``, ``gs://``, ``file://``…), read through pyarrow's filesystems."""
        return "://" in self.storage_path

    @property
    def storage(self) -> str:
        """What Ray Train is given: a URI as written (query included), a local path with ``~`` expanded."""
        return self.storage_path if self.is_uri else str(Path(self.storage_path).expanduser())

    @property
    def run_dir(self) -> Path | None:
        """The run's local folder under the storage, where Ray Train keeps its checkpoints; ``None`` when the
        storage is a URI."""
        return None if self.is_uri else Path(self.storage) / self.name

    @property
    def run_uri(self) -> str:
        """The run's folder as a URI or path: where its result is written beside its checkpoints."""
        base, _, query = self.storage.partition("?")
        return f"{base.rstrip('/')}/{self.name}" + (f"?{query}" if query else "")


class RunConfig(_Strict):
    """A whole run: which devices, which workload, how to train, where to store."""

    devices: dict[str, int] = Field(description="Workers per GPU type (catalog names), e.g. {A100-80GB: 2}.")
    emulation: EmulationConfig | None = Field(None, description="Present: the devices are emulated on CPU.")
    link: LinkConfig | None = Field(
        None, description="Slowest link between workers; absent: communication is neither priced nor emulated."
    )
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    run: RunStorage = Field(default_factory=RunStorage)
    gpus_file: str | None = Field(None, description="YAML of extra GPU types (same schema as the catalog).")
    profile_history: str | None = Field(
        None,
        description="Parquet history from `hetero-ray profile`: the planner then prices each type with the "
        "performance model fitted to it instead of catalog peak × efficiency.",
    )

    @field_validator("devices")
    @classmethod
    def _counts_positive(cls, v: dict[str, int]) -> dict[str, int]:
        if not v:
            raise ValueError("needs at least one GPU type, e.g. {A100-80GB: 2}")
        bad = {k: n for k, n in v.items() if n < 1}
        if bad:
            raise ValueError(f"worker counts must be >= 1 (got {bad})")
        return v

    @model_validator(mode="after")
    def _events_name_devices(self) -> RunConfig:
        for i, event in enumerate(self.emulation.events if self.emulation else ()):
            count = self.devices.get(event.gpu_type, 0)
            if event.index >= count:
                raise ValueError(
                    f"emulation.events.{i}: no worker {event.gpu_type} #{event.index}; "
                    f"devices has {count} of that type (index 0..{count - 1})"
                )
        return self

    @model_validator(mode="after")
    def _precision_names_devices(self) -> RunConfig:
        if isinstance(self.train.precision, dict):
            for gpu_type in self.train.precision:
                if gpu_type not in self.devices:
                    raise ValueError(
                        f"train.precision.{gpu_type}: not a GPU type of the run{did_you_mean(gpu_type, self.devices)}; "
                        f"devices has {', '.join(self.devices)}"
                    )
        return self

    @model_validator(mode="after")
    def _shares_fit(self) -> RunConfig:
        # The shares are checked where they are known; a run on a cluster someone else throttled names none.
        if self.emulation and self.emulation.cpu_share is not None:
            try:
                check_shares(self.devices, self.emulation.cpu_share)
            except ValueError as exc:
                raise ValueError(f"emulation.cpu_share: {exc}") from None
        return self

    @model_validator(mode="after")
    def _reduce_dtype_with_adam(self) -> RunConfig:
        if self.train.reduce_dtype != "fp32" and self.optimizer.name in ONEBIT_OPTIMIZERS:
            raise ValueError(
                f"train.reduce_dtype: {self.train.reduce_dtype} casts adam's gradients; {self.optimizer.name} "
                f"compresses its own, so use reduce_dtype: fp32 with it"
            )
        return self

    @model_validator(mode="after")
    def _schedule_fits_the_run(self) -> RunConfig:
        schedule, train = self.train.lr_schedule, self.train
        if schedule.warmup_steps >= train.steps:
            raise ValueError(
                f"train.lr_schedule.warmup_steps: {schedule.warmup_steps} is not below train.steps {train.steps}, "
                f"so the rate would never reach train.lr; use fewer warm-up steps"
            )
        if schedule.min_lr > train.lr:
            raise ValueError(
                f"train.lr_schedule.min_lr: {schedule.min_lr:g} is above train.lr {train.lr:g}; the decay ends below "
                "where it starts"
            )
        if train.grad_clip is not None and self.optimizer.name in ONEBIT_OPTIMIZERS:
            raise ValueError(
                f"train.grad_clip: {self.optimizer.name} applies its own compressed momentum, which hetero-ray does "
                "not clip; use adam to clip, or drop grad_clip"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel_splits_blocks(self) -> RunConfig:
        train = self.train
        why = (
            f"optimizer {self.optimizer.name}"
            if self.optimizer.name in ONEBIT_OPTIMIZERS
            else f"optimizer.zero_stage {self.optimizer.zero_stage}"
            if self.optimizer.zero_stage not in (0, "auto")
            else f"train.split {train.split!r}"
            if train.split != "proportional"
            else None
        )
        if train.max_tensor_parallel > 1 and why:
            raise ValueError(
                f"train.max_tensor_parallel: {train.max_tensor_parallel} needs the placement planner, and {why} "
                "runs data parallelism only; use max_tensor_parallel: 1 with it"
            )
        return self

    @model_validator(mode="after")
    def _groups_across_types_name_devices(self) -> RunConfig:
        for k, group in enumerate(self.train.tensor_parallel_across):
            where = f"train.tensor_parallel_across[{k}]"
            missing = [t for t in group if t not in self.devices]
            if missing:
                raise ValueError(
                    f"{where}: {missing[0]} is not a GPU type of the run{did_you_mean(missing[0], self.devices)}; "
                    f"devices has {', '.join(self.devices)}"
                )
            if len(set(group)) < 2 or len(set(group)) < len(group):
                raise ValueError(f"{where}: {group} must name two or more different GPU types, each once")
            if len(group) > self.train.max_tensor_parallel:
                raise ValueError(
                    f"{where}: a group of {len(group)} needs train.max_tensor_parallel >= {len(group)} (it is "
                    f"{self.train.max_tensor_parallel})"
                )
        return self

    @model_validator(mode="after")
    def _min_workers_within_devices(self) -> RunConfig:
        if self.train.min_workers is not None and self.train.min_workers > self.num_workers:
            raise ValueError(
                f"train.min_workers: {self.train.min_workers} is more than the {self.num_workers} devices; "
                f"use 1..{self.num_workers}"
            )
        return self

    @model_validator(mode="after")
    def _onebit_compresses(self) -> RunConfig:
        # DeepSpeed's OnebitAdam compresses only after freeze_step: a warm-up as long as the run is plain Adam
        # with 1-bit's overheads, and its results would be reported as 1-bit's.
        if self.optimizer.name == "onebit_adam":
            warmup, steps = self.optimizer.warmup_steps(self.train.steps), self.train.steps
            if warmup >= steps:
                given = "" if self.optimizer.freeze_step else " (the default, 15% of train.steps, at least 1)"
                fix = f"a freeze_step below {steps} or more train.steps" if steps > 1 else "train.steps >= 2"
                raise ValueError(
                    f"optimizer.freeze_step: {warmup}{given} is not below train.steps {steps}, so compression "
                    f"would never engage; use {fix}"
                )
        return self

    def hidden(self) -> RunConfig:
        """The config without the emulation's truth (``cpu_share``): what is handed to the workers."""
        if self.emulation is None or self.emulation.cpu_share is None:
            return self
        return self.model_copy(update={"emulation": self.emulation.hidden()})

    @property
    def num_workers(self) -> int:
        return sum(self.devices.values())

    @property
    def elastic(self) -> bool:
        return self.train.min_workers is not None and self.train.min_workers < self.num_workers


def _section(annotation: Any) -> type[BaseModel] | None:
    """The config model inside a field's type (``EmulationConfig | None``, ``list[DeviceEvent]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _section(arg)) is not None), None)


def _keys_at(loc: tuple[str | int, ...]) -> list[str]:
    """The keys valid where ``loc`` ends (``("train", "stesp")``: TrainConfig's fields)."""
    model: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        if model is not None and isinstance(part, str):
            field = model.model_fields.get(part)
            model = _section(field.annotation) if field else None
    return list(model.model_fields) if model else []


def _one_line(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    # Checks across sections (model validators) have no location; their messages name the fields.
    where = ".".join(str(p) for p in err["loc"]) + ": " if err["loc"] else ""
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key" + did_you_mean(err["loc"][-1], _keys_at(err["loc"]))
    elif err["type"] == "literal_error":
        msg += did_you_mean(err["input"], re.findall(r"'([^']*)'", err["ctx"]["expected"]))
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{source}: {where}{msg}{more}"


def parse_config(data: Any, source: str = "config") -> RunConfig:
    """Validate a mapping into a ``RunConfig``; raise ``ConfigError`` with one line on failure."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (devices, train, …), got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, source)) from None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate a YAML config file; ``overrides`` are merged one level deep per section."""
    path = Path(path)
    try:
        data = load_yaml(path.read_text(), str(path))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except YamlError as exc:
        raise ConfigError(str(exc)) from None
    for section, values in (overrides or {}).items() if isinstance(data, dict) else ():
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            data[section] = {**data[section], **values}
        else:
            data[section] = values
    return parse_config(data, str(path))
