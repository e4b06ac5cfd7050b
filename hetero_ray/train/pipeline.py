"""Executing a pipelined Plan on Ray Train workers with ``torch.distributed.pipelining``.

Each worker runs the layers of its role's range as one ``PipelineStage``; the
stages of a pipeline talk over a process group of their ranks, and a GPipe
schedule runs the pipeline's micro-batches. Gradients are summed per layer over
the pipelines that hold it (one ``Bucket`` per distinct set of holders), so
pipelines may cut the model differently. Checkpoints hold the whole model and
the optimizer in the data-parallel format, so a run resumes on any plan.

A tensor-parallel stage is a group of workers splitting its GPT blocks (``workloads/tensor_parallel.py``). The
members of a stage run the same samples. When every stage of a pipeline has the same degree d, the pipeline runs
as d sub-pipelines of torch's, member k of each stage sending to member k of the next (torchtitan's 2-D layout).
When its stages differ in degree, ``torch.distributed.pipelining`` (one peer each way) cannot run it, and the
stages exchange tensors over plain sends and receives instead (``Boundary``, ``_OwnSchedule``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetero_ray.cluster.emulated_device import EmulatedDevice, PaddedModule
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.buckets import Bucket
from hetero_ray.train.data import collate
from hetero_ray.train.precision import autocast
from hetero_ray.train.sync import PER_ELEMENT
from hetero_ray.workloads import Workload
from hetero_ray.workloads.gpt import Block
from hetero_ray.workloads.tensor_parallel import AllReduceHook, TensorParallelBlock, assemble


def _layer_range(role: WorkerRole | None, n_layers: int) -> range:
    if role is None:
        return range(0)
    first, last = role.layers if role.layers is not None else (0, n_layers)
    return range(first, last)


def _split(role: WorkerRole) -> tuple[float, ...] | None:
    """The role's tensor-parallel weights; None for a stage of one worker (no weights, or one)."""
    return role.tp_weights if role.tp_degree > 1 else None


def tensor_members(roles: Sequence[WorkerRole | None]) -> dict[tuple[int, int], list[int]]:
    """The ranks of each (pipeline, stage), in ``tp_rank`` order (one rank for a stage without tensor
    parallelism). A ValueError in one line when a stage's members disagree on ``tp_weights`` or do not hold
    each ``tp_rank`` once."""
    by_stage: dict[tuple[int, int], list[int]] = {}
    for r, role in enumerate(roles):
        if role is not None:
            by_stage.setdefault((role.pipeline, role.stage), []).append(r)
    members = {}
    for (pipeline, stage), ranks in sorted(by_stage.items()):
        splits = {_split(roles[r]) for r in ranks}
        if len(splits) > 1:
            raise ValueError(
                f"pipeline {pipeline} stage {stage}: its workers disagree on tp_weights ({sorted(splits, key=str)}); "
                "give every member of a tensor-parallel stage the same tp_weights"
            )
        degree = roles[ranks[0]].tp_degree
        if sorted(roles[r].tp_rank for r in ranks) != list(range(degree)):
            raise ValueError(
                f"pipeline {pipeline} stage {stage}: {len(ranks)} workers with tp_ranks "
                f"{sorted(roles[r].tp_rank for r in ranks)} for tensor-parallel degree {degree}; "
                f"give each tp_rank 0..{degree - 1} to one worker"
            )
        members[(pipeline, stage)] = sorted(ranks, key=lambda r: roles[r].tp_rank)
    return members


def layer_holders(roles: Sequence[WorkerRole | None], n_layers: int) -> list[tuple[int, ...]]:
    """For each layer, the ranks that hold it or a part of it (one per pipeline, or a stage's tensor-parallel
    members), ascending."""
    return [
        tuple(r for r, role in enumerate(roles) if layer in _layer_range(role, n_layers)) for layer in range(n_layers)
    ]


