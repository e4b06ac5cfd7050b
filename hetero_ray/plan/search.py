"""The placement planner: pipelines of GPU-type stages, replicated for data parallelism.

Entry point: ``plan(rank_types, catalog, footprint, global_batch=..., topology=..., zero_stage=...)``
returns the ``top_k`` feasible plans, best (shortest predicted step) first, or
``Infeasible`` naming the smallest memory shortfall in the space.

The plan space (the exhaustive enumerator in ``plan/exhaustive.py`` walks the
same one): devices of one type are interchangeable, so a plan is a *shape* —
 - at most one mixed "virtual worker" kind: a pipeline with c_t stages of each
   type t in a subset of ≥ 2 types (c_t a power of two, Σ c_t ≤ max_stages, types
   ordered by memory, then speed), replicated r = min_t ⌊n_t / c_t⌋ times;
 - for every type, the devices left over form ⌊n / S_t⌋ replicas of an S_t-stage
   pipeline of that type alone, S_t ∈ {0 (type unused), 1 (data parallel), 2, 4, 8, …};
 - for each kind: a contiguous split of the L layers, activation checkpointing per
   stage, and one micro-batch size (the search takes the split with the smallest
   pace, then fill, and the micro-batch with the shortest time per sample for a
   pipeline's even share of the batch, trying sizes upwards while it improves;
   the enumerator tries every split, checkpointing and micro-batch);
 - the global batch split over pipelines in micro-batches, minimising the slowest
   pipeline (``allocate``); precision per type from ``choose_precision``
   (half precision is faster and smaller wherever the card has it);
 - the ZeRO stage, one per call (``zero_stage``): at 1 each stage's Adam moments
   are sharded evenly over the r replicas of its kind, so a device holding layers
   [i, j) keeps params[i, j) × (weights and gradients + Adam state / r) static bytes
   (a one-stage kind shards over its r data-parallel replicas alike) and a kind's
   split depends on r; shapes of one-stage kinds only (pure data parallelism, whose
   ZeRO-1 shards across types by memory in ``plan/data_parallel.py``) are left out;
 - a tensor-parallel degree per type (``tensor_parallel``): every stage of a type is a
   group of that many of its devices on one node. The runtime sums each layer's
   gradients per tensor-parallel part, so every pipeline holding a layer must split it
   alike: at one degree for every type, shapes are as above; at unequal degrees, a
   shape is one mixed kind of exactly the types given a degree, replicated, alone;
 - where nodes hold several types (``Topology.mixed``), a group of one device of each
   of a node's types is a type of its own, its GPT blocks split in proportion to the
   members' speeds (``stages.group_table``): a stage of it fits where every member
   fits its own memory and takes its slowest member's time. Its spaces are the group
   alone or beside one other type, one kind replicated alone as at unequal degrees;
 - so that stages of one type may differ in degree, a group of d of a type's devices
   is also a type of its own beside that type's single devices (one space per count
   of groups that a kind replicates best), again one kind replicated alone.
Step = slowest pipeline's (M-1)·max_stage + Σ stages (stage times include their
stage-to-stage messages) + the gradient all-reduce (hierarchical, or 1-bit compressed)
+ at ZeRO-1, the all-gather of the updated fp32 parameters among each kind's replicas.

Complexity: with T types, L layers and S = max_stages, there are
O(T·log S) single-type kinds and O(C) mixed kinds (C ≤ (log₂S+1)^T compositions),
each split once per micro-batch candidate by an O(S·L²) dynamic programme (numpy),
then O(C · (log₂S+2)^T) shapes, each bounded in O(T·S) (a relaxed batch split plus
its exact fp32 communication), computed as one numpy grid per mixed kind. Shapes are
evaluated exactly (O(P log P) for P pipelines) in bound order until the bound passes
the k-th best (branch and bound: no shape is missed). Nothing grows with the
number of GPUs except that last exact allocation of a few shapes; measured here:
about 0.5 s of CPU for 64 or 4096 GPUs of 4 types and 98 layers (bench/planner.py).
With D tensor-parallel degrees, there are D uniform spaces and Σ_k C(T, k)·(D^k − D)
of unequal degrees, each with the mixed kinds of all its k types only, a kind not split
when ``kind_bound`` (its compute at the best balance) passes the k-th best so far:
measured here, 4 types, 48 layers, degrees (1, 2, 4, 8): 7.6 s against 0.7 s for the
uniform spaces alone; 3 types: 1 s; 2 types: 0.2 s; degree 1 alone costs nothing more.
The micro-batch rule (sizes tried upwards while the time per sample improves) and
the split's tie-break (pace, then fill) are the two places the search may miss the
space's optimum; the enumerator measures by how much.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.config import ONEBIT_OPTIMIZERS
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.cost import WIRE_BYTES, allreduce_seconds, hierarchical_allreduce_seconds
from hetero_ray.plan.memory import SCHEDULES
from hetero_ray.plan.plan import Infeasible, Plan
from hetero_ray.plan.stages import (
    KindSplit,
    SecondsPerSample,
    TypeTable,
    group_table,
    min_shortfall,
    split_kind,
    stage_links,
    static_matrix,
    type_table,
    workload_layers,
)
from hetero_ray.plan.topology import NodeKind, Topology, group_members, group_name, is_group
from hetero_ray.suggest import did_you_mean

GiB = 2**30
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True, eq=False)
class Group:
    """``replicas`` identical pipelines of one kind in a plan."""

    split: KindSplit
    replicas: int
    local: tuple[int, ...]  # per stage: members of its data-parallel group on one node
    dp_micro_cap: int  # one-stage kinds: the largest micro-batch that fits
    unit: int  # samples per allocation unit: a micro-batch for pipelines, one sample for data parallelism

    @property
    def nodes(self) -> int:
        """The nodes its replicas span: as many replicas share a node as the stage that packs fewest allows."""
        return -(-self.replicas // min(self.local))

    @functools.cached_property
    def bound_terms(self) -> tuple[float, float, float, float]:
        """(samples per round of units, their rate, their offset, fill) for ``allocation_bound``."""
        ru = self.replicas * self.unit
        return ru, ru / self.split.pace, ru * self.split.fill / self.split.pace, self.split.fill


@dataclass(frozen=True)
class Allocation:
    """Micro-batches (units) per pipeline of each group, and the slowest pipeline's time."""

    units: tuple[tuple[int, ...], ...]
    seconds: float


