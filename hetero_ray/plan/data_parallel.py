"""Weighted data parallelism: split the global batch by speed, micro-batch by memory.

Complexity: O(B log W) for a global batch of B samples over W workers (one heap
operation per sample), which is instant at any batch a run would use.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from hetero_ray.cluster.catalog import Catalog, GpuSpec
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.cost import WIRE_BYTES, activation_scale, allreduce_seconds, compute_seconds, max_micro_batch
from hetero_ray.plan.memory import ADAM_STATE_BYTES, WEIGHT_AND_GRAD_BYTES
from hetero_ray.plan.plan import Exclusion, Infeasible, Plan, WorkerRole
from hetero_ray.train.precision import choose_precision

GiB = 2**30
# (bandwidth in bytes/s, latency in s) of the slowest link of the all-reduce.
Link = tuple[float, float]


def split_batch(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """Integer shares of ``global_batch`` minimising the slowest worker's time ``share / speed``.

    Every worker gets at least one sample; each further sample goes to the worker
    that would finish it first (water-filling), which is optimal for this objective.
    """
    if global_batch < len(speeds):
        raise ValueError(
            f"train.global_batch: {global_batch} is smaller than the {len(speeds)} workers sharing it; "
            f"use at least {len(speeds)}"
        )
    shares = [1] * len(speeds)
    heap = [((1 + 1) / s, i) for i, s in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(global_batch - len(speeds)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) / speeds[i], i))
    return shares


def _weights(split: str | Mapping[str, float], specs: Sequence[GpuSpec], speeds: Sequence[float]) -> list[float]:
    if split == "proportional":
        return list(speeds)
    if split == "equal":
        return [1.0] * len(specs)
    missing = sorted({s.name for s in specs} - set(split))
    if missing:
        raise ValueError(f"train.split: no weight for GPU type(s) {missing}; give one per type in devices")
    return [float(split[s.name]) for s in specs]


def plan_data_parallel(
    rank_types: Sequence[str],
    catalog: Catalog,
    footprint: Footprint,
    *,
    global_batch: int,
    split: str | Mapping[str, float] = "proportional",
    precision: str = "auto",
    efficiency: float = 0.4,
    max_micro: int | None = None,
    emulated: bool = False,
    link: Link | None = None,
    compressed: bool = False,
    reduce_dtype: str = "fp32",
    zero_stage: int = 0,
) -> Plan | Infeasible:
    """Plan weighted data parallelism over workers of the given GPU types.

    Speed of a type is its catalog peak at its chosen precision times
    ``efficiency``; a type whose memory cannot hold one sample is excluded with
    the reason, and if every type is excluded the result is ``Infeasible``.
    With a ``link`` (bandwidth bytes/s, latency s), the gradient all-reduce is
    priced on it: a ring of ``reduce_dtype`` gradients, and 1-bit compressed when ``compressed``.
    ``zero_stage`` 1 shards Adam's state (``sharded_state``), and its parameter all-gather is priced too.
    """
    specs = [catalog.get(t) for t in rank_types]
    precisions = [choose_precision(s, precision) for s in specs]
    fits, state = memory_fits(specs, precisions, footprint, zero_stage)
    usable = [i for i, f in enumerate(fits) if f >= 1]
    excluded = _exclusions(specs, precisions, fits, footprint, sharded=bool(zero_stage))
    if not usable:
        worst = max(range(len(specs)), key=lambda i: specs[i].memory_bytes)
        need = footprint.memory_bytes(1, activation_scale(precisions[worst]))
        if zero_stage:
            return Infeasible(
                f"model needs {held_bytes(footprint) / GiB:.1f} GiB of weights and gradients per device and "
                f"{footprint.param_count * ADAM_STATE_BYTES / GiB:.1f} GiB of Adam state across them (ZeRO-1), "
                "more than these devices hold at micro-batch 1; use a smaller model or more memory"
            )
        return Infeasible(
            f"model needs {need / GiB:.1f} GiB per device at micro-batch 1; largest device "
            f"({specs[worst].name}) has {specs[worst].memory_gib:g} GiB; use a smaller model or more memory"
        )
    per_sample = [compute_seconds(specs[i], precisions[i], footprint.flops_per_sample, efficiency) for i in usable]
    try:
        weights = _weights(split, [specs[i] for i in usable], [1 / t for t in per_sample])
        shares = split_batch(global_batch, weights)
    except ValueError as exc:
        return Infeasible(str(exc))
    caps = [min(fits[i], max_micro or fits[i]) for i in usable]
    roles = data_parallel_roles(
        [(specs[i].name, precisions[i], specs[i].memory_bytes) for i in usable],
        shares,
        per_sample,
        caps,
        footprint,
        static_bytes=[held_bytes(footprint) + state[i] for i in usable],
    )
    world = len(rank_types)
    numels = footprint.param_numels or (footprint.param_count,)
    comm_fp32 = allreduce_seconds(numels, world, *link, element_bytes=WIRE_BYTES[reduce_dtype]) if link else 0.0
    if link and zero_stage:
        # Owners send their updated parameters to all: a ring all-gather, the second half of a ring all-reduce.
        comm_fp32 += allreduce_seconds(numels, world, *link) / 2
    plan = Plan(
        global_batch=global_batch,
        split=split if isinstance(split, str) else "weights",
        emulated=emulated,
        roles=tuple(roles),
        predicted_compute_s=max(r.predicted_compute_s for r in roles),
        excluded=excluded,
        predicted_comm_fp32_s=comm_fp32,
        predicted_comm_s=(
            allreduce_seconds(numels, world, *link, compressed=True) if link and compressed else comm_fp32
        ),
        zero_stage=zero_stage,
    )
    return Plan(**{**plan.__dict__, "explanation": explain(plan)})


def memory_fits(
    specs: Sequence[GpuSpec], precisions: Sequence[str], footprint: Footprint, zero_stage: int = 0
) -> tuple[list[int], list[float]]:
    """The largest micro-batch each device fits (0: none) and the bytes of Adam's state it holds: all of it, or
    under ZeRO-1 its share (``sharded_state``)."""
    if zero_stage:
        return sharded_state(specs, precisions, footprint)
    fits = [max_micro_batch(s, p, footprint) for s, p in zip(specs, precisions)]
    return fits, [footprint.param_count * ADAM_STATE_BYTES] * len(specs)


def held_bytes(footprint: Footprint) -> float:
    """Weights and gradients: what every data-parallel worker holds whole under ZeRO-1 (the engine's shards,
    ``train/zero.py::spare_memory``, are sized by what is left beyond them)."""
    return footprint.param_count * WEIGHT_AND_GRAD_BYTES


def sharded_state(
    specs: Sequence[GpuSpec], precisions: Sequence[str], footprint: Footprint
) -> tuple[list[int], list[float]]:
    """ZeRO-1 by memory: the largest micro-batch each device fits (0: none) and the bytes of Adam's state it holds.

    Every device keeps weights and gradients whole; Adam's state is split in proportion to the memory
    each has beyond them (``train/zero.py`` shards by the same rule), so every device gives the same
    fraction of that spare memory to state and the rest to activations. A device without room for one
    sample after its share drops out, which raises the others' shares: repeated until all that remain fit.
    """
    held, state = held_bytes(footprint), footprint.param_count * ADAM_STATE_BYTES
    spare = [s.memory_bytes - held for s in specs]
    per_sample = [footprint.activation_bytes_per_sample * activation_scale(p) for p in precisions]
    members = {i for i, x in enumerate(spare) if x > 0}
    while members:
        fraction = state / sum(spare[i] for i in members)
        fits = {i: _samples(spare[i] * (1 - fraction), per_sample[i]) if fraction < 1 else 0 for i in members}
        dropped = {i for i, f in fits.items() if f < 1}
        if not dropped:
            return (
                [fits.get(i, 0) for i in range(len(specs))],
                [fraction * spare[i] if i in members else 0.0 for i in range(len(specs))],
            )
        members -= dropped
    return [0] * len(specs), [0.0] * len(specs)


def _samples(free: float, per_sample: float) -> int:
    """Samples whose activations fit in ``free`` bytes."""
    return max(0, int(free // per_sample)) if per_sample > 0 else (1 << 30 if free >= 0 else 0)


def data_parallel_roles(
    devices: Sequence[tuple[str, str, int]],
    shares: Sequence[int],
    seconds_per_sample: Sequence[float],
    micro_caps: Sequence[int],
    footprint: Footprint,
    static_bytes: Sequence[float] | None = None,
) -> list[WorkerRole]:
    """Roles for devices given as (GPU type, precision, memory bytes) with their shares, in order;
    ``static_bytes``: what each holds besides activations (default: weights, gradients and all of Adam's state).

    Each device runs its share in the fewest micro-batches of at most its cap, sized evenly.
    """
    roles, offset = [], 0
    # What a device holds besides activations: all of Adam's state unless ``static_bytes`` says its share.
    unsharded = footprint.memory_bytes(0)
    statics = static_bytes or [unsharded] * len(devices)
    for (gpu_type, precision, memory), share, t, cap, static in zip(
        devices, shares, seconds_per_sample, micro_caps, statics
    ):
        micro = math.ceil(share / math.ceil(share / min(cap, share)))
        roles.append(
            WorkerRole(
                gpu_type=gpu_type,
                local_batch=share,
                micro_batch=micro,
                sample_offset=offset,
                precision=precision,
                predicted_compute_s=share * t,
                predicted_memory_bytes=static - unsharded + footprint.memory_bytes(micro, activation_scale(precision)),
                memory_cap_bytes=memory,
            )
        )
        offset += share
    return roles


def _exclusions(specs, precisions, fits, footprint: Footprint, *, sharded: bool) -> tuple[Exclusion, ...]:
    out: dict[str, Exclusion] = {}
    for spec, prec, fit in zip(specs, precisions, fits):
        if fit < 1:
            if sharded:
                need = (held_bytes(footprint) + footprint.activation_bytes_per_sample * activation_scale(prec)) / GiB
                reason = (
                    f"ZeRO-1: weights, gradients and one sample ({need:.1f} GiB) leave too little of its "
                    f"{spec.memory_gib:g} GiB for a share of Adam's state"
                )
            else:
                need = footprint.memory_bytes(1, activation_scale(prec)) / GiB
                reason = f"needs {need:.1f} GiB at micro-batch 1, has {spec.memory_gib:g} GiB"
            prev = out.get(spec.name)
            out[spec.name] = Exclusion(gpu_type=spec.name, count=(prev.count if prev else 0) + 1, reason=reason)
    return tuple(out.values())


def explain_communication(plan: Plan, worth: float = 0.05) -> str:
    """Whether 1-bit compression pays: it does when it saves more than ``worth`` of the fp32 step."""
    compute, fp32 = plan.predicted_compute_s, plan.predicted_comm_fp32_s
    # The plan prices a compressed phase only for 1-bit optimizers; otherwise both figures are the fp32 one.
    onebit = plan.predicted_comm_s if plan.predicted_comm_s != fp32 else None
    text = f"gradient all-reduce {fp32 * 1e3:.3g} ms per step in fp32 against {compute * 1e3:.3g} ms of compute"
    if onebit is None:
        return text
    saving = (fp32 - onebit) / (compute + fp32)
    verdict = "pays" if saving > worth else "does not pay"
    return f"{text}; 1-bit compressed {onebit * 1e3:.3g} ms: compression {verdict} ({saving:.0%} of the step)"


def explain(plan: Plan) -> str:
    """Plain-language summary: what each type does and why."""
    by_type: dict[str, list[WorkerRole]] = {}
    for role in plan.roles:
        by_type.setdefault(role.gpu_type, []).append(role)
    slowest = plan.predicted_compute_s
    lines = [f"{plan.split} split of {plan.global_batch} samples over {len(plan.roles)} workers"]
    for gpu_type, roles in by_type.items():
        r = roles[0]
        lines.append(
            f"{len(roles)} × {gpu_type} ({r.precision}): {'/'.join(str(x.local_batch) for x in roles)} samples each, "
            f"micro-batch {r.micro_batch}, busy {r.predicted_compute_s / slowest:.0%} of the step, "
            f"{r.predicted_memory_bytes / GiB:.2f} of {r.memory_cap_bytes / GiB:g} GiB"
        )
    lines += [f"{e.count} × {e.gpu_type} excluded: {e.reason}" for e in plan.excluded]
    if plan.zero_stage:
        lines.append(
            "ZeRO-1: Adam's state is sharded in proportion to each device's memory beyond weights and gradients, "
            "so devices too small for the whole state train too"
        )
    if plan.predicted_comm_fp32_s:
        lines.append(explain_communication(plan))
    if plan.emulated:
        lines.append("devices are emulated: times are modelled GPU times, computed on CPU")
    return "; ".join(lines)