def part_holders(roles: Sequence[WorkerRole | None], n_layers: int) -> list[list[tuple[int, ...]]]:
    """For each layer, the sets of ranks holding the same part of it, whose gradients of that part are summed:
    one set per ``tp_rank`` (member k of each pipeline's stage holding it holds the same shard, or the same
    whole layer). A ValueError in one line when the pipelines holding a layer split its stage differently:
    their parts would differ in shape."""
    tensor_members(roles)  # the stages' tensor-parallel layout is valid
    parts = []
    for layer, holders in enumerate(layer_holders(roles, n_layers)):
        splits = {_split(roles[r]) for r in holders}
        if len(splits) > 1:
            raise ValueError(
                f"layer {layer}: the pipelines holding it split its stage differently (tp_weights "
                f"{sorted(splits, key=str)}), so their parts of it differ; give every pipeline's stage holding it "
                "the same tp_weights"
            )
        degree = max((roles[r].tp_degree for r in holders), default=1)
        parts.append([tuple(r for r in holders if roles[r].tp_rank == k) for k in range(degree)])
    return parts


def gradient_buckets(layers: Sequence[nn.Module], roles: Sequence[WorkerRole | None], rank: int) -> list[Bucket]:
    """This rank's gradient buckets: its layers grouped by the set of ranks that hold the same part of them
    (``part_holders``). ``layers`` as the stages run them: tensor-parallel shards already cut (``Stage``).

    Every rank creates every group, in the same order, as ``dist.new_group`` requires.
    """
    by_holders: dict[tuple[int, ...], list[int]] = {}
    for layer, parts in enumerate(part_holders(roles, len(layers))):
        for holders in parts:
            by_holders.setdefault(holders, []).append(layer)
    buckets = []
    for holders in sorted(by_holders):
        group = dist.new_group(list(holders)) if len(holders) > 1 else None
        # A layer only one rank holds needs no sum (size 1).
        if rank in holders:
            params = [p for layer in by_holders[holders] for p in layers[layer].parameters()]
            buckets.append(Bucket(group=group, size=len(holders), params=params))
    return buckets


def _stages(roles: Sequence[WorkerRole | None]) -> dict[int, list[list[int]]]:
    """Each pipeline's stages in order, each as its members' ranks in ``tp_rank`` order."""
    stages: dict[int, list[list[int]]] = {}
    for (pipeline, _), ranks in sorted(tensor_members(roles).items()):
        stages.setdefault(pipeline, []).append(ranks)
    return stages


def _mixed(stages: list[list[int]]) -> bool:
    return len({len(ranks) for ranks in stages}) > 1


def sub_pipelines(roles: Sequence[WorkerRole | None]) -> dict[tuple[int, int], list[int]]:
    """The ranks of each (pipeline, tp_rank) in stage order: member k of every stage of a pipeline whose stages
    share their degree (a pipeline whose stages differ has none: ``boundary`` connects its stages)."""
    return {
        (pipeline, k): [ranks[k] for ranks in stages]
        for pipeline, stages in _stages(roles).items()
        if not _mixed(stages)
        for k in range(len(stages[0]))
    }


@dataclass(frozen=True)
class Boundary:
    """Whom one member of a stage exchanges tensors with, in a pipeline whose stages differ in tensor-parallel
    degree (global ranks). A stage's output and the gradient of its input are whole and the same on every
    member (after a block's all-reduces), so across a boundary from d to d' members, member j of the later
    stage takes the activation from member j mod d and member k of the earlier one the gradient from member
    k mod d'; each member sends to those that map to it."""

    stage: int
    stages: int
    activation_from: int | None
    activation_to: tuple[int, ...]
    gradient_from: int | None
    gradient_to: tuple[int, ...]


def boundary(roles: Sequence[WorkerRole | None], rank: int) -> Boundary | None:
    """This rank's ``Boundary`` when its pipeline's stages differ in degree; None otherwise (torch's schedules
    run it) or for a rank without a role."""
    role = roles[rank]
    if role is None:
        return None
    stages = _stages(roles)[role.pipeline]
    if not _mixed(stages):
        return None
    s, k = role.stage, role.tp_rank
    before = stages[s - 1] if s > 0 else []
    after = stages[s + 1] if s + 1 < len(stages) else []
    mine = len(stages[s])
    return Boundary(
        stage=s,
        stages=len(stages),
        activation_from=before[k % len(before)] if before else None,
        activation_to=tuple(r for j, r in enumerate(after) if j % mine == k),
        gradient_from=after[k % len(after)] if after else None,
        gradient_to=tuple(r for j, r in enumerate(before) if j % mine == k),
    )


