"""Peak memory of one device holding a range of layers: one small function per term.

Weights stay fp32 under autocast (the optimizer updates fp32 masters), so the
static part does not depend on precision; saved activations do.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetero_ray.config import ONEBIT_OPTIMIZERS
from hetero_ray.plan.cost import padded_numel
from hetero_ray.suggest import did_you_mean

WEIGHT_AND_GRAD_BYTES = 4 + 4
# Adam's two fp32 moments (exp_avg, exp_avg_sq); DeepSpeed's 1-bit optimizers keep the same two.
ADAM_STATE_BYTES = 8
SCHEDULES = ("1f1b", "gpipe")


def static_bytes(params: int, optimizer: str, world: int, state_shards: int = 1) -> float:
    """Weights, gradients and optimizer state of ``params`` parameters, all fp32.

    ``onebit_adam`` / ``zero_one_adam`` also keep DeepSpeed's compression error
    buffers: a worker error of ``padded_numel(params, world)`` fp32 elements and a
    server error of 1/world of that. ``state_shards``: ZeRO-1 within a pipeline kind, Adam's
    moments split evenly over that many replicas of the stage (weights and gradients stay whole).
    """
    total = params * (WEIGHT_AND_GRAD_BYTES + ADAM_STATE_BYTES / state_shards)
    if optimizer in ONEBIT_OPTIMIZERS:
        padded = padded_numel(params, max(world, 1))
        total += 4 * padded + 4 * (padded // max(world, 1))
    return float(total)


def in_flight(schedule: str, micro_batches: int, stages: int, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak.

    GPipe runs every forward before any backward: all M. 1F1B starts backwards as
    soon as the last stage can: stage s holds at most S - s.
    """
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    raise ValueError(
        f"schedule: unknown schedule {schedule!r}{did_you_mean(schedule, SCHEDULES)}; use one of {', '.join(SCHEDULES)}"
    )


def activation_bytes(
    layer_activation_bytes: Sequence[float],
    layer_input_bytes: Sequence[float],
    *,
    micro_batch: int,
    in_flight: int,
    scale: float,
    checkpointing: bool,
) -> float:
    """Saved activations of a stage's layers (per-sample fp32 bytes per layer) at its peak.

    Without checkpointing every layer keeps what its backward needs, for each
    micro-batch in flight. With checkpointing (around each layer) only each
    layer's input is kept per micro-batch in flight, plus one layer's full
    activations while that layer is recomputed in the backward.
    """
    if not layer_activation_bytes:
        return 0.0
    if checkpointing:
        kept = in_flight * micro_batch * sum(layer_input_bytes)
        return scale * (kept + micro_batch * max(layer_activation_bytes))
    return scale * in_flight * micro_batch * sum(layer_activation_bytes)


def stage_memory_bytes(
    params: int,
    layer_activation_bytes: Sequence[float],
    layer_input_bytes: Sequence[float],
    *,
    optimizer: str,
    world: int,
    micro_batch: int,
    in_flight: int,
    scale: float,
    checkpointing: bool,
    state_shards: int = 1,
) -> float:
    """Peak bytes on a device: static state (``static_bytes``) plus saved activations."""
    return static_bytes(params, optimizer, world, state_shards) + activation_bytes(
        layer_activation_bytes,
        layer_input_bytes,
        micro_batch=micro_batch,
        in_flight=in_flight,
        scale=scale,
        checkpointing=checkpointing,
    )
