"""Precision per device: bf16 on Ampere and newer, fp16 with loss scaling on Volta/Turing, fp32 otherwise."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from hetero_ray.cluster.catalog import GpuSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def choose_precision(spec: GpuSpec, requested: str) -> str:
    """The precision a device of type ``spec`` trains in; ``requested='fp32'`` forces fp32."""
    if requested == "fp32":
        return "fp32"
    if spec.supports_bf16:
        return "bf16"
    # fp16 tensor cores arrived with Volta (compute capability 7.0).
    if "fp16" in spec.peak_tflops and spec.compute_capability >= (7, 0):
        return "fp16"
    return "fp32"


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """Autocast for a half precision on CUDA; on CPU (emulated devices) everything stays fp32."""
    if device.type == "cuda" and precision in DTYPES:
        return torch.autocast("cuda", dtype=DTYPES[precision])
    return nullcontext()


def needs_loss_scaling(precision: str, device: torch.device) -> bool:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range."""
    return device.type == "cuda" and precision == "fp16"