def pipeline_group(roles: Sequence[WorkerRole | None], rank: int) -> tuple[dist.ProcessGroup | None, list[int]]:
    """The process group of this rank's (sub-)pipeline and its ranks in stage order (every rank creates every
    group). A one-stage tensor-parallel replica gets a group of its one rank: its ``PipelineStage`` runs on it."""
    mine: tuple[dist.ProcessGroup | None, list[int]] = (None, [])
    for ranks in sub_pipelines(roles).values():
        tensor_parallel = roles[ranks[0]].tp_degree > 1
        group = dist.new_group(ranks) if len(ranks) > 1 or tensor_parallel else None
        if rank in ranks:
            mine = (group, ranks)
    return mine


def shard_group(roles: Sequence[WorkerRole | None], rank: int) -> tuple[dist.ProcessGroup | None, list[int]]:
    """ZeRO-1 in a pipelined plan: the process group and ranks of this rank's stage replicas, the stage at the
    same place of every pipeline cut exactly as this rank's (same types, same layers: the planner's replicas of
    one kind), ranks in pipeline order. They hold the same parameters in the same gradient chunks, so Adam's
    state of those chunks is sharded over them. Every rank creates every group, in the same order."""
    shape: dict[int, tuple] = {}
    for role in sorted((r for r in roles if r is not None), key=lambda r: (r.pipeline, r.stage)):
        shape[role.pipeline] = (*shape.get(role.pipeline, ()), (role.gpu_type, role.layers))
    replicas: dict[tuple, list[int]] = {}
    for r, role in sorted(enumerate(roles), key=lambda x: x[1].pipeline if x[1] else -1):
        if role is not None:
            replicas.setdefault((shape[role.pipeline], role.stage), []).append(r)
    mine: tuple[dist.ProcessGroup | None, list[int]] = (None, [rank])
    for ranks in sorted(replicas.values()):
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (group, ranks)
    return mine


def tensor_group(roles: Sequence[WorkerRole | None], rank: int) -> dist.ProcessGroup | None:
    """The process group of this rank's tensor-parallel stage; None without tensor parallelism (every rank
    creates every group)."""
    mine = None
    for ranks in tensor_members(roles).values():
        if len(ranks) > 1:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


class _Checkpointed(nn.Module):
    """A layer whose activations are recomputed in the backward instead of kept."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def sequence(layers: Sequence[nn.Module], *, checkpointing: bool) -> nn.Sequential:
    """The layers run one after another, each checkpointed when ``checkpointing``."""
    return nn.Sequential(*(_Checkpointed(layer) if checkpointing else layer for layer in layers))


def _cut_shards(
    model: nn.Module,
    layers: list[nn.Module],
    held: range,
    role: WorkerRole,
    group: dist.ProcessGroup | None,
    device: torch.device,
    hook: AllReduceHook | None,
) -> None:
    """Replace each GPT ``Block`` among ``layers[held]`` by this rank's ``TensorParallelBlock`` over ``group``, in
    ``layers`` and in ``model``: its parameters become the model's, which the synchroniser indexes."""
    names = {id(m): name for name, m in model.named_modules()}
    for i in held:
        if isinstance(layers[i], Block):
            shard = TensorParallelBlock(layers[i], group, role.tp_rank, role.tp_weights, hook=hook).to(device)
            model.set_submodule(names[id(layers[i])], shard)
            layers[i] = shard


def actions(schedule: str, stage: int, stages: int, n_micro: int) -> list[tuple[str, int]]:
    """The order in which a stage runs its micro-batches' forwards ("F", m) and backwards ("B", m): GPipe,
    every forward then every backward; 1F1B, ``stages − stage − 1`` forwards of warm-up, then one forward and
    one backward in turn, then the remaining backwards (as torch's ``Schedule1F1B``)."""
    if schedule == "gpipe":
        return [("F", m) for m in range(n_micro)] + [("B", m) for m in range(n_micro)]
    warmup = min(stages - stage - 1, n_micro)
    steady = [a for m in range(n_micro - warmup) for a in (("F", warmup + m), ("B", m))]
    return [("F", m) for m in range(warmup)] + steady + [("B", m) for m in range(n_micro - warmup, n_micro)]


