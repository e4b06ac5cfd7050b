"""Turn a chosen shape and batch allocation into a Plan with roles and a plain-language explanation."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import replace

from hetero_ray.plan.memory import in_flight, stage_memory_bytes
from hetero_ray.plan.plan import Exclusion, Plan, WorkerRole
from hetero_ray.plan.search import Allocation, Group, Shape, Space
from hetero_ray.plan.stages import TypeTable
from hetero_ray.plan.topology import group_members, is_group

GiB = 2**30


def _roles(space: Space, g: Group, s: int, pipeline: int, units: int, offset: int, pipelines: int) -> list[WorkerRole]:
    """The roles of one stage: one worker, or the members of its type's tensor-parallel group (an even split), or
    of a group across types (each its own type, memory and part, split by speed)."""
    t = g.split.stage_types[s]
    table = space.tables[t]
    if table.members:
        return [
            replace(_role(space, g, s, pipeline, units, offset, pipelines, m), tp_weights=table.weights, tp_rank=k)
            for k, m in enumerate(table.members)
        ]
    role = _role(space, g, s, pipeline, units, offset, pipelines, table)
    d = space.tp_degrees[t]
    if d == 1:
        return [role]
    return [replace(role, tp_weights=(1.0,) * d, tp_rank=k) for k in range(d)]


def _role(
    space: Space, g: Group, s: int, pipeline: int, units: int, offset: int, pipelines: int, table: TypeTable
) -> WorkerRole:
    """One worker of stage ``s`` on ``table``'s device (a member's, in a group across types)."""
    split, t = g.split, g.split.stage_types[s]
    i, j = split.bounds[s], split.bounds[s + 1]
    if split.stages == 1:
        local_batch = units
        micro = math.ceil(local_batch / math.ceil(local_batch / min(g.dp_micro_cap, local_batch)))
        if space.tp_degrees[t] > 1:
            # A tensor-parallel replica runs as a one-stage pipeline, whose micro-batches are all one size.
            micro = max(m for m in range(1, micro + 1) if local_batch % m == 0)
        flight, layers, busy = 1, None, units * split.compute_seconds[0]
    else:
        local_batch, micro = units * split.micro, split.micro
        flight = in_flight(space.schedule, units, split.stages, s)
        layers, busy = (i, j), units * split.compute_seconds[s]
    memory = stage_memory_bytes(
        int(table.params[j] - table.params[i]),
        list(table.act[i + 1 : j + 1] - table.act[i:j]),
        list(table.inputs[i + 1 : j + 1] - table.inputs[i:j]),
        optimizer=space.optimizer,
        world=pipelines,
        state_shards=space.state_shards(g.replicas),
        micro_batch=micro,
        in_flight=flight,
        scale=table.scale,
        checkpointing=split.checkpointing[s],
    )
    return WorkerRole(
        gpu_type=table.gpu_type,
        local_batch=local_batch,
        micro_batch=micro,
        sample_offset=offset,
        precision=table.precision,
        predicted_compute_s=busy,
        predicted_memory_bytes=memory,
        memory_cap_bytes=int(table.cap_bytes),
        pipeline=pipeline,
        stage=s,
        layers=layers,
        activation_checkpointing=split.checkpointing[s],
    )


def _across(space: Space, gpu_type: str) -> bool:
    """Whether the space's type ``gpu_type`` is a tensor-parallel group of more than one GPU type."""
    return len({m.gpu_type for m in space.tables[gpu_type].members}) > 1


def _devices(space: Space, n: int, gpu_type: str) -> str:
    """``n`` workers of a type: devices, or tensor-parallel groups of them, or groups across types."""
    d = space.tp_degrees[gpu_type]
    table = space.tables[gpu_type]
    if _across(space, gpu_type):
        split = " : ".join(f"{w:.2f}" for w in table.weights)
        return f"{n} × ({' + '.join(m.gpu_type for m in table.members)} tensor parallel, split {split} by speed)"
    if d == 1:
        return f"{n} × {gpu_type}"
    return f"{n} × ({d} × {table.members[0].gpu_type if table.members else gpu_type} tensor parallel)"


def exclusion(
    gpu_type: str, count: int, shape: Shape, fits_alone: set[str], tp_degree: int, *, one_kind: bool = False
) -> Exclusion:
    """Why ``count`` devices of ``gpu_type`` (tensor-parallel degree ``tp_degree`` in this plan) get no work.

    ``one_kind``: the plan's types split layers at unequal degrees, so it holds one pipeline kind alone."""
    used = {t for g in shape.groups for t in g.split.stage_types}
    if gpu_type in used:
        reason = "left over: too few to form another pipeline of the chosen shapes"
    elif one_kind:
        reason = (
            "the plan's stages split layers at unequal tensor-parallel degrees per type, so its pipelines are all "
            "one kind (every pipeline holding a layer must split it alike), and this type is not in it"
        )
    elif tp_degree > 1 and gpu_type not in fits_alone:
        reason = f"no tensor-parallel group of {tp_degree} on one node, or none that fits its memory"
    elif gpu_type not in fits_alone:
        reason = "no pipeline of this type alone fits its memory, and the plan is faster without it in a mixed one"
    else:
        reason = "the plan is faster without them (their share of the all-reduce or bubble costs more than they add)"
    return Exclusion(gpu_type=gpu_type, count=count, reason=reason)


