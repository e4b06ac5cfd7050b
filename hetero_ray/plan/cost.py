"""Cost terms of a step, one small function each."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hetero_ray.cluster.catalog import GpuSpec

if TYPE_CHECKING:  # an annotation only: the module imports torch, which `hetero-ray --help` must not wait for
    from hetero_ray.perf.footprint import Footprint

HALF_PRECISIONS = ("bf16", "fp16")
# Bytes per gradient element on the wire, by ``train.reduce_dtype``.
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
# Activation checkpointing adds one forward to forward + backward (a forward is about 1/3 of both).
RECOMPUTE_FACTOR = 4 / 3


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


def ring_allreduce_bytes(payload_bytes: float, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce: reduce-scatter then all-gather, (W-1)/W of the payload each."""
    return 2 * (world - 1) / world * payload_bytes


def padded_numel(numel: int, world_size: int) -> int:
    """Size of the worker-error buffer DeepSpeed's 1-bit optimizers allocate for ``numel`` elements.

    Rounded up to a multiple of ``world_size * lcm(world_size, 8)`` so that every rank's
    server chunk is a whole number of bytes once packed (the optimizers' ``corrected_tensor_size``).
    The server-error buffer holds ``padded_numel(...) // world_size`` elements.
    """
    multiple = world_size * math.lcm(world_size, 8)
    return -(-numel // multiple) * multiple


def onebit_allreduce_bytes(numel: int, world: int) -> float:
    """Bytes each rank sends in a 1-bit compressed all-reduce (DeepSpeed's algorithm).

    Each of two phases (worker all-to-all, server all-gather) sends one packed chunk
    of ``padded / (8 W)`` bytes and one fp32 scale to each of the W-1 others: about
    1/32 of the fp32 ring.
    """
    return 2 * (world - 1) * (padded_numel(numel, world) / (8 * world) + 4)


def link_seconds(bytes_sent: float, messages: int, bandwidth_bytes_s: float, latency_s: float) -> float:
    """Time on one link: bytes over bandwidth plus a latency per message round."""
    return bytes_sent / bandwidth_bytes_s + messages * latency_s


def allreduce_seconds(
    numels: Sequence[int],
    world: int,
    bandwidth_bytes_s: float,
    latency_s: float,
    *,
    compressed: bool = False,
    element_bytes: float = 4.0,
) -> float:
    """Gradient synchronisation per step on the slowest link of the ring, for parameter tensors of ``numels``.

    Uncompressed: one bucketed ring all-reduce of all gradients, ``element_bytes`` each on the wire
    (``WIRE_BYTES``). 1-bit compressed: DeepSpeed
    compresses tensor by tensor, each an all-to-all plus a scale gather, then a sign
    and a scale gather: four collective rounds of W-1 messages per tensor.
    """
    if world == 1:
        return 0.0
    if compressed:
        sent = sum(onebit_allreduce_bytes(n, world) for n in numels)
        return link_seconds(sent, 4 * (world - 1) * len(numels), bandwidth_bytes_s, latency_s)
    payload = element_bytes * sum(numels)
    return link_seconds(ring_allreduce_bytes(payload, world), 2 * (world - 1), bandwidth_bytes_s, latency_s)


def stage_compute_seconds(flops: float, peak_flops: float, efficiency: float, *, checkpointing: bool) -> float:
    """Forward + backward of ``flops`` at ``efficiency`` of ``peak_flops``.

    Activation checkpointing re-runs the forward during the backward: one more
    forward, about 1/3 of forward + backward.
    """
    return flops / (peak_flops * efficiency) * (RECOMPUTE_FACTOR if checkpointing else 1.0)


def p2p_seconds(bytes_per_sample: float, micro_batch: int, bandwidth_bytes_s: float, latency_s: float) -> float:
    """One stage-to-stage message: a micro-batch's activations (forward) or their gradient (backward)."""
    return link_seconds(bytes_per_sample * micro_batch, 1, bandwidth_bytes_s, latency_s)


def hierarchical_allreduce_seconds(
    payload_bytes: float,
    *,
    local: int,
    nodes: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
) -> float:
    """All-reduce of ``payload_bytes`` over ``nodes`` nodes of ``local`` members each.

    Intra-node reduce-scatter (each member ends with 1/local of the sum), an
    inter-node ring all-reduce of that 1/local over the nodes (the ``local``
    members' rings run side by side, each on its own share of the NIC), then an
    intra-node all-gather. ``intra`` and ``inter`` are (bandwidth bytes/s per
    direction, latency s). One node: a plain ring on the intra-node link.
    """
    # Reduce-scatter and all-gather within the node: (local-1)/local of the payload each, local-1 rounds each.
    t = link_seconds(ring_allreduce_bytes(payload_bytes, local), 2 * (local - 1), *intra)
    # All ``local`` rails share the node's NIC, so together they move one whole ring of the payload.
    return t + link_seconds(ring_allreduce_bytes(payload_bytes, nodes), 2 * (nodes - 1), *inter)


# A tensor-parallel GPT block all-reduces its full-size output twice forward (attention, MLP) and twice
# backward (their inputs' gradients); activation checkpointing re-runs the forward: two more.
TP_ALLREDUCES = 4
TP_ALLREDUCES_CHECKPOINTED = 6


def tp_allreduce_seconds(
    bytes_per_sample: float,
    samples: float,
    degree: int,
    link: tuple[float, float],
    *,
    checkpointing: bool = False,
    batches: float = 1.0,
) -> float:
    """A tensor-parallel block's all-reduces over the forward and backward of ``samples`` samples in ``batches``
    micro-batches: each a ring over the ``degree`` members of the block's output (``bytes_per_sample`` a
    sample) on ``link``, its latencies paid once per micro-batch. A data-parallel worker is priced per sample,
    as one sample of a micro-batch holding its whole share: ``samples`` 1, ``batches`` 1 / share."""
    if degree == 1:
        return 0.0
    count = TP_ALLREDUCES_CHECKPOINTED if checkpointing else TP_ALLREDUCES
    bandwidth, latency = link
    sent = ring_allreduce_bytes(bytes_per_sample * samples, degree)
    return count * (sent / bandwidth + batches * 2 * (degree - 1) * latency)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe / 1F1B step with uniform stages: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_seconds(stage_seconds: Sequence[float], micro_batches: int) -> float:
    """Step time of a GPipe or 1F1B pipeline whose stage s takes ``stage_seconds[s]`` per micro-batch.

    The slowest stage paces the M micro-batches; the first and last of them also
    cross every other stage once: (M-1)·max + sum. Both schedules have this bubble;
    they differ in memory (see ``in_flight``).
    """
    return (micro_batches - 1) * max(stage_seconds) + sum(stage_seconds)