class _OwnSchedule:
    """Torch's schedules' ``step`` for a stage of a pipeline whose stages differ in tensor-parallel degree: the
    micro-batches run in ``actions`` order, tensors cross the boundaries as ``Boundary`` says, over
    ``dist.isend`` (waited on at the end of the step, so neighbours never wait on each other's sends) and a
    blocking ``dist.recv``. The members of a stage run the same actions in the same order, so their
    tensor-parallel all-reduces meet."""

    def __init__(self, module: nn.Module, edge: Boundary, n_micro: int, schedule: str, loss_fn, device):
        self.module, self.edge, self.n_micro, self.loss_fn, self.device = module, edge, n_micro, loss_fn, device
        self.order = actions(schedule, edge.stage, edge.stages, n_micro)

    def _recv(self, source: int) -> torch.Tensor:
        # A header of the shape first: an activation's shape is the sender's to know (stages carry fp32). On the
        # device, as NCCL sends nothing else.
        header = torch.zeros(8, dtype=torch.int64, device=self.device)
        dist.recv(header, source)
        out = torch.empty(header[1 : 1 + int(header[0])].tolist(), dtype=torch.float32, device=self.device)
        dist.recv(out, source)
        return out

    @staticmethod
    def _send(tensor: torch.Tensor, to: tuple[int, ...], pending: list) -> None:
        tensor = tensor.detach().contiguous()
        header = torch.tensor([tensor.dim(), *tensor.shape, *[0] * (7 - tensor.dim())], device=tensor.device)
        for rank in to:
            # The tensors stay referenced until their sends are waited on.
            pending.append((dist.isend(header, rank), header))
            pending.append((dist.isend(tensor, rank), tensor))

    def step(self, *args, target: torch.Tensor | None = None, losses: list | None = None) -> None:
        edge = self.edge
        inputs = torch.tensor_split(args[0], self.n_micro) if args else None
        targets = torch.tensor_split(target, self.n_micro) if target is not None else None
        pending: list = []
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind, m in self.order:
            if kind == "F":
                x = inputs[m] if inputs is not None else self._recv(edge.activation_from).requires_grad_()
                out = self.module(x)
                if targets is not None:
                    out = self.loss_fn(out, targets[m])
                    losses.append(out.detach())
                else:
                    self._send(out, edge.activation_to, pending)
                saved[m] = (x, out)
            else:
                x, out = saved.pop(m)
                out.backward(None if targets is not None else self._recv(edge.gradient_from))
                if inputs is None:
                    self._send(x.grad, edge.gradient_to, pending)
        for work, _ in pending:
            work.wait()