def build_plan(space: Space, shape: Shape, alloc: Allocation, *, emulated: bool, fits_alone: set[str]) -> Plan:
    """Roles for every pipeline (pipelines numbered group by group), offsets contiguous, and the explanation.

    ``fits_alone``: the types some single-type pipeline fits (the others can only join a mixed one).
    """
    pipelines = sum(g.replicas for g in shape.groups)
    roles, offset, p = [], 0, 0
    for g, units in zip(shape.groups, alloc.units):
        for u in units:
            stage_roles = [r for s in range(g.split.stages) for r in _roles(space, g, s, p, u, offset, pipelines)]
            roles += stage_roles
            offset += stage_roles[0].local_batch
            p += 1
    used = Counter()  # devices by the space's types (a group planned as a type counts as its own)
    for g in shape.groups:
        for t in g.split.stage_types:
            used[t] += g.replicas * space.tp_degrees[t]
    # Devices left out, by GPU type: a group's unused devices are its members' types', with the first reason.
    left_out: dict[str, Exclusion] = {}
    for t, n in sorted(space.devices.items(), key=lambda tn: (tn[0] not in used, tn[0])):
        if n > used[t]:
            why = exclusion(t, n - used[t], shape, fits_alone, space.tp_degrees.get(t, 1), one_kind=not space.uniform)
            members = group_members(t) if is_group(t) else (t,)
            for member in members:
                count = (n - used[t]) // len(members)
                prior = left_out.get(member)
                left_out[member] = replace(prior or why, gpu_type=member, count=count + (prior.count if prior else 0))
    excluded = tuple(left_out.values())
    plan = Plan(
        global_batch=space.global_batch,
        # The batch is split by modelled speed, as the data-parallel planner's proportional split.
        split="proportional",
        emulated=emulated,
        roles=tuple(roles),
        predicted_compute_s=alloc.seconds,
        excluded=excluded,
        predicted_comm_s=shape.comm_s,
        predicted_comm_fp32_s=shape.comm_fp32_s,
        schedule=space.schedule,
        zero_stage=space.zero_stage,
    )
    return Plan(**{**plan.__dict__, "explanation": explain(space, shape, alloc, plan)})


def _why_layers(space: Space, g: Group, s: int) -> str:
    split = g.split
    if split.stage_seconds[s] >= split.pace * 0.98:
        return f"that paces the pipeline at {split.pace * 1e3:.3g} ms per micro-batch"
    return (
        f"the split balances it against the slowest stage: {split.stage_seconds[s] * 1e3:.3g} of "
        f"{split.pace * 1e3:.3g} ms per micro-batch"
    )


def _stage_runs(space: Space, g: Group, roles) -> list[str]:
    """Consecutive stages of one type that pace the pipeline alike, described together."""
    split = g.split

    def key(s: int):
        pacing = split.stage_seconds[s] >= split.pace * 0.98
        return (split.stage_types[s], roles[s].activation_checkpointing, pacing or s)

    parts = []
    for _, run in itertools.groupby(range(split.stages), key=key):
        run = list(run)
        first, last = roles[run[0]], roles[run[-1]]
        counts = "/".join(str(roles[s].layers[1] - roles[s].layers[0]) for s in run)
        where = f"stage {run[0]}" if len(run) == 1 else f"stages {run[0]}-{run[-1]}"
        memory = max(roles[s].predicted_memory_bytes for s in run)
        parts.append(
            f"{where} on {_devices(space, g.replicas, split.stage_types[run[0]])} ({first.precision}) hold{'s' * (len(run) == 1)} "
            f"{counts} layers [{first.layers[0]}, {last.layers[1]}) because {_why_layers(space, g, run[0])}; "
            f"up to {memory / GiB:.2f} of {first.memory_cap_bytes / GiB:g} GiB"
            + (", with activation checkpointing to fit" if first.activation_checkpointing else "")
        )
    return parts


def _layout(space: Space, g: Group) -> str:
    """The stages of a kind, runs of one type together: ``2 × V100-16GB → 1 × A100-80GB``."""
    return " → ".join(_devices(space, len(list(r)), t) for t, r in itertools.groupby(g.split.stage_types))


