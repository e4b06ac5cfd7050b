"""Weighted data parallelism: split the global batch by speed, micro-batch by memory.

Complexity: O(B log W) for a global batch of B samples over W workers (one heap
operation per sample), which is instant at any batch a run would use.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from hetero_ray.cluster.catalog import Catalog, GpuSpec
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.cost import WIRE_BYTES, activation_scale, allreduce_seconds, compute_seconds, max_micro_batch
from hetero_ray.plan.memory import ADAM_STATE_BYTES, WEIGHT_AND_GRAD_BYTES
from hetero_ray.plan.plan import Exclusion, Infeasible, Plan, WorkerRole
from hetero_ray.plan.stages import SecondsPerSample, measured_seconds
from hetero_ray.train.precision import choose_precision

GiB = 2**30
# (bandwidth in bytes/s, latency in s) of the slowest link of the all-reduce.
Link = tuple[float, float]


def split_batch(global_batch: int, speeds: Sequence[float], caps: Sequence[int] | None = None) -> list[int]:
    """Integer shares of ``global_batch`` minimising the slowest worker's time ``share / speed``, each at most
    its entry of ``caps`` if given.

    Every worker gets at least one sample; each further sample goes to the worker
    that would finish it first (water-filling), which is optimal for this objective.
    """
    if global_batch < len(speeds):
        raise ValueError(
            f"train.global_batch: {global_batch} is smaller than the {len(speeds)} workers sharing it; "
            f"use at least {len(speeds)}"
        )
    caps = caps or [global_batch] * len(speeds)
    if sum(caps) < global_batch:
        raise ValueError(f"train.global_batch: {global_batch} is more than the workers' caps {list(caps)} hold")
    shares = [1] * len(speeds)
    heap = [((1 + 1) / s, i) for i, s in enumerate(speeds) if caps[i] > 1]
    heapq.heapify(heap)
    for _ in range(global_batch - len(speeds)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < caps[i]:
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
    seconds_per_sample: SecondsPerSample | None = None,
) -> Plan | Infeasible:
    """Plan weighted data parallelism over workers of the given GPU types.

    Speed of a type is its catalog peak at its chosen precision times
    ``efficiency``; a type whose memory cannot hold one sample is excluded with
    the reason, and if every type is excluded the result is ``Infeasible``.
    With a ``link`` (bandwidth bytes/s, latency s), the gradient all-reduce is
    priced on it: a ring of ``reduce_dtype`` gradients, and 1-bit compressed when ``compressed``.
    ``zero_stage`` 1-3 shards state by memory (``sharded_state``), its collectives priced per pass
    (``zero_comm_seconds``). ``seconds_per_sample`` (a profile's) overrides a type's FLOPs-based speed where it
    answers.
    """
    specs = [catalog.get(t) for t in rank_types]
    precisions = [choose_precision(s, precision) for s in specs]
    fits, state = memory_fits(specs, precisions, footprint, zero_stage)
    held, sharded = zero_bytes(footprint, zero_stage)
    usable = [i for i, f in enumerate(fits) if f >= 1]
    excluded = _exclusions(specs, precisions, fits, footprint, zero_stage)
    if not usable:
        worst = max(range(len(specs)), key=lambda i: specs[i].memory_bytes)
        need = footprint.memory_bytes(1, activation_scale(precisions[worst]))
        if zero_stage:
            return Infeasible(
                f"model needs {held / GiB:.3g} GiB per device and {sharded / GiB:.3g} GiB across them in shards "
                f"(ZeRO-{zero_stage}), more than these devices hold at micro-batch 1; use a smaller model or more "
                "memory"
            )
        return Infeasible(
            f"model needs {need / GiB:.3g} GiB per device at micro-batch 1; largest device "
            f"({specs[worst].name}) has {specs[worst].memory_gib:g} GiB; use a smaller model or more memory"
        )
    per_sample = [
        measured_seconds(seconds_per_sample, specs[i].name, precisions[i])
        or compute_seconds(specs[i], precisions[i], footprint.flops_per_sample, efficiency)
        for i in usable
    ]
    caps = [min(fits[i], max_micro or fits[i]) for i in usable]
    world = len(rank_types)
    numels = footprint.param_numels or (footprint.param_count,)

    def comm(passes: int) -> float:
        return zero_comm_seconds(numels, world, link, zero_stage, passes, reduce_dtype) if link else 0.0

    try:
        weights = _weights(split, [specs[i] for i in usable], [1 / t for t in per_sample])
        shares = split_batch(global_batch, weights)
        if link and zero_stage >= 2 and split == "proportional":
            shares = _fewer_passes(global_batch, weights, per_sample, caps, shares, comm)
    except ValueError as exc:
        return Infeasible(str(exc))
    roles = data_parallel_roles(
        [(specs[i].name, precisions[i], specs[i].memory_bytes) for i in usable],
        shares,
        per_sample,
        caps,
        footprint,
        static_bytes=[held + state[i] for i in usable],
    )
    comm_fp32 = comm(max(r.accumulation_steps for r in roles))
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


def fastest_zero_stage(candidates: Mapping[int, Plan | Infeasible]) -> Plan | Infeasible:
    """Of one plan per ZeRO stage, the one whose step is predicted fastest (a tie goes to the lower stage,
    which shards less); its explanation weighs it against the others."""
    fits = {stage: p for stage, p in candidates.items() if isinstance(p, Plan)}
    if not fits:
        return Infeasible("; ".join(f"ZeRO-{stage}: {p.reason}" for stage, p in sorted(candidates.items())))
    stage = min(fits, key=lambda k: (fits[k].predicted_step_s, k))
    chosen = fits[stage]
    others = [
        f"{p.predicted_step_s * 1e3:.4g} ms at ZeRO-{k}" if isinstance(p, Plan) else f"none fits at ZeRO-{k}"
        for k, p in sorted(candidates.items())
        if k != stage
    ]
    why = f"ZeRO stage {stage} ({chosen.predicted_step_s * 1e3:.4g} ms) against {', '.join(others)}"
    return replace(chosen, explanation=f"{chosen.explanation}; {why}")


def zero_stage_plans(
    zero_stage: int,
    placed: Callable[[int], Plan | list[Plan] | Infeasible],
    sharded: Callable[[int], Plan | Infeasible],
) -> list[Plan] | Infeasible:
    """The plans at ``zero_stage``, fastest first, or why none fits (every kind's reason).

    ``placed(stage)``: the placement search's at stages 0 and 1 (at 1 it shards each pipeline stage's Adam state
    over its replicas; stages 2 and 3 reduce and gather on every pass, which would tie the pipelines' schedules
    together); ``sharded(stage)``: data parallelism sharded by memory, at stages 1 to 3.
    """
    found = [placed(zero_stage)] if zero_stage <= 1 else []
    if zero_stage >= 1:
        found.append(sharded(zero_stage))
    plans = [p for f in found for p in ([f] if isinstance(f, Plan) else f if isinstance(f, list) else [])]
    if plans:
        return sorted(plans, key=lambda p: p.predicted_step_s)
    return Infeasible("; ".join(f.reason for f in found if isinstance(f, Infeasible)))


def zero_comm_seconds(
    numels: Sequence[int], world: int, link: Link, zero_stage: int, passes: int, reduce_dtype: str = "fp32"
) -> float:
    """A step's synchronisation under ZeRO ``zero_stage`` when every rank runs ``passes`` backward passes.

    A gradient reduce to the owners is the first half of a ring all-reduce (a reduce-scatter), a parameter
    gather the second half (an all-gather, fp32). Stage 0 all-reduces the gradients; stage 1 too, then the
    owners share their updates; stage 2 reduces each pass's gradients as they fill, then shares the updates;
    stage 3 gathers each layer's weights for every pass's forward and again for its backward and reduces
    each pass's gradients, and the next forward's gathers bring the updates.
    """
    reduce = allreduce_seconds(numels, world, *link, element_bytes=WIRE_BYTES[reduce_dtype])
    gather = allreduce_seconds(numels, world, *link) / 2
    return (reduce, reduce + gather, passes * reduce / 2 + gather, passes * (reduce / 2 + 2 * gather))[zero_stage]


def _fewer_passes(global_batch, weights, per_sample, caps, shares, comm) -> list[int]:
    """Under ZeRO-2 and -3 every pass of the step costs collectives, and the rank with the most micro-batches
    sets the passes: the shares, capped at ``passes × cap`` each, whose compute plus ``comm(passes)`` is least
    (from the uncapped split's passes down to the fewest that hold the batch)."""

    def step(s: Sequence[int]) -> float:
        return max(b * t for b, t in zip(s, per_sample)) + comm(max(-(-b // c) for b, c in zip(s, caps)))

    most = max(-(-b // c) for b, c in zip(shares, caps))
    fewest = -(-global_batch // sum(caps))
    tried = [split_batch(global_batch, weights, [p * c for c in caps]) for p in range(fewest, most)]
    return min([shares, *tried], key=step)


def memory_fits(
    specs: Sequence[GpuSpec], precisions: Sequence[str], footprint: Footprint, zero_stage: int = 0
) -> tuple[list[int], list[float]]:
    """The largest micro-batch each device fits (0: none) and the bytes of its ZeRO shard (``sharded_state``);
    without ZeRO, no shard: every device holds the whole state."""
    if zero_stage:
        return sharded_state(specs, precisions, footprint, zero_stage)
    return [max_micro_batch(s, p, footprint) for s, p in zip(specs, precisions)], [0.0] * len(specs)


def zero_bytes(footprint: Footprint, zero_stage: int) -> tuple[float, float]:
    """Under ZeRO ``zero_stage``: (bytes every data-parallel rank holds whole, bytes the ranks' shards split) of
    fp32 weights, fp32 gradients and Adam's two moments. The engine (``train/zero.py``) keeps to both.

    Stage 1 shards Adam's state; stage 2 also the gradients, of which a rank holds two layers' worth unreduced
    at once (one filling, one on the wire); stage 3 also the weights, of which a rank holds two layers gathered
    at once, with their gradients. A workload that cannot be cut into layers is one layer.
    """
    params = footprint.param_count
    layer = max((c.params for c in footprint.layers), default=params)
    whole = params * (WEIGHT_AND_GRAD_BYTES + ADAM_STATE_BYTES)
    sharded = (0, params * ADAM_STATE_BYTES, params * (4 + ADAM_STATE_BYTES), whole)[zero_stage]
    held = (whole - sharded, whole - sharded, whole - sharded + 2 * layer * 4, 2 * layer * WEIGHT_AND_GRAD_BYTES)
    return float(held[zero_stage]), float(sharded)


def sharded_state(
    specs: Sequence[GpuSpec], precisions: Sequence[str], footprint: Footprint, zero_stage: int = 1
) -> tuple[list[int], list[float]]:
    """ZeRO by memory: the largest micro-batch each device fits (0: none) and the bytes of its shard.

    Every device holds ``zero_bytes``' whole part; the sharded part is split in proportion to the memory each
    has beyond it (``train/zero.py`` shards by the same rule), so every device gives the same fraction of
    that spare memory to its shard and the rest to activations. A device without room for one sample after
    its shard drops out, which raises the others' shares: repeated until all that remain fit.
    """
    held, state = zero_bytes(footprint, zero_stage)
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


def _exclusions(specs, precisions, fits, footprint: Footprint, zero_stage: int) -> tuple[Exclusion, ...]:
    out: dict[str, Exclusion] = {}
    held = zero_bytes(footprint, zero_stage)[0]
    for spec, prec, fit in zip(specs, precisions, fits):
        if fit < 1:
            if zero_stage:
                need = (held + footprint.activation_bytes_per_sample * activation_scale(prec)) / GiB
                reason = (
                    f"ZeRO-{zero_stage}: what every device holds whole and one sample ({need:.3g} GiB) leave too "
                    f"little of its {spec.memory_gib:g} GiB for a shard"
                )
            else:
                need = footprint.memory_bytes(1, activation_scale(prec)) / GiB
                reason = f"needs {need:.3g} GiB at micro-batch 1, has {spec.memory_gib:g} GiB"
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
        what = ("Adam's state", "gradients and Adam's state", "weights, gradients and Adam's state")
        lines.append(
            f"ZeRO-{plan.zero_stage}: {what[plan.zero_stage - 1]} sharded in proportion to each device's memory "
            "beyond what it holds whole, so devices too small for the whole state train too"
        )
    if plan.predicted_comm_fp32_s:
        lines.append(explain_communication(plan))
    if plan.emulated:
        lines.append("devices are emulated: times are modelled GPU times, computed on CPU")
    return "; ".join(lines)