class Stage:
    """This worker's pipeline stage: its layers, the schedule, and one step over its pipeline's micro-batches.

    A tensor-parallel role's stage cuts its shards of the GPT blocks into ``workload.model`` (``tp_group``:
    ``tensor_group``'s), so it must be made before the gradient buckets and the synchroniser, which must see
    the shards' parameters. ``edge``: ``boundary``'s, for a pipeline whose stages differ in degree (``group``
    and ``ranks`` are then unused).
    """

    def __init__(
        self,
        workload: Workload,
        role: WorkerRole,
        group: dist.ProcessGroup,
        ranks: list[int],
        global_batch: int,
        device: torch.device,
        emu: EmulatedDevice | None,
        schedule: str = "gpipe",
        link: tuple[float, float] | None = None,
        precision: str = "fp32",
        tp_group: dist.ProcessGroup | None = None,
        edge: Boundary | None = None,
    ):
        # Imported here: torch.distributed.pipelining (and DTensor under it) adds about a second to the start of
        # every worker and driver, most of which never run a pipeline.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        layered = workload.layered
        layers = list(layered.layers(workload.model))
        first, last = role.layers or (0, len(layers))
        if role.tp_degree > 1:
            # An emulated member holds its all-reduces to the named link, as the planner prices them.
            hook = emu.all_reduce_hook(link, role.tp_degree) if emu and link else None
            _cut_shards(workload.model, layers, range(first, last), role, tp_group, device, hook)
        self.role, self.workload, self.device, self.emu, self.precision = role, workload, device, emu, precision
        self.is_first, self.is_last = first == 0, last == len(layers)
        self.module = nn.Sequential(*layers[first:last])
        runnable = sequence(layers[first:last], checkpointing=role.activation_checkpointing)
        self.padded = (
            PaddedModule(runnable, emu, role.micro_batch, link=link, first=self.is_first, last=self.is_last)
            if emu
            else None
        )
        self.n_micro = role.local_batch // role.micro_batch

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Each micro-batch's mean loss weighted by its share of the global batch: summed
            # over micro-batches and pipelines, the gradient is the full-batch mean.
            return layered.output_loss(output, target) * (role.micro_batch / global_batch)

        self.global_batch = global_batch
        output = _Float32Output(self.padded or runnable)
        if edge is not None:
            self.schedule = _OwnSchedule(output, edge, self.n_micro, schedule, loss_fn, device)
            return
        stage = PipelineStage(output, role.stage, len(ranks), device, group=group)
        # new_group orders a group's ranks ascending; stage s lives on ranks[s].
        ascending = sorted(ranks)
        stage.stage_index_to_group_rank = {s: ascending.index(r) for s, r in enumerate(ranks)}
        schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        self.schedule = schedules[schedule](stage, n_microbatches=self.n_micro, loss_fn=loss_fn, scale_grads=False)

    def static_bytes(self, bytes_per_param: int) -> int:
        return sum(p.numel() for p in self.module.parameters()) * bytes_per_param

    def step(self, indices: torch.Tensor, memory_cap, sync) -> tuple[float, float]:
        """Run the pipeline's micro-batches through this stage, ``sync`` armed to reduce each gradient bucket as
        soon as their backward passes have filled it; return (summed loss, busy seconds)."""
        role, layered = self.role, self.workload.layered
        mine = indices[role.sample_offset : role.sample_offset + role.local_batch]
        batch = collate(self.workload.dataset, mine) if self.is_first or self.is_last else None
        args = (layered.inputs(batch).to(self.device),) if self.is_first else ()
        kwargs: dict = {}
        losses: list[torch.Tensor] = []
        if self.is_last:
            kwargs = {"target": layered.targets(batch).to(self.device), "losses": losses}
        if self.padded:
            self.padded.busy_s = 0.0
        sync.arm(self.n_micro)
        with memory_cap or nullcontext(), autocast(self.precision, self.device):
            self.schedule.step(*args, **kwargs)
        # The members of a tensor-parallel stage run the same samples: one of them counts their loss.
        loss_sum = sum(float(x.detach()) for x in losses) * self.global_batch if self.role.tp_rank == 0 else 0.0
        return loss_sum, self.padded.busy_s if self.padded else 0.0