def _zero_clause(space: Space, shape: Shape) -> str:
    """ZeRO-1: how each kind shards its stages' Adam state, and the all-gather that follows the step."""
    replicated = [g for g in shape.groups if g.replicas > 1]
    if not replicated:
        return "ZeRO-1: no pipeline kind is replicated, so every stage keeps its Adam state whole (no all-gather)"
    counts = {g.replicas for g in shape.groups}
    if len(counts) == 1:
        n = counts.pop()
        over = f"the {n} replicas of its pipeline kind (1/{n} each)"
    else:
        over = (
            "the replicas of its pipeline kind ("
            + ", ".join(
                f"1/{g.replicas} each over {g.replicas} × ({_layout(space, g)})"
                if g.replicas > 1
                else f"whole in 1 × ({_layout(space, g)})"
                for g in shape.groups
            )
            + ")"
        )
    return (
        f"ZeRO-1: each stage's Adam state is sharded over {over}, the updated slices all-gathered after the "
        f"step ({shape.zero_gather_s * 1e3:.3g} ms)"
    )


def _tp_clause(space: Space, shape: Shape) -> str:
    """How the stages split their layers: one degree for every stage, or each type's own."""
    how = (
        "splitting its GPT blocks' heads and MLP columns (evenly among devices of one type), their all-reduces "
        "on the node's links (the times above are a member's, all-reduces included)"
    )
    if space.uniform:
        d = next(iter(space.tp_degrees.values()))
        return f"tensor parallel: each stage is {d} devices of one type on one node {how}"
    grouping = {1: "alone", 2: "as tensor-parallel pairs"}
    degrees = {t: space.tp_degrees[t] for g in shape.groups for t in g.split.stage_types}
    # A group of one type's devices beside that type's single devices: some of its stages split, others not.
    split_too = {
        space.tables[t].members[0].gpu_type for t in degrees if space.tables[t].members and not _across(space, t)
    }

    def words(t: str, d: int) -> str:
        table = space.tables[t]
        if _across(space, t):
            return f"{t} stages split across its types by speed ({' : '.join(f'{w:.2f}' for w in table.weights)})"
        if table.members:
            return f"some {table.members[0].gpu_type} stages {grouping.get(d, f'as tensor-parallel groups of {d}')}"
        return f"{'the other ' * (t in split_too)}{t} stages {grouping.get(d, f'as tensor-parallel groups of {d}')}"

    per_type = ", ".join(words(t, d) for t, d in degrees.items())
    return (
        f"tensor parallel per type: {per_type}, each group on one node {how}; the pipelines are all one kind, "
        "as every pipeline holding a layer must split it alike"
    )


def explain(space: Space, shape: Shape, alloc: Allocation, plan: Plan) -> str:
    """Plain language: each kind of pipeline, what each stage holds and why, the batch, communication."""
    sync = "gradient all-reduce and ZeRO-1 all-gather" if space.zero_stage else "gradient all-reduce"
    lines = [
        f"{plan.num_pipelines} pipeline{'s' * (plan.num_pipelines > 1)} share {space.global_batch} samples; "
        f"step {plan.predicted_step_s * 1e3:.4g} ms = slowest pipeline {plan.predicted_compute_s * 1e3:.4g} ms "
        f"(with its bubble and stage-to-stage messages) + {sync} {plan.predicted_comm_s * 1e3:.3g} ms"
    ]
    first = 0
    for g, units in zip(shape.groups, alloc.units):
        split = g.split
        roles = [r for r in plan.roles if r.pipeline == first and r.tp_rank == 0]  # one per stage
        batches = sorted(set(units))
        per = "/".join(str(u * g.unit) for u in batches)
        if split.stages == 1:
            r = roles[0]
            why = (
                "activation checkpointing because a sample's activations do not fit otherwise"
                if r.activation_checkpointing
                else f"micro-batch {r.micro_batch}"
            )
            lines.append(
                f"{_devices(space, g.replicas, split.stage_types[0])} data parallel ({r.precision}): {per} samples each, {why}, "
                f"{r.predicted_memory_bytes / GiB:.2f} of {r.memory_cap_bytes / GiB:g} GiB"
            )
        else:
            head = (
                f"{g.replicas} pipeline{'s' * (g.replicas > 1)} of {split.stages} stages "
                f"({_layout(space, g)}), {per} samples each in micro-batches of {split.micro} "
                f"({space.schedule.upper()})"
            )
            parts = _stage_runs(space, g, roles)
            lines.append(head + ": " + "; ".join(parts))
        first += g.replicas
    if max(space.tp_degrees.values()) > 1:
        lines.append(_tp_clause(space, shape))
    if space.zero_stage:
        lines.append(_zero_clause(space, shape))
    lines += [f"{e.count} × {e.gpu_type} unused: {e.reason}" for e in plan.excluded]
    if plan.predicted_comm_s != plan.predicted_comm_fp32_s:
        lines.append(
            f"1-bit compressed all-reduce {plan.predicted_comm_s * 1e3:.3g} ms against "
            f"{plan.predicted_comm_fp32_s * 1e3:.3g} ms in fp32"
        )
    if plan.emulated:
        lines.append("devices are emulated on CPU: times are what the plan was given (catalog, or a profile of them)")
    return "; ".join(lines)
