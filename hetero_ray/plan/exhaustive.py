"""Every plan of the search's space, for checking the search on small instances. Not used to plan.

It shares with the search only the space's definition (the tensor-parallel degree
assignments and groups planned as types with their precision and split, stage counts,
mixed compositions, one kind alone at unequal degrees, node placement of stages, at
ZeRO-1 no shape of one-stage kinds only) and the
objective (``allocate`` plus ``shape_comm``: the gradient all-reduce, then ZeRO-1's
all-gather). Stage times and memory (at ZeRO-1 with each stage's Adam
state split over its kind's replicas) are recomputed here from the
per-layer costs with the scalar cost functions, every contiguous layer split and
every checkpointing choice per stage and every micro-batch size per kind is
tried, and only options that another option of the same kind beats on every
term of the objective are dropped (the objective never improves when a stage
time, a fill or a stage's parameters grow). Exponential: for a few devices and
layers only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.cost import activation_scale, p2p_seconds, stage_compute_seconds, tp_allreduce_seconds
from hetero_ray.plan.memory import in_flight, stage_memory_bytes
from hetero_ray.plan.search import (
    MICRO_BATCHES,
    Group,
    Kinds,
    Space,
    allocate,
    build_space,
    kind_types,
    local_members,
    searched_degrees,
    searched_spaces,
    shape_comm,
)
from hetero_ray.plan.stages import KindSplit, workload_layers
from hetero_ray.plan.topology import Topology


def kind_options(
    space: Space,
    stage_types: tuple[str, ...],
    layers,
    catalog: Catalog,
    efficiency: float,
    replicas: int = 1,
):
    """Every feasible (micro-batch, split, checkpointing) of one kind replicated ``replicas`` times, dominated
    ones dropped. ``layers``: by type, each member's (GPU type, costs) in its tensor-parallel group (one member
    of a type's even group; every member of a group across types, at its part). A stage fits where every
    member fits, checkpoints on all members or none, and takes its slowest member's time."""
    S, L = len(stage_types), len(next(iter(layers.values()))[0][1])
    links = Kinds(space).links(stage_types)
    specs = {m: catalog.get(m) for t in set(stage_types) for m, _ in layers[t]}
    precs = {t: space.tables[t].precision for t in set(stage_types)}
    options = []
    for m in space.micro_batches if S > 1 else (1,):
        if m > space.global_batch:
            continue
        for cut in itertools.combinations(range(1, L), S - 1):
            bounds = (0, *cut, L)
            per_stage = []
            for s, t in enumerate(stage_types):
                i, j = bounds[s], bounds[s + 1]
                whole = layers[t][0][1]  # what crosses a boundary is whole on every member
                scale = activation_scale(precs[t])
                inputs = [whole[k - 1].output_bytes_per_sample if k > 0 else 0.0 for k in range(i, j)]
                msgs = 0.0
                if s > 0:
                    msgs += p2p_seconds(inputs[0] * scale, m, *links[s - 1])
                if s < S - 1:
                    msgs += p2p_seconds(whole[j - 1].output_bytes_per_sample * scale, m, *links[s])
                choices = []
                for ckpt in (False, True):
                    members = [
                        member_cost(
                            space, t, specs[gpu], precs[t], costs[i:j], inputs, m, s, S, ckpt, efficiency, replicas
                        )
                        for gpu, costs in layers[t]
                    ]
                    if all(c is not None for c in members):
                        compute = max(c for c, _ in members)
                        choices.append((ckpt, compute, compute + msgs, max(p for _, p in members)))
                if not choices:
                    break
                per_stage.append(choices)
            else:
                for pick in itertools.product(*per_stage):
                    options.append(
                        KindSplit(
                            stage_types=stage_types,
                            micro=m,
                            bounds=bounds,
                            checkpointing=tuple(p[0] for p in pick),
                            stage_seconds=tuple(p[2] for p in pick),
                            compute_seconds=tuple(p[1] for p in pick),
                            stage_params=tuple(p[3] for p in pick),
                            max_micro_batches=None,
                        )
                    )
    return pareto(options)


def member_cost(
    space: Space, t: str, spec, prec: str, span, inputs, m: int, s: int, S: int, ckpt: bool, efficiency, replicas
) -> tuple[float, int] | None:
    """(compute seconds, parameters) of one device of stage ``s`` of type ``t`` holding ``span`` (its costs of
    the stage's layers) at micro-batch ``m``; ``None`` where it does not fit the device's memory."""
    params = sum(c.params for c in span)
    scale = activation_scale(prec)
    memory = stage_memory_bytes(
        params,
        [c.activation_bytes_per_sample for c in span],
        inputs,
        optimizer=space.optimizer,
        world=2,
        state_shards=space.state_shards(replicas),
        micro_batch=m,
        in_flight=in_flight(space.schedule, S, S, s),
        scale=scale,
        checkpointing=ckpt,
    )
    if memory > spec.memory_bytes:
        return None
    flops = m * sum(c.flops_per_sample for c in span)
    compute = stage_compute_seconds(flops, spec.peak_flops(prec), efficiency, checkpointing=ckpt) + sum(
        tp_allreduce_seconds(
            c.output_bytes_per_sample * scale,
            m,
            space.tp_degrees[t],
            space.topology.intra(t),
            checkpointing=ckpt,
            # One stage: priced per sample, its share one micro-batch.
            batches=1.0 if S > 1 else 1 / space.dp_share,
        )
        for c in span
        if c.splittable
    )
    return compute, params


