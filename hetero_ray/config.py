"""The one typed configuration of a training run, validated at the edge.

Every entry point (``jobs/train.py``, ``hetero-ray demo``, the benchmarks) loads a
YAML file into ``RunConfig``; everything downstream receives this object and never
re-parses the command line or the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """Bad input: the message is one line saying what, where and what would be valid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EmulationConfig(_Strict):
    """Emulated GPUs: real CPU computation padded to each type's modelled time."""

    dilation: float | Literal["auto"] = Field(
        "auto",
        description="Multiplies every modelled GPU time so it exceeds this CPU's real compute time; "
        "'auto' calibrates it from a timed step of the workload.",
    )
    efficiency: float = Field(0.4, gt=0, le=1, description="Fraction of the catalog's peak FLOP/s a step achieves.")
    gpus_per_node: int = Field(2, ge=1, description="Emulated GPUs per emulated Ray node.")

    @field_validator("dilation")
    @classmethod
    def _positive(cls, v: float | str) -> float | str:
        if v != "auto" and v <= 0:
            raise ValueError("must be > 0 or 'auto'")
        return v


class WorkloadConfig(_Strict):
    """Which model to train: a built-in name (``gpt``) or ``module:function``."""

    name: str = "gpt"
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the workload factory.")


class TrainConfig(_Strict):
    """The optimisation: batch, steps, optimiser, split, precision, checkpoints."""

    global_batch: int = Field(72, gt=0, description="Samples per optimiser step over all workers.")
    steps: int = Field(100, gt=0)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = 0
    precision: Literal["auto", "fp32"] = Field(
        "auto", description="'auto': bf16 on Ampere and newer, fp16 with loss scaling on Volta/Turing, fp32 otherwise."
    )
    split: Literal["proportional", "equal"] | dict[str, float] = Field(
        "proportional",
        description="How the global batch is shared: by modelled speed, equally, or by explicit weights per GPU type.",
    )
    max_micro_batch: int | None = Field(
        None, gt=0, description="Cap on samples per forward pass (else memory decides)."
    )
    checkpoint_every: int = Field(20, gt=0, description="Steps between checkpoints.")
    report_every: int = Field(10, gt=0, description="Steps between metric reports.")
    duration_s: float | None = Field(
        None, gt=0, description="Stop early after this much wall time (the demo's minute)."
    )

    @field_validator("split")
    @classmethod
    def _weights_positive(cls, v: Any) -> Any:
        if isinstance(v, dict) and (not v or any(w <= 0 for w in v.values())):
            raise ValueError("weights per GPU type must be > 0")
        return v


class RunStorage(_Strict):
    """Where Ray Train keeps checkpoints; the same name and path resume a run."""

    name: str = "hetero-ray"
    storage_path: str = "~/hetero-ray-runs"


class RunConfig(_Strict):
    """A whole run: which devices, which workload, how to train, where to store."""

    devices: dict[str, int] = Field(description="Workers per GPU type (catalog names), e.g. {A100-80GB: 2}.")
    emulation: EmulationConfig | None = Field(None, description="Present: the devices are emulated on CPU.")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    run: RunStorage = Field(default_factory=RunStorage)
    gpus_file: str | None = Field(None, description="YAML of extra GPU types (same schema as the catalog).")

    @field_validator("devices")
    @classmethod
    def _counts_positive(cls, v: dict[str, int]) -> dict[str, int]:
        if not v:
            raise ValueError("needs at least one GPU type, e.g. {A100-80GB: 2}")
        bad = {k: n for k, n in v.items() if n < 1}
        if bad:
            raise ValueError(f"worker counts must be >= 1 (got {bad})")
        return v

    @property
    def num_workers(self) -> int:
        return sum(self.devices.values())


def _one_line(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{source}: {where}: {msg}{more}"


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
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}:{where}: malformed YAML: {getattr(exc, 'problem', exc)}") from None
    for section, values in (overrides or {}).items() if isinstance(data, dict) else ():
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            data[section] = {**data[section], **values}
        else:
            data[section] = values
    return parse_config(data, str(path))