class _Float32Output(nn.Module):
    """Stage boundaries carry fp32, so stages in different precisions can talk."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out.float() if out.is_floating_point() else out


def _whole_names(model: nn.Module) -> tuple[dict[int, str], list[str]]:
    """Each parameter's name in the unsplit model, by id (a tensor-parallel shard's: the name of the whole
    tensor it is cut from), and the unsplit model's parameter names in its ``parameters()`` order, by whose
    positions optimizer states are keyed."""
    cut_from: dict[int, tuple[str, tuple[str, ...]]] = {}  # a shard's parameter → (whole name, its block's)
    for prefix, m in model.named_modules():
        if isinstance(m, TensorParallelBlock):
            block = tuple(f"{prefix}.{k}" for k in m.by_full_name())
            cut_from |= {id(t): (f"{prefix}.{k}", block) for k, t in m.by_full_name().items()}
    names: dict[int, str] = {}
    order: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for name, t in model.named_parameters():
        whole, block = cut_from.get(id(t), (name, (name,)))
        names[id(t)] = whole
        # A shard registers its parameters in another order than the whole block: at the first of them, the
        # whole block's names, in its order.
        if block not in seen:
            seen.add(block)
            order += block
    return names, order


def _assemble_states(shards: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """A tensor-parallel block's optimizer state in the unsplit layout, from its members' states (by whole-block
    tensor name, in ``tp_rank`` order): per-element moments assembled as the weights are, counters from the
    first member (all step together). Empty before the first step."""
    if not shards[0]:
        return {}
    moments = [m for m in PER_ELEMENT if m in next(iter(shards[0].values()))]
    whole = {m: assemble([{k: state[m] for k, state in shard.items()} for shard in shards]) for m in moments}
    return {k: state | {m: whole[m][k] for m in moments} for k, state in shards[0].items()}


def local_optimizer_state(model: nn.Module, whole: dict) -> dict:
    """A checkpoint's whole optimizer state in this rank's layout (``gather_whole_state``'s inverse): keyed by
    position in ``model.parameters()``, a tensor-parallel shard's moments cut as its weights are. Without
    shards, ``whole`` itself."""
    shards = {
        id(t): (m, k)
        for m in model.modules()
        if isinstance(m, TensorParallelBlock)
        for k, t in m.by_full_name().items()
    }
    if not shards:
        return whole
    names, order = _whole_names(model)
    position = {name: i for i, name in enumerate(order)}
    state = {}
    for i, t in enumerate(model.parameters()):
        entry = whole["state"].get(position[names[id(t)]])
        if entry is not None and id(t) in shards:
            block, key = shards[id(t)]
            entry = {k: block.cut({key: v})[key] if k in PER_ELEMENT else v for k, v in entry.items()}
        if entry is not None:
            state[i] = entry
    group = whole["param_groups"][0]
    return {"state": state, "param_groups": [{**group, "params": list(range(len(order)))}]}


def gather_whole_state(
    model: nn.Module, layers: Sequence[nn.Module], sync, roles: Sequence[WorkerRole | None], rank: int
) -> tuple[dict, dict] | None:
    """On rank 0, the whole model's and optimizer's state in the unsplit layout, assembled from pipeline 0's
    stages and their tensor-parallel members' shards (None elsewhere). ``layers`` as the stages run them.

    Every rank must call it: it is one ``gather_object``.
    """
    part = None
    role = roles[rank]
    names, order = _whole_names(model)
    first = role is not None and role.pipeline == 0
    # Sharded (ZeRO-1), every rank gives its slices and each stage's first replica, pipeline 0's, gets the whole.
    optimizer = sync.state_dict() if first or getattr(sync, "sharded", None) is not None else None
    if first:
        # By tensor, not by module path: a layer may be a wrapper the model does not hold (the cut points of
        # transformers' models), and a tied tensor has a key per name.
        keys: dict[int, list[str]] = {}
        for k, t in model.state_dict(keep_vars=True).items():
            keys.setdefault(id(t), []).append(k)
        modules = {id(m): name for name, m in model.named_modules()}
        params = list(model.parameters())
        state = {id(params[i]): s for i, s in optimizer["state"].items()}
        tensors, states, shards = {}, {}, {}
        # Pipeline 0 may be one whole-model replica beside staged pipelines.
        first, last = role.layers or (0, len(layers))
        for layer in layers[first:last]:
            if isinstance(layer, TensorParallelBlock):
                mine = {k: state[id(t)] for k, t in layer.by_full_name().items() if id(t) in state}
                shards[modules[id(layer)]] = (role.tp_rank, layer.local_state(), mine)
            else:
                tensors |= {k: t.detach() for t in layer.state_dict(keep_vars=True).values() for k in keys[id(t)]}
                states |= {names[id(t)]: state[id(t)] for t in layer.parameters() if id(t) in state}
        group = optimizer["param_groups"][0]
        held = {names[id(params[i])] for i in group["params"]}
        part = (tensors, states, shards, held, {k: v for k, v in group.items() if k != "params"})
    parts: list = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    if rank != 0:
        return None
    model_state: dict = {}
    states, held, hyper, members = {}, set(), {}, {}
    for tensors, named_states, shards, names_held, group in filter(None, parts):
        model_state |= tensors
        states |= named_states
        held |= names_held
        hyper = group
        for prefix, shard in shards.items():
            members.setdefault(prefix, []).append(shard)
    for prefix, shard_list in members.items():
        ordered = sorted(shard_list, key=lambda shard: shard[0])
        model_state |= {f"{prefix}.{k}": t for k, t in assemble([s[1] for s in ordered]).items()}
        states |= {f"{prefix}.{k}": s for k, s in _assemble_states([s[2] for s in ordered]).items()}
    position = {name: i for i, name in enumerate(order)}
    optimizer_state = {
        "state": dict(sorted((position[n], s) for n, s in states.items())),
        "param_groups": [{**hyper, "params": sorted(position[n] for n in held)}],
    }
    return model_state, optimizer_state