def pipeline_time(split: KindSplit, units: int) -> float:
    """(M-1)·X + Y; for data parallelism X = Y = seconds per sample, so it is units × that."""
    return (units - 1) * split.pace + split.fill


def allocate(global_batch: int, groups: Sequence[Group]) -> Allocation | None:
    """Units per pipeline summing to ``global_batch`` samples, minimising the slowest pipeline.

    Every pipeline gets at least one unit. The smallest time τ whose capacity
    reaches the batch is found by raising groups one unit at a time from the
    continuous bound; the excess is then taken back one unit at a time from the
    slowest pipelines. ``None`` when the batch is smaller
    than one unit per pipeline, above what GPipe memory allows, or cannot be hit
    exactly with the groups' micro-batch sizes.
    """
    if sum(g.replicas * g.unit for g in groups) > global_batch:
        return None
    caps = [g.split.max_micro_batches or (1 << 40) for g in groups]
    if sum(g.replicas * g.unit * c for g, c in zip(groups, caps)) < global_batch:
        return None

    def units_at(tau: float) -> list[int]:
        return [
            max(1, min(cap, math.floor((tau - g.split.fill) / g.split.pace) + 1)) if tau >= g.split.fill else 1
            for g, cap in zip(groups, caps)
        ]

    def capacity(units: list[int]) -> int:
        return sum(g.replicas * g.unit * u for g, u in zip(groups, units))

    # From the continuous bound, raise the group whose next unit finishes first until the batch fits:
    # every group then runs as many units as fit under the smallest sufficient time.
    units = units_at(allocation_bound(global_batch, groups) * (1 - 1e-9))
    while capacity(units) < global_batch:
        k = min(
            (k for k in range(len(groups)) if units[k] < caps[k]),
            key=lambda k: pipeline_time(groups[k].split, units[k] + 1),
        )
        units[k] += 1
    per_pipe = [[u] * g.replicas for g, u in zip(groups, units)]
    excess = capacity(units) - global_batch
    # Slowest first; a pipeline whose unit exceeds the excess is passed over.
    heap = [
        (-pipeline_time(g.split, u), gi, p) for gi, (g, u) in enumerate(zip(groups, units)) for p in range(g.replicas)
    ]
    heapq.heapify(heap)
    while excess > 0 and heap:
        _, gi, p = heapq.heappop(heap)
        g = groups[gi]
        if g.unit <= excess and per_pipe[gi][p] > 1:
            per_pipe[gi][p] -= 1
            excess -= g.unit
            heapq.heappush(heap, (-pipeline_time(g.split, per_pipe[gi][p]), gi, p))
    if excess:
        return None
    seconds = max(pipeline_time(g.split, u) for g, pipes in zip(groups, per_pipe) for u in set(pipes))
    return Allocation(units=tuple(tuple(p) for p in per_pipe), seconds=seconds)


def allocation_bound(global_batch: int, groups: Sequence[Group]) -> float:
    """A lower bound on ``allocate``'s time: the batch split continuously, every pipeline busy ≥ one unit."""
    ru, rate, offset, fill = zip(*(g.bound_terms for g in groups))
    return max(max(fill), (global_batch - sum(ru) + sum(offset)) / sum(rate))


