"""Precision per device: bf16 on Ampere and newer, fp16 with loss scaling on Volta/Turing, fp32 otherwise."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext

import torch

from hetero_ray.cluster.catalog import GpuSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def choose_precision(spec: GpuSpec, requested: str | Mapping[str, str]) -> str:
    """The precision a device of type ``spec`` trains in (``train.precision``): ``'auto'`` the card's fastest
    (below), ``'fp32'`` fp32; a mapping names one per GPU type (``'auto'`` for a type it does not name)."""
    if isinstance(requested, Mapping):
        requested = requested.get(spec.name, "auto")
    if requested != "auto":
        return requested
    if spec.supports_bf16:
        return "bf16"
    # fp16 tensor cores arrived with Volta (compute capability 7.0).
    if "fp16" in spec.peak_tflops and spec.compute_capability >= (7, 0):
        return "fp16"
    return "fp32"


def compute_precision(precision: str, device: torch.device, cpu_autocast: bool) -> str:
    """The precision a device computes its role's ``precision`` in: on a GPU its own; on an emulated (CPU)
    device fp32 unless ``cpu_autocast`` (``emulation.autocast``), because CPU half precision is slower than
    fp32 (bf16 1.6x, fp16 10x on the project's machine), not faster as on a GPU, and would turn the emulated
    speeds upside down."""
    return precision if device.type != "cpu" or cpu_autocast else "fp32"


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """Autocast to a half ``precision`` on ``device``'s type (CPU autocast takes bf16 and fp16 as CUDA's
    does); fp32 and tf32 run as they are."""
    if precision in DTYPES:
        return torch.autocast(device.type, dtype=DTYPES[precision])
    return nullcontext()


def loss_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16, whose gradients underflow without one; bf16 has fp32's range."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
