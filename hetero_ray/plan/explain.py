"""Turn a chosen shape and batch allocation into a Plan with roles and a plain-language explanation."""

from __future__ import annotations

import math

from hetero_ray.plan.memory import in_flight, stage_memory_bytes
from hetero_ray.plan.plan import Exclusion, Plan, WorkerRole
from hetero_ray.plan.search import Allocation, Group, Shape, Space

GiB = 2**30


def _role(space: Space, g: Group, s: int, pipeline: int, units: int, offset: int, pipelines: int) -> WorkerRole:
    split, t = g.split, g.split.stage_types[s]
    table = space.tables[t]
    i, j = split.bounds[s], split.bounds[s + 1]
    if split.stages == 1:
        local_batch = units
        micro = math.ceil(local_batch / math.ceil(local_batch / min(g.dp_micro_cap, local_batch)))
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
        micro_batch=micro,
        in_flight=flight,
        scale=table.scale,
        checkpointing=split.checkpointing[s],
    )
    return WorkerRole(
        gpu_type=t,
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


def build_plan(space: Space, shape: Shape, alloc: Allocation, *, emulated: bool) -> Plan:
    """Roles for every pipeline (pipelines numbered group by group), offsets contiguous, and the explanation."""
    pipelines = sum(g.replicas for g in shape.groups)
    roles, offset, p = [], 0, 0
    for g, units in zip(shape.groups, alloc.units):
        for u in units:
            stage_roles = [_role(space, g, s, p, u, offset, pipelines) for s in range(g.split.stages)]
            roles += stage_roles
            offset += stage_roles[0].local_batch
            p += 1
    excluded = tuple(
        Exclusion(gpu_type=t, count=n, reason="left over: too few to form another pipeline of the chosen shape")
        if t in {x for g in shape.groups for x in g.split.stage_types}
        else Exclusion(gpu_type=t, count=n, reason="the plan is faster without them (memory or communication)")
        for t, n in shape.excluded
    )
    plan = Plan(
        global_batch=space.global_batch,
        split="planned",
        emulated=emulated,
        roles=tuple(roles),
        predicted_compute_s=alloc.seconds,
        excluded=excluded,
        predicted_comm_s=shape.comm_s,
        predicted_comm_fp32_s=shape.comm_fp32_s,
        schedule=space.schedule,
    )
    return Plan(**{**plan.__dict__, "explanation": explain(space, shape, alloc, plan)})


def _why_layers(space: Space, g: Group, s: int) -> str:
    split = g.split
    t = split.stage_types[s]
    if split.stage_seconds[s] >= split.pace * 0.98:
        return f"it paces the pipeline at {split.stage_seconds[s] * 1e3:.3g} ms per micro-batch"
    return f"fewer layers keep it under the slowest stage ({split.stage_seconds[s] * 1e3:.3g} of {split.pace * 1e3:.3g} ms per micro-batch) and within {space.tables[t].cap_bytes / GiB:g} GiB"


def explain(space: Space, shape: Shape, alloc: Allocation, plan: Plan) -> str:
    """Plain language: each kind of pipeline, what each stage holds and why, the batch, communication."""
    lines = [
        f"{plan.num_pipelines} pipeline{'s' * (plan.num_pipelines > 1)} share {space.global_batch} samples; "
        f"step {plan.predicted_step_s * 1e3:.4g} ms = slowest pipeline {plan.predicted_compute_s * 1e3:.4g} ms "
        f"(with its bubble and stage-to-stage messages) + gradient all-reduce {plan.predicted_comm_s * 1e3:.3g} ms"
    ]
    first = 0
    for g, units in zip(shape.groups, alloc.units):
        split = g.split
        roles = [r for r in plan.roles if r.pipeline == first]
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
                f"{g.replicas} × {r.gpu_type} data parallel ({r.precision}): {per} samples each, {why}, "
                f"{r.predicted_memory_bytes / GiB:.2f} of {r.memory_cap_bytes / GiB:g} GiB"
            )
        else:
            head = (
                f"{g.replicas} pipeline{'s' * (g.replicas > 1)} of {split.stages} stages "
                f"({' → '.join(split.stage_types)}), {per} samples each in micro-batches of {split.micro} "
                f"({space.schedule.upper()})"
            )
            parts = []
            for s, r in enumerate(roles):
                i, j = r.layers
                parts.append(
                    f"stage {s} on {g.replicas} × {r.gpu_type} ({r.precision}) holds {j - i} layers [{i}, {j}) "
                    f"because {_why_layers(space, g, s)}; {r.predicted_memory_bytes / GiB:.2f} of "
                    f"{r.memory_cap_bytes / GiB:g} GiB"
                    + (", with activation checkpointing to fit" if r.activation_checkpointing else "")
                )
            lines.append(head + ": " + "; ".join(parts))
        first += g.replicas
    lines += [f"{e.count} × {e.gpu_type} unused: {e.reason}" for e in plan.excluded]
    if plan.predicted_comm_s != plan.predicted_comm_fp32_s:
        lines.append(
            f"1-bit compressed all-reduce {plan.predicted_comm_s * 1e3:.3g} ms against "
            f"{plan.predicted_comm_fp32_s * 1e3:.3g} ms in fp32"
        )
    if plan.emulated:
        lines.append("devices are emulated: times are modelled GPU times, computed on CPU")
    return "; ".join(lines)
