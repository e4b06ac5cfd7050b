"""Cost terms of a step, one small function each."""

from __future__ import annotations

from hetero_ray.cluster.catalog import GpuSpec
from hetero_ray.perf.footprint import Footprint

HALF_PRECISIONS = ("bf16", "fp16")


def compute_seconds(spec: GpuSpec, precision: str, flops: float, efficiency: float) -> float:
    """Time for ``flops`` of training work on ``spec`` at ``precision``, at ``efficiency`` of peak."""
    return flops / (spec.peak_flops(precision) * efficiency)


def activation_scale(precision: str) -> float:
    """Activations saved under autocast are half-width in bf16/fp16."""
    return 0.5 if precision in HALF_PRECISIONS else 1.0


def max_micro_batch(spec: GpuSpec, precision: str, footprint: Footprint) -> int:
    """Largest micro-batch whose weights, gradients, Adam state and activations fit in memory."""
    free = spec.memory_bytes - footprint.static_bytes
    per_sample = footprint.activation_bytes_per_sample * activation_scale(precision)
    return max(0, int(free // per_sample)) if per_sample > 0 else (1 << 30 if free >= 0 else 0)