def pareto(options: Sequence[KindSplit]) -> list[KindSplit]:
    """Drop an option when another of the same micro-batch is no worse in pace, fill and every type's largest stage."""

    def key(o: KindSplit):
        worst = {}
        for t, p in zip(o.stage_types, o.stage_params):
            worst[t] = max(worst.get(t, 0), p)
        return (o.pace, o.fill, *(worst[t] for t in sorted(worst)))

    keyed = [(o.micro, key(o), o) for o in options]
    kept = []
    for m, k, o in keyed:
        if not any(m2 == m and k2 != k and all(a <= b for a, b in zip(k2, k)) for m2, k2, _ in keyed):
            if all(not (m2 == m and k2 == k) for m2, k2, _ in ((x.micro, key(x), x) for x in kept)):
                kept.append(o)
    return kept


def exhaustive_best_step(
    rank_types: Sequence[str],
    catalog: Catalog,
    footprint: Footprint,
    *,
    global_batch: int,
    topology: Topology,
    optimizer: str = "adam",
    precision: str = "auto",
    efficiency: float = 0.4,
    schedule: str = "1f1b",
    max_stages: int = 8,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    tensor_parallel: Sequence[int] = (1,),
    zero_stage: int = 0,
) -> float:
    """The shortest predicted step over every plan of the space (``inf`` if none fits), every assignment of
    the degrees of ``tensor_parallel`` to the types tried as the search does (at ``zero_stage`` 1, degree 1
    only)."""
    best = math.inf
    spaces = searched_spaces(rank_types, topology, searched_degrees(tensor_parallel, zero_stage), max_stages)
    for types, topo, degrees in spaces:
        space = build_space(
            types,
            catalog,
            footprint,
            global_batch=global_batch,
            topology=topo,
            optimizer=optimizer,
            precision=precision,
            efficiency=efficiency,
            schedule=schedule,
            max_stages=max_stages,
            micro_batches=micro_batches,
            seconds_per_sample=None,
            tp_degrees=degrees,
            zero_stage=zero_stage,
        )
        if space is not None:
            best = min(best, best_step_in(space, footprint, catalog, efficiency))
    return best


def best_step_in(space: Space, footprint: Footprint, catalog: Catalog, efficiency: float) -> float:
    """The shortest predicted step over every plan of one space (one tensor-parallel degree per type)."""
    whole = workload_layers(footprint)
    layers = {
        t: tuple(
            (member.gpu_type, tuple(c.part(w) for c in whole))
            for member, w in zip(space.tables[t].members, space.tables[t].weights)
        )
        if space.tables[t].members
        else ((t, tuple(c.shard(d) for c in whole)),)
        for t, d in space.tp_degrees.items()
        if t in space.tables
    }
    cache: dict[tuple[tuple[str, ...], int], list[KindSplit]] = {}

    def options(types, replicas):
        key = (types, space.state_shards(replicas))
        if key not in cache:
            cache[key] = kind_options(space, types, layers, catalog, efficiency, replicas)
        return cache[key]

    best = math.inf
    for mixed in space.fixed_kinds():
        left = dict(space.counts)
        fixed = []
        if mixed is not None:
            types = kind_types(mixed, space.order)
            r = space.replicas(mixed)
            if not options(types, r):
                continue
            fixed.append((types, r))
            for t, c in mixed.items():
                left[t] -= r * c
        per_type = [
            [s for s in space.stage_options(t, left[t]) if s == 0 or options((t,) * s, left[t] // s)]
            for t in space.order
        ]
        for choice in itertools.product(*per_type):
            kinds = fixed + [((t,) * s, left[t] // s) for t, s in zip(space.order, choice) if s]
            # At ZeRO-1 pure data parallelism is the data-parallel planner's, not this space's.
            if not kinds or (space.zero_stage and all(len(types) == 1 for types, _ in kinds)):
                continue
            for picks in itertools.product(*(options(types, r) for types, r in kinds)):
                groups = [
                    Group(
                        split=split,
                        replicas=r,
                        local=local_members(space, types, r),
                        dp_micro_cap=1,
                        unit=split.micro if len(types) > 1 else 1,
                    )
                    for (types, r), split in zip(kinds, picks)
                ]
                alloc = allocate(space.global_batch, groups)
                if alloc is None:
                    continue
                best = min(best, alloc.seconds + shape_comm(space, groups)[0])
    return best