def stage_numels(split: KindSplit, stage: int, layers: int, tensors: int) -> list[int]:
    """Parameter tensors of a stage, for 1-bit pricing (tensor by tensor): its share of the model's tensors."""
    i, j = split.bounds[stage], split.bounds[stage + 1]
    k = max(1, round(tensors * (j - i) / layers))
    return [max(1, split.stage_params[stage] // k)] * k


def comm_seconds(
    groups: Sequence[Group], topology: Topology, *, compressed: bool, layers: int, tensors: int, wire_bytes: float
) -> float:
    """Gradient synchronisation per step: the slowest device's all-reduce of its stage's gradients.

    Each layer's gradient is averaged over the P pipelines. The members of a
    stage's group sit ``local`` to a node; the group spans the nodes of all
    groups. fp32: hierarchical (intra-node reduce-scatter, inter-node ring,
    intra-node all-gather), ``wire_bytes`` per gradient element (``train.reduce_dtype``).
    1-bit compressed: DeepSpeed's flat algorithm, tensor
    by tensor, on the slowest link it crosses.
    """
    pipelines = sum(g.replicas for g in groups)
    if pipelines <= 1:
        return 0.0
    nodes = sum(g.nodes for g in groups)
    inter = topology.inter({t for g in groups for t in g.split.stage_types})
    return max(
        group_comm_seconds(
            g,
            topology,
            pipelines,
            nodes,
            inter,
            compressed=compressed,
            layers=layers,
            tensors=tensors,
            wire_bytes=wire_bytes,
        )
        for g in groups
    )


@functools.lru_cache(maxsize=1 << 16)
def group_comm_seconds(
    g: Group, topology: Topology, pipelines: int, nodes: int, inter: tuple[float, float], **kw
) -> float:
    """The slowest all-reduce among one group's devices (see ``comm_seconds``)."""
    worst = 0.0
    # A larger payload never syncs faster on the same links: the largest stage of each type decides.
    for s, t in largest_stage_per_type(g.split):
        intra = topology.intra(t)
        if kw["compressed"]:
            link = inter if nodes > 1 else intra
            numels = stage_numels(g.split, s, kw["layers"], kw["tensors"])
            seconds = allreduce_seconds(numels, pipelines, *link, compressed=True)
        else:
            local = pipelines if nodes == 1 else g.local[s]
            payload = kw["wire_bytes"] * g.split.stage_params[s]
            seconds = hierarchical_allreduce_seconds(payload, local=local, nodes=nodes, intra=intra, inter=inter)
        worst = max(worst, seconds)
    return worst


def zero_gather_seconds(groups: Sequence[Group], topology: Topology) -> float:
    """ZeRO-1's all-gather after the optimizer step: each rank broadcasts the slice of its stage's fp32
    parameters it updated to the other replicas of its kind holding that stage.

    An all-gather moves half the bytes of an all-reduce in half its rounds, so each group is priced as half
    of ``group_comm_seconds``' hierarchical all-reduce of 4 bytes per parameter over its own replicas and
    their nodes only; the groups gather side by side, so the slowest one decides.
    """
    return max(
        (
            0.5
            * group_comm_seconds(
                g,
                topology,
                g.replicas,
                g.nodes,
                topology.inter(set(g.split.stage_types)),
                compressed=False,
                wire_bytes=4.0,
            )
            for g in groups
            if g.replicas > 1
        ),
        default=0.0,
    )


@functools.lru_cache(maxsize=1 << 12)
def largest_stage_per_type(split: KindSplit) -> tuple[tuple[int, str], ...]:
    """(stage, type) of the stage holding most parameters, for each type of the kind."""
    best: dict[str, int] = {}
    for s, t in enumerate(split.stage_types):
        if t not in best or split.stage_params[s] > split.stage_params[best[t]]:
            best[t] = s
    return tuple((s, t) for t, s in best.items())


@dataclass(frozen=True)
class Shape:
    """One point of the plan space before the batch is split: groups and their communication."""

    groups: tuple[Group, ...]
    excluded: tuple[tuple[str, int], ...]
    comm_s: float  # ZeRO-1's all-gather included
    comm_fp32_s: float  # ZeRO-1's all-gather included
    bound: float
    zero_gather_s: float = 0.0  # ZeRO-1: the all-gather of the updated parameters


@dataclass(frozen=True, kw_only=True)
class Space:
    """Everything the shapes of one planning problem share."""

    counts: dict[str, int]  # tensor-parallel groups per type (devices where its degree is 1)
    devices: dict[str, int]  # devices per type, those the space leaves out included
    # Per type planned: every stage of the type is a group of this many of its devices on one node. Types of
    # ``devices`` without a degree are another space's (see ``fixed_kinds``).
    tp_degrees: dict[str, int]
    order: tuple[str, ...]  # types by memory, then speed: the stage order of mixed kinds
    tables: dict[str, TypeTable]
    topology: Topology
    global_batch: int
    schedule: str
    optimizer: str
    max_stages: int
    micro_batches: tuple[int, ...]
    layers: int
    tensors: int
    wire_bytes: float  # bytes per gradient element on the wire (``train.reduce_dtype``)
    zero_stage: int  # 1: each stage's Adam state sharded over the replicas of its kind

    def state_shards(self, replicas: int) -> int:
        """How many ways a kind replicated ``replicas`` times splits each stage's Adam state."""
        return replicas if self.zero_stage else 1

    @property
    def dp_share(self) -> float:
        """Samples a data-parallel worker (a tensor-parallel group where its degree is > 1) gets at an even split
        of the batch."""
        return self.global_batch / sum(self.counts.values())

    @property
    def uniform(self) -> bool:
        """Whether every type planned has one tensor-parallel degree and none is a group planned as a type (kinds
        then mix freely)."""
        return is_uniform(self.tp_degrees)

    def fixed_kinds(self) -> list[dict[str, int] | None]:
        """The mixed kind each block of shapes holds (``None``: none, single-type kinds only).

        The runtime sums each layer's gradients per tensor-parallel part, so every pipeline holding a layer
        must split it alike: at unequal degrees a shape is one mixed kind replicated and nothing beside it
        (``stage_options`` then offers no single-type pipeline)."""
        return ([None] if self.uniform else []) + self.mixed_compositions()

    def stage_options(self, gpu_type: str, available: int) -> list[int]:
        """Stage counts a single-type pipeline of ``gpu_type`` may have with ``available`` devices (0: unused)."""
        if not self.uniform:
            return [0]
        return [0] + [s for s in powers_of_two(min(self.max_stages, self.layers)) if s <= available]

    def replicas(self, composition: Mapping[str, int]) -> int:
        """How many pipelines of a mixed kind the devices hold."""
        return min(self.counts[t] // c for t, c in composition.items())

    def mixed_compositions(self) -> list[dict[str, int]]:
        """Stages per type of every mixed kind: ≥ 2 types, powers of two, at most max_stages in all. At unequal
        degrees, kinds of every type the space plans only: a subset of them is the space of its own degrees."""
        out = []
        per_type = powers_of_two(self.max_stages)
        for k in range(2, len(self.order) + 1) if self.uniform else (len(self.tp_degrees),):
            for subset in itertools.combinations(self.order, k):
                for c in itertools.product(per_type, repeat=k):
                    if sum(c) <= min(self.max_stages, self.layers) and all(
                        ci <= self.counts[t] for ci, t in zip(c, subset)
                    ):
                        out.append(dict(zip(subset, c)))
        return out


def is_uniform(degrees: Mapping[str, int]) -> bool:
    """One degree for every type, and no group planned as a type (``searched_spaces``: its split is its own)."""
    return len(set(degrees.values())) == 1 and not any(is_group(t) for t in degrees)


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def kind_types(composition: Mapping[str, int], order: Sequence[str]) -> tuple[str, ...]:
    return tuple(t for t in order for _ in range(composition.get(t, 0)))


class Kinds:
    """Split each pipeline kind once, at the micro-batch the kind's even share of the batch prefers (at
    ZeRO-1, once per replica count, which sets the stages' share of Adam's state)."""

    def __init__(self, space: Space):
        self.space = space
        self._cache: dict[tuple[tuple[str, ...], int], KindSplit | None] = {}

    def links(self, stage_types: tuple[str, ...]) -> list:
        # A boundary between types of degrees d and d' carries d' copies of the activations forward and d of
        # the gradients back over the NICs; the grouped topology's NIC share of the slower side prices it,
        # as one member's message over its share of the NIC.
        topo = self.space.topology
        intra = {t: topo.intra(t) for t in set(stage_types)}
        return stage_links(stage_types, intra, topo.inter(set(stage_types)), lambda t: topo.node(t).gpus_per_node)

    def get(self, stage_types: tuple[str, ...], replicas: int = 1) -> KindSplit | None:
        """The kind's split, replicated ``replicas`` times, at the micro-batch that runs its even share of the
        batch fastest per sample.

        Micro-batches are tried in increasing order while the time per sample improves: a larger
        one amortises per-message latency but lengthens the fill and drain, so the time per sample
        falls, then rises.
        """
        sp = self.space
        shards = sp.state_shards(replicas)
        key = (stage_types, shards)
        if key in self._cache:
            return self._cache[key]
        links = self.links(stage_types)
        share = self.share(stage_types)
        best, best_rate = None, math.inf
        for m in sp.micro_batches if len(stage_types) > 1 else (1,):
            if m > sp.global_batch:
                break
            split = split_kind(
                stage_types,
                sp.tables,
                micro=m,
                schedule=sp.schedule,
                optimizer=sp.optimizer,
                links=links,
                state_shards=shards,
            )
            if split is None:
                break  # a larger micro-batch needs more memory still
            units = max(1, round(share / m))
            rate = pipeline_time(split, units) / (units * m)
            if rate >= best_rate * (1 - 1e-12):
                break
            best, best_rate = split, rate
        self._cache[key] = best
        return best

    def share(self, stage_types: tuple[str, ...]) -> float:
        """Samples one pipeline of this kind would get if every device ran this many stages."""
        devices = sum(self.space.counts.values())
        return self.space.global_batch * len(stage_types) / devices


def dp_micro_cap(table: TypeTable, split: KindSplit, optimizer: str, state_shards: int = 1) -> int:
    """Largest micro-batch a data-parallel device can run: one forward and backward of m samples at once.

    With checkpointing every layer's input is kept for all m samples, and the layer being
    recomputed holds its full activations for all m as well. ``state_shards``: ZeRO-1 (``static_matrix``).
    """
    last = split.bounds[-1]
    caps = []
    for m in table.member_tables:  # a group: the micro-batch every member fits
        static = float(static_matrix(np.array(m.params[last] - m.params[0]), optimizer, 2, state_shards))
        if split.checkpointing[0]:
            per_sample = (m.inputs[last] - m.inputs[0] + m.max_act[0, last]) * m.scale
        else:
            per_sample = (m.act[last] - m.act[0]) * m.scale
        caps.append(max(1, int((m.cap_bytes - static) // per_sample)) if per_sample > 0 else 1 << 30)
    return min(caps)


def local_members(space: Space, stage_types: tuple[str, ...], replicas: int) -> tuple[int, ...]:
    """Per stage: how many of its replicas share a node (nodes hold whole same-type runs of a pipeline)."""
    out = []
    for t in stage_types:
        run = stage_types.count(t)
        out.append(max(1, min(replicas, space.topology.node(t).gpus_per_node // run)))
    return tuple(out)


@dataclass(frozen=True)
class Block:
    """The shapes that share one mixed kind (or none): every type's stage-count options, crossed.

    ``options[i]`` lists, for type ``space.order[i]``, each choice's group (``None``: the
    type unused) and the devices it leaves over; ``lower[cell]`` bounds the step of the
    shape that picks option ``cell[i]`` for every type i (``inf`` where it has no pipeline
    or more pipelines than samples).
    """

    fixed: tuple[Group, ...]
    options: tuple[tuple[tuple[Group | None, int], ...], ...]
    lower: np.ndarray

    def shape(
        self, cell: tuple[int, ...], order: Sequence[str]
    ) -> tuple[tuple[Group, ...], tuple[tuple[str, int], ...]]:
        """(groups, unused devices per type) of one cell."""
        picks = [self.options[i][o] for i, o in enumerate(cell)]
        groups = self.fixed + tuple(g for g, _ in picks if g is not None)
        mixed_types = {t for g in self.fixed for t in g.split.stage_types}
        unused = tuple((t, n) for t, (_, n) in zip(order, picks) if n)
        return groups, tuple(sorted(unused, key=lambda u: u[0] not in mixed_types))


def blocks(space: Space, kinds: Kinds, group, cutoff: float = math.inf) -> list[Block]:
    """Every shape of the plan space whose kinds fit in memory, as one block per mixed kind (or none); at
    unequal degrees, those of kinds whose ``kind_bound`` is below ``cutoff`` only."""
    out = []
    for mixed in space.fixed_kinds():
        left = dict(space.counts)
        fixed: tuple[Group, ...] = ()
        # Spaces of unequal degrees are many (one per assignment): skip splitting kinds that cannot win.
        if mixed is not None and not space.uniform and kind_bound(space, mixed) >= cutoff:
            continue
        if mixed is not None:
            types = kind_types(mixed, space.order)
            r = space.replicas(mixed)
            if kinds.get(types, r) is None:
                continue
            fixed = (group(types, r),)
            for t, c in mixed.items():
                left[t] -= r * c
        options = tuple(
            tuple(
                (group((t,) * s, left[t] // s), left[t] % s) if s else (None, left[t])
                for s in space.stage_options(t, left[t])
                if s == 0 or kinds.get((t,) * s, left[t] // s) is not None
            )
            for t in space.order
        )
        out.append(Block(fixed=fixed, options=options, lower=block_lower_bounds(space, fixed, options)))
    return out


def kind_bound(space: Space, composition: Mapping[str, int]) -> float:
    """A lower bound on the step of a mixed kind replicated alone (a shape of unequal degrees), before its split:
    its pipelines' compute at the best balance of any split, at the smallest micro-batch.

    With a_t a type's least seconds per unit of reference work W_l over layers, a stage of type t holding work
    W_s takes at least m·a_t·W_s for m samples: the pace is at least m·W / Σ_s 1/a_t and the fill at least
    m·min a_t·W. A pipeline's b samples take (b/m − 1)·pace + fill, which grows with m, and the slowest
    pipeline has at least the batch over the replicas. Measured speeds, recomputation, all-reduces, messages
    and the gradient synchronisation only add."""
    tables = [space.tables[t] for t in composition]
    work = np.diff(tables[0].flops)
    held = work > 0
    if not held.any():
        return 0.0
    per_work = {tb.gpu_type: float(np.min(np.diff(tb.flops)[held] / work[held])) * tb.seconds_per_flop for tb in tables}
    total = float(work.sum())
    harmonic = sum(c / per_work[t] for t, c in composition.items())
    m = min(space.micro_batches)
    samples = max(m, space.global_batch / space.replicas(composition))
    return (samples - m) * total / harmonic + m * min(per_work.values()) * total


def block_lower_bounds(space: Space, fixed: Sequence[Group], options) -> np.ndarray:
    """Per cell of a block: ``allocation_bound`` plus the fp32 communication, computed on the whole grid at once.

    For 1-bit optimizers (communication priced compressed) the bound is the compute bound alone; ZeRO-1's
    all-gather is left out of it (a lower bound may omit time). At ZeRO-1 a cell of one-stage kinds only
    (pure data parallelism) is not in the space: ``inf``.
    """
    dims = tuple(len(o) for o in options)

    def per_option(value, empty: float) -> list[np.ndarray]:
        arrays = []
        for axis, opts in enumerate(options):
            shape = [1] * len(dims)
            shape[axis] = dims[axis]
            arrays.append(np.array([value(g) if g is not None else empty for g, _ in opts], float).reshape(shape))
        return arrays

    def summed(value) -> np.ndarray:
        return np.broadcast_to(sum(per_option(value, 0.0), sum(value(g) for g in fixed)), dims)

    ru, rate, offset = (summed(lambda g, k=k: g.bound_terms[k]) for k in range(3))
    fill = np.broadcast_to(
        functools.reduce(
            np.maximum, per_option(lambda g: g.bound_terms[3], 0.0), max((g.bound_terms[3] for g in fixed), default=0.0)
        ),
        dims,
    )
    count = summed(lambda g: 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.maximum(fill, (space.global_batch - ru + offset) / rate)
    valid = (count > 0) & (ru <= space.global_batch)
    if space.zero_stage:
        valid &= summed(lambda g: float(g.split.stages > 1)) > 0
    if space.optimizer in ONEBIT_OPTIMIZERS:
        return np.where(valid, bound, np.inf)
    pipelines = summed(lambda g: g.replicas)
    nodes = summed(lambda g: g.nodes)
    topo = space.topology

    def nic(g: Group) -> float:
        return min(topo.node(t).nic_bandwidth_bytes_s for t in g.split.stage_types)

    bandwidth = np.broadcast_to(
        functools.reduce(np.minimum, per_option(nic, np.inf), min((nic(g) for g in fixed), default=np.inf)), dims
    )
    comm = np.zeros(dims)
    for g in fixed:
        comm = np.maximum(comm, group_comm_grid(g, topo, pipelines, nodes, bandwidth, space.wire_bytes))
    for axis, opts in enumerate(options):
        for o, (g, _) in enumerate(opts):
            if g is not None:
                at = tuple(o if a == axis else slice(None) for a in range(len(dims)))
                comm[at] = np.maximum(
                    comm[at], group_comm_grid(g, topo, pipelines[at], nodes[at], bandwidth[at], space.wire_bytes)
                )
    return np.where(valid, bound + comm, np.inf)


def group_comm_grid(g: Group, topology: Topology, pipelines, nodes, bandwidth, wire_bytes: float) -> np.ndarray:
    """``group_comm_seconds`` (fp32) on arrays of pipeline counts, node counts and inter-node bandwidths."""
    worst = np.zeros(np.shape(pipelines))
    for s, t in largest_stage_per_type(g.split):
        local = np.where(nodes == 1, pipelines, g.local[s])
        seconds = hierarchical_allreduce_seconds(
            wire_bytes * g.split.stage_params[s],
            local=local,
            nodes=nodes,
            intra=topology.intra(t),
            inter=(bandwidth, topology.inter_latency_s),
        )
        worst = np.maximum(worst, seconds)
    return worst


def make_group(space: Space, kinds: Kinds, types: tuple[str, ...], replicas: int) -> Group:
    split = kinds.get(types, replicas)
    cap = (
        dp_micro_cap(space.tables[types[0]], split, space.optimizer, space.state_shards(replicas))
        if len(types) == 1
        else split.micro
    )
    return Group(
        split=split,
        replicas=replicas,
        local=local_members(space, types, replicas),
        dp_micro_cap=cap,
        unit=split.micro if len(types) > 1 else 1,
    )


def shape_comm(space: Space, groups: Sequence[Group]) -> tuple[float, float, float]:
    """(communication priced for the optimizer, fp32 communication, ZeRO-1's all-gather) of a shape; the
    first two include the third, which follows the gradient all-reduce."""
    kw = dict(layers=space.layers, tensors=space.tensors, wire_bytes=space.wire_bytes)
    gather = zero_gather_seconds(groups, space.topology) if space.zero_stage else 0.0
    fp32 = comm_seconds(groups, space.topology, compressed=False, **kw) + gather
    if space.optimizer in ONEBIT_OPTIMIZERS:
        return comm_seconds(groups, space.topology, compressed=True, **kw) + gather, fp32, gather
    return fp32, fp32, gather


def build_space(
    rank_types: Sequence[str],
    catalog: Catalog,
    footprint: Footprint,
    *,
    global_batch: int,
    topology: Topology,
    optimizer: str,
    precision: str,
    efficiency: float,
    schedule: str,
    max_stages: int,
    micro_batches: Sequence[int],
    seconds_per_sample: SecondsPerSample | None,
    reduce_dtype: str = "fp32",
    tp_degrees: Mapping[str, int] | None = None,
    zero_stage: int = 0,
) -> Space | None:
    """Validate the inputs and tabulate the layer costs of every type of ``tp_degrees`` (default: every type
    at degree 1): where its degree d > 1, those of a member of a group of d devices of the type on one node.
    Types without a degree are left out of the space. ``None`` when no type forms such a group, or, at
    unequal degrees, when one type forms none (the space's one kind needs every type)."""
    if zero_stage not in (0, 1):
        raise ValueError(
            "zero_stage: the placement search shards Adam's state within pipeline stages (1) or not (0); "
            f"stages 2 and 3 shard data parallelism only (got {zero_stage})"
        )
    if zero_stage and optimizer in ONEBIT_OPTIMIZERS:
        raise ValueError(
            f"zero_stage: ZeRO-1 is not planned with the 1-bit optimizer {optimizer}; use optimizer adam or "
            "zero_stage 0"
        )
    if global_batch < 1:
        raise ValueError(f"global_batch: must be >= 1 (got {global_batch})")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule: unknown schedule {schedule!r}{did_you_mean(schedule, SCHEDULES)}; use one of {', '.join(SCHEDULES)}"
        )
    if max_stages < 1:
        raise ValueError(f"max_stages: must be >= 1 (got {max_stages})")
    if not rank_types:
        raise ValueError("devices: no devices to plan for; give at least one GPU")
    devices = dict(Counter(rank_types))
    layers = workload_layers(footprint)
    for t in devices:
        topology.node(t)
    tp_degrees = dict(tp_degrees) if tp_degrees is not None else dict.fromkeys(devices, 1)
    if set(tp_degrees) - set(devices):
        raise ValueError(f"tp_degrees: no devices of {', '.join(sorted(set(tp_degrees) - set(devices)))}")
    counts = {
        t: devices[t] // d for t, d in tp_degrees.items() if devices[t] >= d and topology.node(t).gpus_per_node >= d
    }
    if not counts or (not is_uniform(tp_degrees) and len(counts) < len(tp_degrees)):
        return None
    kw = dict(
        precision=precision,
        efficiency=efficiency,
        seconds_per_sample=seconds_per_sample,
        dp_share=global_batch / sum(counts.values()),  # Space.dp_share
    )
    tables = {
        t: group_table(t, group_members(t), catalog, layers, tp_link=topology.intra(t), **kw)
        if is_group(t)
        else type_table(t, catalog, layers, tp_degree=tp_degrees[t], tp_link=topology.intra(t), **kw)
        for t in counts
    }
    topology = grouped_topology(topology, tp_degrees)
    order = tuple(sorted(counts, key=lambda t: (-tables[t].cap_bytes, tables[t].seconds_per_flop, t)))
    return Space(
        counts=counts,
        devices=devices,
        tp_degrees=tp_degrees,
        order=order,
        tables=tables,
        topology=topology,
        global_batch=global_batch,
        schedule=schedule,
        optimizer=optimizer,
        max_stages=max_stages,
        micro_batches=tuple(sorted(set(micro_batches))),
        layers=len(layers),
        tensors=len(footprint.param_numels) or len(layers),
        wire_bytes=WIRE_BYTES[reduce_dtype],
        zero_stage=zero_stage,
    )


def grouped_topology(topology: Topology, degrees: Mapping[str, int]) -> Topology:
    """The topology seen by tensor-parallel groups of ``degrees[t]`` devices of each type t (1 where it has
    none): its node holds that many times fewer, and the members' messages and all-reduces (one per shard)
    share the node's NIC."""
    if all(d == 1 for d in degrees.values()):
        return topology
    return Topology(
        nodes={
            t: replace(n, gpus_per_node=n.gpus_per_node // d, nic_bandwidth_bytes_s=n.nic_bandwidth_bytes_s / d)
            for t, n in topology.nodes.items()
            if n.gpus_per_node >= (d := degrees.get(t, 1))
        },
        inter_latency_s=topology.inter_latency_s,
        mixed=topology.mixed,
    )


def plan(
    rank_types: Sequence[str],
    catalog: Catalog,
    footprint: Footprint,
    *,
    global_batch: int,
    topology: Topology,
    optimizer: str = "adam",
    precision: str = "auto",
    efficiency: float = 0.4,
    emulated: bool = False,
    schedule: str = "1f1b",
    max_stages: int = 8,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    seconds_per_sample: SecondsPerSample | None = None,
    reduce_dtype: str = "fp32",
    tensor_parallel: Sequence[int] = (1,),
    top_k: int = 5,
    zero_stage: int = 0,
) -> list[Plan] | Infeasible:
    """The ``top_k`` best plans for workers of ``rank_types`` (one GPU type per worker), best first.

    ``topology`` places the workers on nodes and prices links; ``optimizer``
    (``adam``, ``onebit_adam``, ``zero_one_adam``) sizes optimizer state and, for
    the 1-bit ones, prices the compressed phase; ``seconds_per_sample`` overrides
    the FLOPs-based speed of a type with a measured one; ``reduce_dtype`` prices the gradients on the wire
    (``train.reduce_dtype``); ``tensor_parallel``: the degrees tried, each type's stages groups of its degree's
    devices on one node: every degree for all types alike, and every assignment of unequal degrees to two or
    more types, whose plans are one mixed kind of those types replicated (every pipeline holding a layer
    splits it alike). ``zero_stage`` 1: ZeRO-1 inside pipelines, each
    stage's Adam state sharded evenly over the replicas of its kind and the updated parameters all-gathered
    among them after the step; only plans with at least one pipeline of two or more stages are returned
    (pure data parallelism at ZeRO-1 is ``plan_data_parallel``'s), with adam only, and tensor-parallel
    degrees above 1 are not searched (degree 1 only, whatever ``tensor_parallel`` lists). Raises ``ValueError``
    (one line) on bad input; returns ``Infeasible`` when no plan of the space fits.
    """
    if not tensor_parallel or any(d < 1 or d & (d - 1) for d in tensor_parallel):
        raise ValueError(f"tensor_parallel: degrees must be powers of two (got {list(tensor_parallel)})")
    spaces = searched_spaces(rank_types, topology, searched_degrees(tensor_parallel, zero_stage), max_stages)
    assignments = [degrees for *_, degrees in spaces]
    found = []
    reasons = []
    kth = math.inf  # the k-th best step found so far
    for index, (types, topo, degrees) in enumerate(spaces):
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
            seconds_per_sample=seconds_per_sample,
            reduce_dtype=reduce_dtype,
            tp_degrees=degrees,
            zero_stage=zero_stage,
        )
        if space is None or not space.fixed_kinds():
            continue
        best = search_space(space, top_k, cutoff=kth)
        if isinstance(best, str):
            reasons.append(best)
        else:
            found += [(step, index, space, shape, alloc, fits) for step, shape, alloc, fits in best]
            if len(found) >= top_k:
                kth = sorted(f[0] for f in found)[top_k - 1]
    if not found:
        return Infeasible(reasons[0])
    # Imported here: explain builds on this module's types.
    from hetero_ray.plan.explain import build_plan

    found.sort(key=lambda f: (f[0], f[1]))
    chosen = found[:top_k]
    plans = [
        build_plan(space, shape, alloc, emulated=emulated, fits_alone=fits)
        for _, _, space, shape, alloc, fits in chosen
    ]
    if len(assignments) == 1:
        return plans
    # Why the degrees: the best plan of each other assignment tried, against this one. Unequal assignments
    # count within the top_k only: those pruned by their bound are slower than all of it.
    best = {}
    for step, index, space, *_ in found:
        if space.uniform or step <= chosen[-1][0]:
            best.setdefault(index, step)
    return [
        replace(p, explanation=p.explanation + "; " + tp_comparison(index, p.predicted_step_s, best, assignments))
        for p, (_, index, *_) in zip(plans, chosen)
    ]


def searched_degrees(tensor_parallel: Sequence[int], zero_stage: int) -> list[int]:
    """The tensor-parallel degrees planned, in order: degree 1 alone at ZeRO-1, whose sharding of a stage's
    state among tensor-parallel members is not modelled."""
    return [1] if zero_stage else sorted(set(tensor_parallel))


def searched_spaces(
    rank_types: Sequence[str], topology: Topology, degrees: Sequence[int], max_stages: int = 8
) -> list[tuple[tuple[str, ...], Topology, dict[str, int]]]:
    """Every space searched, as (worker types, topology, degree per type). A tensor-parallel group that is not
    all of its type's devices at one degree is a type of its own there (``group_name``, of degree its size),
    planned as one kind replicated alone (``Space.fixed_kinds``):
    - each of ``degree_assignments`` on the devices as they are;
    - per node kind of ``topology.mixed`` whose size is at most the largest degree: its devices grouped across
      types, one group per node, alone or beside one other type's devices one by one (where 1 is a degree);
    - where 1 is a degree, per type and degree d > 1 its nodes hold: groups of d of its devices beside its
      single devices, so that one pipeline's stages of one type may differ in degree; as many groups as the
      kind of a stages in groups and b alone (powers of two, a + b <= ``max_stages``) replicates most often,
      the rest alone."""
    types = tuple(rank_types)
    out = [(types, topology, d) for d in degree_assignments(sorted(set(types)), degrees)]
    have = Counter(types)

    def grouped(groups: int, members: Sequence[str], node: NodeKind) -> tuple[tuple[str, ...], Topology, str]:
        name = group_name(members)
        left = have - Counter({t: c * groups for t, c in Counter(members).items()})
        topo = replace(topology, nodes={**topology.nodes, name: replace(node, gpu_type=name)})
        return tuple(left.elements()) + (name,) * (len(members) * groups), topo, name

    for m in topology.mixed:
        size = len(m.gpu_types)
        groups = min(m.nodes, *(have[t] // c for t, c in Counter(m.gpu_types).items()))
        if groups < 1 or size > max(degrees):
            continue
        spaced, topo, name = grouped(groups, m.gpu_types, m.node())
        others = sorted(set(spaced) - {name}) if 1 in degrees else []
        out += [(spaced, topo, {name: size})] + [(spaced, topo, {name: size, t: 1}) for t in others]
    stages = powers_of_two(max_stages)
    for t in sorted(have) if 1 in degrees else ():
        node = topology.node(t)
        for d in degrees:
            if d == 1 or node.gpus_per_node < d:
                continue
            # A node of g GPUs holds g // d groups: their node kind, as the grouped topology divides it.
            group_node = replace(node, gpus_per_node=node.gpus_per_node // d * d)
            counts = {a * (have[t] // (a * d + b)) for a in stages for b in stages if a + b <= max_stages}
            for groups in sorted(c for c in counts if 0 < c * d < have[t]):
                spaced, topo, name = grouped(groups, (t,) * d, group_node)
                out.append((spaced, topo, {name: d, t: 1}))
    return out


def degree_assignments(types: Sequence[str], degrees: Sequence[int]) -> list[dict[str, int]]:
    """The tensor-parallel degree of each type, one mapping per space searched: every degree for all
    ``types`` alike (in order), then every assignment of unequal degrees to each subset of two or more
    types (a space of unequal degrees plans its own types only: one of a subset is another space's)."""
    out = [dict.fromkeys(types, d) for d in degrees]
    for k in range(2, len(types) + 1):
        for subset in itertools.combinations(types, k):
            out += [dict(zip(subset, ds)) for ds in itertools.product(degrees, repeat=k) if len(set(ds)) > 1]
    return out


def degrees_name(degrees: Mapping[str, int]) -> str:
    """An assignment in words: ``degree 2`` when every type has it, else ``degree 2 on V100-16GB and 1 on
    A100-80GB`` (largest first, as ``Plan.tensor_parallel``); a group of one type's devices planned beside
    its single ones reads ``2 on groups of 2 × A100-80GB``."""
    if is_uniform(degrees):
        return f"degree {next(iter(degrees.values()))}"

    def label(t: str) -> str:
        members = group_members(t)
        return f"groups of {len(members)} × {members[0]}" if len(set(members)) == 1 < len(members) else t

    ordered = sorted(degrees.items(), key=lambda td: (-td[1], td[0]))
    return "degree " + " and ".join(f"{d} on {label(t)}" for t, d in ordered)


def tp_comparison(chosen: int, step: float, best: Mapping[int, float], tried: Sequence[Mapping[str, int]]) -> str:
    """One clause: the plan of assignment ``tried[chosen]`` (``step`` seconds) against the best plan of every
    other uniform degree tried and the best plan of any other assignment of unequal degrees (``best``: the
    best step by index in ``tried``: every uniform degree's where one fits, unequal ones' among the top plans
    only, so that any other is no faster than ``step``)."""
    uniform = [i for i, a in enumerate(tried) if is_uniform(a)]
    others = [
        f"{best[i] * 1e3:.4g} ms at {degrees_name(tried[i])}" if i in best else f"none fits at {degrees_name(tried[i])}"
        for i in uniform
        if i != chosen
    ]
    unequal = [i for i in best if i not in uniform and i != chosen]
    if unequal:
        i = min(unequal, key=best.__getitem__)
        others.append(f"{best[i] * 1e3:.4g} ms at {degrees_name(tried[i])} (the best other per-type degrees)")
    elif chosen in uniform and len(tried) > len(uniform):
        others.append("none faster at unequal degrees per type")
    return f"tensor-parallel {degrees_name(tried[chosen])} ({step * 1e3:.4g} ms) against " + ", ".join(others)


def search_space(
    space: Space, top_k: int, cutoff: float = math.inf
) -> list[tuple[float, Shape, Allocation, frozenset[str]]] | str:
    """The ``top_k`` best (step, shape, allocation, the types some single-type pipeline fits) of one space,
    best first; or one line saying why none fits. At unequal degrees, kinds whose ``kind_bound`` reaches
    ``cutoff`` (the k-th best step of other spaces) are not split: they have no plan among the top_k."""
    kinds = Kinds(space)
    made: dict[tuple[tuple[str, ...], int], Group] = {}

    def group(types: tuple[str, ...], replicas: int) -> Group:
        if (types, replicas) not in made:
            made[types, replicas] = make_group(space, kinds, types, replicas)
        return made[types, replicas]

    space_blocks = blocks(space, kinds, group, cutoff)
    lower = np.concatenate([b.lower.ravel() for b in space_blocks]) if space_blocks else np.empty(0)
    owner = np.concatenate([np.full(b.lower.size, i) for i, b in enumerate(space_blocks)]) if space_blocks else lower
    start = np.concatenate([[0], np.cumsum([b.lower.size for b in space_blocks])])
    if not np.isfinite(lower).any():
        return infeasible_reason(space)
    # Branch and bound, no shape missed: shapes in order of their lower bound (the continuous
    # batch split plus the exact communication); the walk stops when the bound passes the k-th best.
    best: list[tuple[float, int, Shape, Allocation]] = []  # max-heap of the top_k by step time
    for i in np.argsort(lower, kind="stable"):
        kth = -best[0][0] if len(best) == top_k else math.inf
        if lower[i] >= kth:
            break
        b = space_blocks[owner[i]]
        gs, unused = b.shape(np.unravel_index(i - start[owner[i]], b.lower.shape), space.order)
        comm, fp32, gather = shape_comm(space, gs)
        bound = allocation_bound(space.global_batch, gs) + comm
        if bound >= kth:
            continue
        alloc = allocate(space.global_batch, gs)
        if alloc is None:
            continue
        step = alloc.seconds + comm
        shape = Shape(groups=gs, excluded=unused, comm_s=comm, comm_fp32_s=fp32, bound=bound, zero_gather_s=gather)
        if len(best) < top_k:
            heapq.heappush(best, (-step, -int(i), shape, alloc))
        elif step < kth:
            heapq.heapreplace(best, (-step, -int(i), shape, alloc))
    if not best:
        return (
            f"global batch {space.global_batch} cannot be split over any plan's pipelines in whole micro-batches; "
            f"use a larger global batch (a multiple of {max(space.micro_batches)})"
        )
    fits_alone = frozenset(
        t
        for t in space.order
        if any(kinds.get((t,) * s, space.counts[t] // s) for s in space.stage_options(t, space.counts[t])[1:])
    )
    return [(-step, shape, alloc, fits_alone) for step, _, shape, alloc in sorted(best, key=lambda b: (-b[0], -b[1]))]


def infeasible_reason(space: Space) -> str:
    """One line: the smallest memory shortfall over the space's kinds (at ZeRO-1, each replicated as often as
    the devices allow), or why the batch cannot be split."""
    kinds = [((t,) * s, space.counts[t] // s) for t in space.order for s in space.stage_options(t, space.counts[t])[1:]]
    kinds += [(kind_types(c, space.order), space.replicas(c)) for c in space.mixed_compositions()]
    if space.zero_stage:
        kinds = [(types, r) for types, r in kinds if len(types) > 1]
        if not kinds:
            return (
                f"zero_stage 1 shards Adam's state within pipelines of 2 or more stages, and these devices form "
                f"none (max_stages is {space.max_stages}); plan data parallelism at ZeRO-1 with the data-parallel "
                "planner, or use zero_stage 0"
            )
    short, gpu_type, need, types, r = min(
        (*min_shortfall(types, space.tables, space.optimizer, space.state_shards(r)), types, r) for types, r in kinds
    )
    if short > 0:
        cap = space.tables[gpu_type].cap_bytes
        layout = ", ".join(f"{types.count(t)} × {t}" for t in dict.fromkeys(types))
        sharded = f", Adam's state over {r} replicas" if space.zero_stage else ""
        return (
            f"model needs {need / GiB:.3g} GiB per device at micro-batch 1 in the closest plan "
            f"({len(types)} pipeline stage{'s' * (len(types) > 1)}: {layout}, activation checkpointing{sharded}); "
            f"its {gpu_type} has {cap / GiB:g} GiB; add devices with more memory or allow more stages "
            f"(max_stages is {space.max_stages})"
        )
    return (
        f"global batch {space.global_batch} is smaller than the pipelines of every plan that fits "
        "(each needs at least one micro-batch); use a larger global batch"
    )
