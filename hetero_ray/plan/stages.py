"""Pipeline kinds: an ordered list of stage GPU types, its best layer split, and its cost per micro-batch.

A *kind* is one pipeline shape (``("A100-80GB", "V100-16GB", "V100-16GB")``)
replicated for data parallelism. Its split of the L layers into contiguous
stages minimises the slowest stage's time per micro-batch (what paces the
pipeline), ties broken by the sum of stage times (the fill and drain), subject
to every stage fitting its device's memory. Each stage takes activation
checkpointing only when it does not fit without (checkpointing only costs time).
Under ZeRO-1 a stage's Adam state is sharded over the replicas of its kind
(``state_shards``), so a kind's split depends on how many replicas it has.

The split is a dynamic programme over (stage, last layer): O(S · L²) work per
kind, done as S numpy reductions over L × L cost matrices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from hetero_ray.cluster.catalog import Catalog, GpuSpec
from hetero_ray.config import ONEBIT_OPTIMIZERS
from hetero_ray.perf.footprint import Footprint, LayerCost
from hetero_ray.plan.cost import (
    RECOMPUTE_FACTOR,
    TP_ALLREDUCES,
    TP_ALLREDUCES_CHECKPOINTED,
    activation_scale,
    tp_allreduce_seconds,
)
from hetero_ray.plan.memory import ADAM_STATE_BYTES, WEIGHT_AND_GRAD_BYTES, in_flight
from hetero_ray.train.precision import choose_precision


@dataclass(frozen=True)
class MeasuredSpeeds:
    """A profile's speeds: seconds per sample of a whole-model step by (GPU type, precision, micro-batch; None: a
    data-parallel worker's even share of the batch), and the fixed part of a step's time by (type, precision),
    which does not grow with the batch (the host's work: Python, launches, the loss, the optimizer).

    A pipeline stage pays that fixed part in full on every micro-batch, not its share of the layers' part of
    it: the host work of a pass through a stage (dispatch, the loss, the schedule, the sends) does not shrink
    with the layers it holds. Measured on throttled devices, a stage spent 2 ms of CPU time per micro-batch
    outside its layers, about as much as the whole model's pass.
    """

    per_sample: Callable[[str, str, int | None], float | None]
    fixed_seconds: Callable[[str, str], float]
    straggler: float = 1.0
    """The factor both already include for the slowest of the workers (``PerfModel.straggler_factor``)."""

    def __call__(self, gpu_type: str, precision: str, micro_batch: int | None) -> float | None:
        return self.per_sample(gpu_type, precision, micro_batch)


# Measured seconds per sample (forward + backward of the whole model) by (GPU type, precision), e.g. from the
# profiler's history; overrides FLOPs ÷ (peak × efficiency) where it answers. A callable takes a third
# argument, the micro-batch (None: a data-parallel worker's even share of the batch): a fixed cost per forward
# and backward (Python, kernel launches) makes small micro-batches dearer per sample, and a pipeline pays it
# on every micro-batch.
SecondsPerSample = MeasuredSpeeds | Callable[[str, str, int | None], float | None] | Mapping[str, float]
# (bandwidth bytes/s, latency s)
Link = tuple[float, float]


def workload_layers(footprint: Footprint) -> tuple[LayerCost, ...]:
    """The footprint's layers, or the whole model as one layer when it cannot be cut."""
    if footprint.layers:
        return footprint.layers
    return (
        LayerCost(
            params=footprint.param_count,
            flops_per_sample=footprint.flops_per_sample,
            activation_bytes_per_sample=footprint.activation_bytes_per_sample,
            output_bytes_per_sample=0.0,
        ),
    )


@dataclass(frozen=True, eq=False)
class TypeTable:
    """Prefix sums over layers for one GPU type at its precision: the inputs of every stage cost."""

    gpu_type: str
    precision: str
    scale: float  # saved activations and messages shrink in half precision
    seconds_per_flop: float
    cap_bytes: float
    # Measured seconds per sample at a micro-batch, for pipeline stages; None: seconds_per_flop at every size.
    per_sample_at: Callable[[int], float | None] | None
    fixed_s: float  # a step's measured fixed time, which every stage pays per micro-batch (0: none measured)
    flops: np.ndarray  # prefix sums, length L + 1
    model_flops: float  # the whole model's (unsplit): what a measured speed is a rate of
    # Tensor parallelism over ``tp_degree`` devices: every cost above is one member's; its all-reduces cost
    # ``tp_per_sample`` × micro-batch + ``tp_per_micro`` per micro-batch (prefix sums; zeros at degree 1).
    tp_per_sample: np.ndarray
    tp_per_micro: np.ndarray
    # A one-stage (data-parallel) member, per sample: its whole share one micro-batch (``tp_allreduce_seconds``).
    tp_per_share: np.ndarray
    act: np.ndarray
    inputs: np.ndarray  # input bytes of each layer (the previous layer's output), prefix sums
    params: np.ndarray
    out: np.ndarray  # output bytes per sample after layer l, length L
    max_act: np.ndarray  # max_act[i, j]: largest layer activation in [i, j)
    # A tensor-parallel group planned as a type of its own (``group_table``: across GPU types, or some of one
    # type's devices): one table per member, each at its part of the split layers (``weights``, summing to 1).
    # The fields above are then the slowest member's, whose time is the group's (the split is by speed) and a
    # lower bound where a bound is wanted; memory is per member.
    members: tuple[TypeTable, ...] = ()
    weights: tuple[float, ...] = ()

    @property
    def member_tables(self) -> tuple[TypeTable, ...]:
        """The tables memory is checked on: each member's of a group, else this one."""
        return self.members or (self,)

    def held_params(self, i: int, j: int) -> int:
        """Parameters of layers [i, j) on the member holding most of them: what its gradient sum carries."""
        return int(max(m.params[j] - m.params[i] for m in self.member_tables))


def measured_seconds(seconds_per_sample: SecondsPerSample | None, gpu_type: str, precision: str) -> float | None:
    """A data-parallel worker's measured seconds per sample of the whole model, where ``seconds_per_sample``
    answers for the type."""
    if callable(seconds_per_sample):
        return seconds_per_sample(gpu_type, precision, None)
    return seconds_per_sample.get(gpu_type) if seconds_per_sample is not None else None


def type_table(
    gpu_type: str,
    catalog: Catalog,
    layers: tuple[LayerCost, ...],
    *,
    precision: str,
    efficiency: float,
    seconds_per_sample: SecondsPerSample | None,
    tp_degree: int = 1,
    tp_link: Link | None = None,
    dp_share: float = 1.0,
    held: float | None = None,
) -> TypeTable:
    """Per-layer costs of ``layers`` on ``gpu_type``, as prefix sums: one device's, or one member's of a
    tensor-parallel group of ``tp_degree`` devices, whose all-reduces cross ``tp_link``, holding ``held`` of each
    split layer (default an even share)."""
    spec = catalog.get(gpu_type)
    prec = choose_precision(spec, precision)
    total_flops = sum(c.flops_per_sample for c in layers)
    scale = activation_scale(prec)
    tp_per_sample = np.zeros(len(layers))
    tp_per_micro = np.zeros(len(layers))
    tp_per_share = np.zeros(len(layers))
    if tp_degree > 1:
        for k, c in enumerate(layers):
            if c.splittable:  # seconds(m) = a·m + b: bandwidth per sample, latency per micro-batch
                out = c.output_bytes_per_sample * scale
                tp_per_sample[k] = tp_allreduce_seconds(out, 1, tp_degree, tp_link, batches=0.0)
                tp_per_micro[k] = tp_allreduce_seconds(0.0, 0, tp_degree, tp_link)
                tp_per_share[k] = tp_allreduce_seconds(out, 1, tp_degree, tp_link, batches=1 / dp_share)
        layers = tuple(c.part(held or 1 / tp_degree) for c in layers)
    measured, per_sample_at, fixed_s = measured_seconds(seconds_per_sample, gpu_type, prec), None, 0.0
    if measured and callable(seconds_per_sample):
        per_sample_at = functools.partial(seconds_per_sample, gpu_type, prec)
        if isinstance(seconds_per_sample, MeasuredSpeeds):
            fixed_s = seconds_per_sample.fixed_seconds(gpu_type, prec)
    spf = seconds_per_flop(spec, measured, total_flops, prec, efficiency)
    act = np.array([c.activation_bytes_per_sample for c in layers], dtype=float)
    out = np.array([c.output_bytes_per_sample for c in layers], dtype=float)
    n = len(layers)
    max_act = np.zeros((n + 1, n + 1))
    for i in range(n):
        max_act[i, i + 1 :] = np.maximum.accumulate(act[i:])
    return TypeTable(
        gpu_type=gpu_type,
        precision=prec,
        scale=scale,
        seconds_per_flop=spf,
        per_sample_at=per_sample_at,
        fixed_s=fixed_s,
        cap_bytes=float(spec.memory_bytes),
        flops=np.concatenate([[0.0], np.cumsum([c.flops_per_sample for c in layers])]),
        model_flops=total_flops,
        tp_per_sample=np.concatenate([[0.0], np.cumsum(tp_per_sample)]),
        tp_per_micro=np.concatenate([[0.0], np.cumsum(tp_per_micro)]),
        tp_per_share=np.concatenate([[0.0], np.cumsum(tp_per_share)]),
        act=np.concatenate([[0.0], np.cumsum(act)]),
        inputs=np.concatenate([[0.0], np.cumsum(np.concatenate([[0.0], out[:-1]]))]),
        params=np.concatenate([[0.0], np.cumsum([float(c.params) for c in layers])]),
        out=out,
        max_act=max_act,
    )


def seconds_per_flop(
    spec: GpuSpec, measured: float | None, model_flops: float, precision: str, efficiency: float
) -> float:
    """One device's seconds per FLOP of the whole model at ``precision``: its ``measured`` seconds per sample
    (``measured_seconds``) where the profile has them, else ``spec``'s catalog peak at ``efficiency``. The same
    for any part of a split layer."""
    return measured / model_flops if measured else 1.0 / (spec.peak_flops(precision) * efficiency)


def group_precision(specs, precision: str | Mapping[str, str]) -> str:
    """The one precision a tensor-parallel group computes in (its members' all-reduces add partial sums of one
    dtype): the slowest member's choice (it paces the group) where every member runs it, else fp32."""
    slowest = min(specs, key=lambda spec: spec.peak_flops(choose_precision(spec, precision)))
    prec = choose_precision(slowest, precision)
    return prec if all(spec.precision_problem(prec) is None for spec in specs) else "fp32"


def group_table(
    name: str,
    gpu_types: tuple[str, ...],
    catalog: Catalog,
    layers: tuple[LayerCost, ...],
    *,
    precision: str | Mapping[str, str],
    efficiency: float,
    seconds_per_sample: SecondsPerSample | None,
    tp_link: Link,
    dp_share: float = 1.0,
) -> TypeTable:
    """One member's table per device of a tensor-parallel group of one device of each of ``gpu_types`` (a type
    may repeat) on one node, the split layers cut in proportion to each member's speed at the group's precision
    (Megatron's split, uneven across types), so that every member computes its part in the same time and the
    slowest member's time is the group's."""
    prec = group_precision([catalog.get(t) for t in gpu_types], precision)
    model_flops = sum(c.flops_per_sample for c in layers)
    speeds = [
        1.0
        / seconds_per_flop(catalog.get(t), measured_seconds(seconds_per_sample, t, prec), model_flops, prec, efficiency)
        for t in gpu_types
    ]
    weights = tuple(v / sum(speeds) for v in speeds)
    members = tuple(
        type_table(
            t,
            catalog,
            layers,
            precision=prec,
            efficiency=efficiency,
            seconds_per_sample=seconds_per_sample,
            tp_degree=len(gpu_types),
            tp_link=tp_link,
            dp_share=dp_share,
            held=w,
        )
        for t, w in zip(gpu_types, weights)
    )
    slowest = max(members, key=lambda tb: tb.seconds_per_flop)
    return replace(
        slowest,
        gpu_type=name,
        cap_bytes=sum(tb.cap_bytes for tb in members),
        fixed_s=max(tb.fixed_s for tb in members),
        members=members,
        weights=weights,
    )


def static_matrix(params: np.ndarray, optimizer: str, world: int, state_shards: int = 1) -> np.ndarray:
    """``memory.static_bytes`` for every range's parameter count (vectorised), ``state_shards`` as there."""
    total = params * (WEIGHT_AND_GRAD_BYTES + ADAM_STATE_BYTES / state_shards)
    if optimizer in ONEBIT_OPTIMIZERS:
        w = max(world, 1)
        multiple = w * math.lcm(w, 8)
        padded = np.ceil(params / multiple) * multiple
        total = total + 4 * padded + 4 * np.floor(padded / w)
    return total


@dataclass(frozen=True)
class StageCost:
    """Time per micro-batch (inf where it does not fit) and the checkpointing choice of every layer range."""

    seconds: np.ndarray  # [i, j], compute plus stage-to-stage messages
    compute: np.ndarray  # [i, j], compute only
    checkpointing: np.ndarray  # [i, j] bool
    shortfall: np.ndarray  # [i, j], bytes over the cap with checkpointing (<= 0 fits)


def _member_work(
    table: TypeTable, *, micro: int, flight: int, optimizer: str, world: int, staged: bool, state_shards: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One device's (compute, tensor-parallel all-reduces, memory without and with checkpointing) of every
    layer range [i, j)."""
    p = table.params[None, :] - table.params[:, None]
    static = static_matrix(p, optimizer, world, state_shards)
    act = (table.act[None, :] - table.act[:, None]) * table.scale * flight * micro
    kept = (table.inputs[None, :] - table.inputs[:, None]) * flight * micro + micro * table.max_act
    spf = table.seconds_per_flop
    flops = table.flops[None, :] - table.flops[:, None]
    fixed = 0.0
    if staged and table.per_sample_at is not None:
        # A stage pays its share of the measured step at its micro-batch, but is never priced below a
        # data-parallel worker's rate: the caches a small micro-batch uses better (measured on CPUs) made
        # throttled pipelines look cheaper than the data parallelism they displaced, and ran slower. On top,
        # the step's fixed part in full (``MeasuredSpeeds``), not only its share of the layers.
        spf = max(spf, (table.per_sample_at(micro) or 0.0) / table.model_flops)
        fixed = (1.0 - flops / table.flops[-1]) * table.fixed_s
    compute = flops * spf * micro + fixed
    if staged:
        tp = (table.tp_per_sample[None, :] - table.tp_per_sample[:, None]) * micro + (
            table.tp_per_micro[None, :] - table.tp_per_micro[:, None]
        )
    else:
        tp = table.tp_per_share[None, :] - table.tp_per_share[:, None]
    return compute, tp, static + act, static + kept * table.scale


@functools.lru_cache(maxsize=4096)
def stage_work(
    table: TypeTable, *, micro: int, flight: int, optimizer: str, world: int, staged: bool, state_shards: int = 1
) -> StageCost:
    """Compute, memory fit and checkpointing of layers [i, j) on ``table``'s type, messages aside.

    ``staged``: one stage of several, priced at the measured speed of ``micro``-sample micro-batches where the
    table has one (a one-stage kind is priced per sample, at the data-parallel rate). ``state_shards``: the
    replicas Adam's state is sharded over (``static_matrix``). A group across types fits where every member
    fits its own memory, checkpoints where any member must (the recomputed forward repeats the group's
    all-reduces, so all members recompute), and takes its slowest member's time."""
    n = len(table.out)
    idx = np.arange(n + 1)
    valid = idx[None, :] > idx[:, None]
    plain, ckpt_fits = valid, valid
    works = []
    for member in table.member_tables:
        compute, tp, mem_plain, mem_ckpt = _member_work(
            member,
            micro=micro,
            flight=flight,
            optimizer=optimizer,
            world=world,
            staged=staged,
            state_shards=state_shards,
        )
        plain = plain & (mem_plain <= member.cap_bytes)
        ckpt_fits = ckpt_fits & (mem_ckpt <= member.cap_bytes)
        works.append((compute, tp, mem_ckpt - member.cap_bytes))
    ckpt = ~plain & ckpt_fits
    compute = functools.reduce(
        np.maximum,
        (
            np.where(ckpt, c * RECOMPUTE_FACTOR, c)
            + np.where(ckpt, tp * (TP_ALLREDUCES_CHECKPOINTED / TP_ALLREDUCES), tp)
            for c, tp, _ in works
        ),
    )
    return StageCost(
        seconds=np.where(plain | ckpt, compute, np.inf),
        compute=compute,
        checkpointing=ckpt,
        shortfall=np.where(valid, functools.reduce(np.maximum, (short for *_, short in works)), np.inf),
    )


def stage_cost(
    table: TypeTable,
    *,
    micro: int,
    flight: int,
    optimizer: str,
    world: int,
    link_in: Link | None,
    link_out: Link | None,
    staged: bool = False,
    state_shards: int = 1,
) -> StageCost:
    """Cost of holding layers [i, j) as one stage of ``table``'s type, for every (i, j).

    Messages: the backward sends the input's gradient to the previous stage, the
    forward sends the output to the next one; each is priced on the sending stage.
    ``state_shards``: the replicas Adam's state is sharded over (``static_matrix``).
    """
    work = stage_work(
        table, micro=micro, flight=flight, optimizer=optimizer, world=world, staged=staged, state_shards=state_shards
    )
    if link_in is None and link_out is None:
        return work
    out = np.concatenate([[0.0], table.out])  # output bytes of layer k-1, for a boundary at k
    seconds = work.seconds
    if link_in is not None:
        seconds = seconds + (micro * out * table.scale / link_in[0] + link_in[1])[:, None]
    if link_out is not None:
        seconds = seconds + (micro * out * table.scale / link_out[0] + link_out[1])[None, :]
    return StageCost(seconds=seconds, compute=work.compute, checkpointing=work.checkpointing, shortfall=work.shortfall)


def min_max_split(costs: list[np.ndarray]) -> tuple[int, ...] | None:
    """Boundaries 0 = b0 < b1 < ... < bS = L minimising max_s costs[s][b_s, b_s+1], ties by the sum.

    ``None`` when every split has an infinite stage.
    """
    n = costs[0].shape[0] - 1
    worst = costs[0][0, :].copy()
    total = worst.copy()
    back = []
    for c in costs[1:]:
        vals = np.maximum(worst[:, None], c)
        best = vals.min(axis=0)
        tie = vals <= best[None, :] * (1 + 1e-12)
        sums = np.where(tie, total[:, None] + c, np.inf)
        arg = sums.argmin(axis=0)
        back.append(arg)
        worst, total = best, sums[arg, np.arange(n + 1)]
    if not np.isfinite(worst[n]):
        return None
    bounds = [n]
    for arg in reversed(back):
        bounds.append(int(arg[bounds[-1]]))
    bounds.append(0)
    return tuple(reversed(bounds))


@dataclass(frozen=True, eq=False)
class KindSplit:
    """The best split of one pipeline kind at one micro-batch size."""

    stage_types: tuple[str, ...]
    micro: int
    bounds: tuple[int, ...]
    checkpointing: tuple[bool, ...]
    stage_seconds: tuple[float, ...]  # per micro-batch, with messages
    compute_seconds: tuple[float, ...]  # per micro-batch, compute only
    stage_params: tuple[int, ...]
    max_micro_batches: int | None  # GPipe: all micro-batches stay in flight, memory caps their count

    @property
    def stages(self) -> int:
        return len(self.stage_types)

    @property
    def pace(self) -> float:
        """X: seconds per micro-batch of the slowest stage."""
        return max(self.stage_seconds)

    @property
    def fill(self) -> float:
        """Y: seconds of one micro-batch through every stage."""
        return sum(self.stage_seconds)


def stage_links(stage_types: tuple[str, ...], intra: Mapping[str, Link], inter: Link, gpus_per_node) -> list:
    """Link of each stage boundary: within a node when both sides are one run of a type that fits a node."""
    runs: list[int] = []  # length of the same-type run each stage belongs to
    s = 0
    while s < len(stage_types):
        e = s
        while e < len(stage_types) and stage_types[e] == stage_types[s]:
            e += 1
        runs += [e - s] * (e - s)
        s = e
    links = []
    for b in range(len(stage_types) - 1):
        t = stage_types[b]
        same = stage_types[b + 1] == t and runs[b] <= gpus_per_node(t)
        links.append(intra[t] if same else inter)
    return links


def split_kind(
    stage_types: tuple[str, ...],
    tables: Mapping[str, TypeTable],
    *,
    micro: int,
    schedule: str,
    optimizer: str,
    links: list[Link],
    state_shards: int = 1,
) -> KindSplit | None:
    """The best split of ``stage_types`` at micro-batch ``micro``; ``None`` if no split fits.

    Stage memory is checked at the schedule's steady state: 1F1B holds S - s
    micro-batches on stage s; GPipe is checked at one and the micro-batch count
    is then capped by what every stage can hold. 1-bit error buffers are sized for
    two replicas, their largest. ``state_shards``: ZeRO-1, each stage's Adam state split evenly over
    that many replicas of the kind (``static_matrix``).
    """
    S = len(stage_types)
    costs = []
    for s, t in enumerate(stage_types):
        flight = in_flight(schedule, S, S, s) if schedule == "1f1b" else 1
        costs.append(
            stage_cost(
                tables[t],
                micro=micro,
                flight=flight,
                optimizer=optimizer,
                world=2,
                link_in=links[s - 1] if s > 0 else None,
                link_out=links[s] if s < S - 1 else None,
                staged=S > 1,
                state_shards=state_shards,
            )
        )
    bounds = min_max_split([c.seconds for c in costs])
    if bounds is None:
        return None
    ranges = list(zip(bounds[:-1], bounds[1:]))
    ckpt = tuple(bool(c.checkpointing[i, j]) for c, (i, j) in zip(costs, ranges))
    cap = None
    if schedule == "gpipe" and S > 1:
        cap = min(
            gpipe_max_micro_batches(tables[t], i, j, micro, optimizer, ck, state_shards)
            for t, (i, j), ck in zip(stage_types, ranges, ckpt)
        )
    return KindSplit(
        stage_types=stage_types,
        micro=micro,
        bounds=bounds,
        checkpointing=ckpt,
        stage_seconds=tuple(float(c.seconds[i, j]) for c, (i, j) in zip(costs, ranges)),
        compute_seconds=tuple(float(c.compute[i, j]) for c, (i, j) in zip(costs, ranges)),
        stage_params=tuple(tables[t].held_params(i, j) for t, (i, j) in zip(stage_types, ranges)),
        max_micro_batches=cap,
    )


def gpipe_max_micro_batches(
    table: TypeTable, i: int, j: int, micro: int, optimizer: str, ckpt: bool, state_shards: int = 1
) -> int:
    """How many micro-batches a GPipe stage holding [i, j) can keep in flight (on every member of a group)."""
    counts = []
    for m in table.member_tables:
        static = float(static_matrix(np.array(m.params[j] - m.params[i]), optimizer, 2, state_shards))
        if ckpt:
            per = (m.inputs[j] - m.inputs[i]) * micro * m.scale
            free = m.cap_bytes - static - micro * m.max_act[i, j] * m.scale
        else:
            per = (m.act[j] - m.act[i]) * micro * m.scale
            free = m.cap_bytes - static
        counts.append(int(free // per) if per > 0 else 1 << 30)
    return min(counts)


def min_shortfall(
    stage_types: tuple[str, ...], tables: Mapping[str, TypeTable], optimizer: str, state_shards: int = 1
) -> tuple[float, str, float]:
    """Smallest bytes-over-cap of the worst stage over all splits, at micro-batch 1 with checkpointing (1F1B),
    Adam's state sharded over ``state_shards`` replicas.

    Returns (shortfall bytes, that stage's GPU type, bytes it needs); shortfall <= 0 means it fits.
    """
    S = len(stage_types)
    costs = [
        stage_cost(
            tables[t],
            micro=1,
            flight=S - s,
            optimizer=optimizer,
            world=2,
            link_in=None,
            link_out=None,
            state_shards=state_shards,
        ).shortfall
        for s, t in enumerate(stage_types)
    ]
    bounds = min_max_split(costs)
    if bounds is None:
        return math.inf, stage_types[0], math.inf
    short, s = max((float(c[i, j]), s) for s, (c, i, j) in enumerate(zip(costs, bounds[:-1], bounds[1:])))
    t = stage_types[s]
    return short, t, short + tables[t].cap_bytes
