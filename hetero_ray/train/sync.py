"""How a step's gradients are synchronised and applied.

``TorchAdam``: AdamW over one flat SUM all-reduce. ``DeepSpeedOnebit``: DeepSpeed's
OnebitAdam / ZeroOneAdam through ``deepspeed.initialize``, which average across
ranks (so losses are weighted ``× world``) and switch to 1-bit compressed momentum
after their warm-up. Both give the same interface to the training loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetero_ray.config import ConfigError, RunConfig
from hetero_ray.plan.cost import onebit_allreduce_bytes, ring_allreduce_bytes
from hetero_ray.train.buckets import WIRE_DTYPES, Bucket, EmulatedLink, GradBuckets, Launch
from hetero_ray.train.precision import loss_scaler
from hetero_ray.train.zero import ShardedParameters, Shards, layer_units
from hetero_ray.workloads.tensor_parallel import TensorParallelBlock


@dataclass(frozen=True)
class Synced:
    """What one synchronisation returns: the summed loss, the stop vote, bytes this rank sent; ``launches``: the
    gradient buckets' all-reduces (``buckets.Launch``)."""

    loss_total: float
    stop: bool
    bytes_sent: float
    messages: int
    compressed: bool
    launches: tuple[Launch, ...] = ()


def copy_state(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor] | None:
    """A copy of ``model``'s state dict, held whole on this rank, if ``keep`` (else ``None``)."""
    return {k: v.clone() for k, v in model.state_dict().items()} if keep else None


class TorchAdam:
    """AdamW on the full-batch mean gradient, SUM all-reduced bucket by bucket as the backward fills them.

    Each micro-batch's loss is weighted ``size / global_batch``, so the sum over
    the ranks holding a parameter is the full-batch mean. Data parallelism has
    one bucket, the whole model over the world; a pipelined plan has one per set
    of ranks holding the same layers. Gradients live in ``buckets.GradBuckets``:
    views into flat chunks, each all-reduced (in ``train.reduce_dtype``) while the
    backward goes on. fp16 ranks reduce after their local unscale (scales differ by
    rank), and all ranks skip a step together when any gradient is not finite (under
    ZeRO-2/3 every fp16 rank's scaler then backs off: the gradients it sent are summed
    by their owners, which see only sums).
    ``train.grad_clip`` scales the summed gradient down to that global norm on every
    rank alike. Under ZeRO (``zero_stage``, ``train/zero.py``) a rank's AdamW holds its
    shard's slices alone; at stage 2 the gradients are reduced to their owners pass by pass
    and kept there alone, at stage 3 the parameters too (``layers``: the workload's, which
    chunks are cut at and gathered by; an evaluation's forwards gather as training's do, and
    ``model_state`` copies the model for a checkpoint; a checkpoint's weights go into the model
    before, since stage 3 keeps only its slices of them).
    In a pipelined plan (stage 1 only) the shards span the replicas of the rank's stage (``shard_group``).
    Optimizer state is saved by position in ``model.parameters()``, so a checkpoint loads on
    any plan and any ZeRO stage.
    """

    loss_weight = 1.0

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: RunConfig,
        device: torch.device,
        precision: str | None,
        buckets: list[Bucket] | None = None,
        link: EmulatedLink | None = None,
        shard_weights: Sequence[float] | None = None,
        tp_degree: int = 1,
        zero_stage: int = 0,
        layers: Sequence[torch.nn.Module] | None = None,
        shard_group: tuple[dist.ProcessGroup | None, Sequence[int]] | None = None,
    ):
        world = dist.get_world_size()
        if buckets is None:
            units = layer_units(model, layers, zero_stage) or [list(model.parameters())]
            buckets = [Bucket(None, world, unit) for unit in units]
        self.params = [p for b in buckets for p in b.params]
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self.index = [position[id(p)] for p in self.params]
        self.grads = GradBuckets(
            buckets,
            wire=WIRE_DTYPES[cfg.train.reduce_dtype],
            bucket_bytes=int(cfg.train.bucket_mb * 2**20),
            link=link,
        )
        self.link = link
        self.zero_stage = zero_stage
        self.sharded = None
        group, owners = shard_group or (None, range(world))
        # A stage without replicas (a shard group of one) holds its state whole, outside any collective.
        if zero_stage and (shard_group is None or len(owners) > 1):
            rank, chunks = dist.get_rank(), self.grads.chunks
            weights = shard_weights or [1.0] * world
            shards = Shards.by_weight(sum(c.flat.numel() for c in chunks), [weights[r] for r in owners], owners)
            if zero_stage >= 2:
                self.grads.reduce_to_owners(shards, rank)
            self.sharded = ShardedParameters(
                [(c.params, c.own if zero_stage >= 2 else c.flat) for c in chunks],
                shards,
                rank,
                zero_stage,
                self.grads.launches,
                group,
            )
            # Positions in the flattened (chunk) order, which reverses the buckets'.
            self.flat_index = [position[id(p)] for c in chunks for p in c.params]
        if zero_stage == 3:
            chunk_of = {p: i for i, c in enumerate(chunks) for p in c.params}
            self.sharded.gather_per_layer(
                layers, [sorted({chunk_of[p] for p in layer.parameters() if p in chunk_of}) for layer in layers]
            )
            self.grads.on_launch = lambda chunk: self.sharded.release([chunk])
        self.optimizer = torch.optim.AdamW(
            self.sharded.params if self.sharded else self.params,
            lr=cfg.train.lr,
            betas=cfg.optimizer.betas,
            weight_decay=cfg.train.weight_decay,
        )
        self.clip = cfg.train.grad_clip
        # The members of a tensor-parallel stage each hold its whole tensors: each adds 1/degree of their squared
        # norm, and its shards' in full. None: every tensor counts once.
        split = {p for m in model.modules() if isinstance(m, TensorParallelBlock) for p in m.split_parameters()}
        self.norm_weight = (
            {p: 1.0 if p in split else 1.0 / tp_degree for p in self.params} if self.clip and tp_degree > 1 else None
        )
        self.scaler = loss_scaler(precision, device) if precision else None
        if self.scaler and self.grads.owned:
            # Under ZeRO-2/3 gradients leave during the backward: each chunk is unscaled on its way out
            # (``GradBuckets.scale``), and the scaler learns whether to back off from the step's vote, through a
            # gradient it unscales that is non-finite exactly when some summed gradient is.
            self._verdict = torch.zeros(1, device=device, requires_grad=True)
            self._verdict.grad = torch.zeros(1, device=device)
            self._unscaled = torch.optim.SGD([self._verdict], lr=0.0)
            self.grads.scale = 1.0 / self.scaler.get_scale()
        else:
            # The scaler unscales every local gradient before the sum, not only the slices this rank's AdamW holds.
            self._unscaled = torch.optim.SGD(self.params, lr=0.0) if self.scaler and self.sharded else self.optimizer
        self.device = device

    @property
    def optimizer_elements(self) -> int:
        """Elements this rank keeps optimizer state for: its shard under ZeRO, else every parameter."""
        return sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])

    def arm(self, passes: int = 1) -> None:
        """The next ``passes`` backward passes end the step: their gradients go on the wire as they are ready.
        A rank with a loss scaler reduces after its unscale, in ``step``; under ZeRO-2/3 every pass reduces."""
        if self.scaler is None:
            self.grads.arm(passes)

    def backward(self, loss: torch.Tensor) -> None:
        """One backward pass; under ZeRO-2/3 it returns once its gradients have reached their owners."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.grads.end_pass()

    def model_state(self, model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """A copy of the whole model's state dict if ``keep`` (else ``None``). Under ZeRO-3 every rank must call
        it alike: the parameters are gathered a chunk at a time into host copies, so a checkpoint never holds the
        whole model on the device at once."""
        if self.zero_stage != 3:
            return copy_state(model, keep)
        copies = self.sharded.host_copies(keep)
        if not keep:
            return None
        state = model.state_dict(keep_vars=True)
        return {k: copies[id(v)] if id(v) in copies else v.detach().clone() for k, v in state.items()}

    def step(self, loss_sum: float, stop: bool) -> Synced:
        """Finish the gradient all-reduces, agree on loss, stop, finiteness and the gradient's norm, then clip
        and update."""
        if self.scaler and not self.grads.owned:
            self.scaler.unscale_(self._unscaled)
        finite, launches = self.grads.finish()
        world = dist.get_world_size()
        squares = self._squares() if self.clip else 0.0
        votes = torch.tensor([loss_sum, float(stop), float(not finite), squares], device=self.device)
        voted = time.perf_counter()
        dist.all_reduce(votes)
        vote_bytes, vote_rounds = ring_allreduce_bytes(4 * votes.numel(), world), 2 * (world - 1)
        if self.link:
            self.link.hold(self.link.send(voted, vote_bytes, vote_rounds), voted)
        gathered = 0.0
        if votes[2] == 0:
            norm = math.sqrt(float(votes[3]))
            if self.clip and norm > self.clip:
                # clip_grad_norm_'s factor, on every rank alike.
                for g, _ in self.grads.summed():
                    g.mul_(self.clip / (norm + 1e-6))
            self.optimizer.step()
            if self.sharded and self.zero_stage < 3:
                gathered = self._share_updates()
        if self.scaler:
            if self.grads.owned:
                self._verdict.grad.fill_(0.0 if votes[2] == 0 else math.inf)
                self.scaler.unscale_(self._unscaled)
            self.scaler.update()
            if self.grads.owned:
                self.grads.scale = 1.0 / self.scaler.get_scale()
        self.grads.zero()
        return Synced(
            loss_total=float(votes[0]),
            stop=bool(votes[1] > 0),
            bytes_sent=sum(x.bytes_sent for x in launches) + vote_bytes + gathered,
            messages=sum(x.messages for x in launches)
            + vote_rounds
            + (self.sharded.shards.world - 1 if gathered else 0),
            compressed=False,
            launches=tuple(launches),
        )

    def _squares(self) -> float:
        """This rank's part of the summed gradient's squared norm: of what it holds, its share among those that
        hold the same (a tensor-parallel stage's members weighted per tensor)."""
        if self.norm_weight is None:
            return sum(float(g.double().square().sum()) / n for g, n in self.grads.summed())
        return sum(
            float(v.double().square().sum()) * self.norm_weight[p] / c.size
            for c in self.grads.chunks
            for p, v in c.views.items()
        )

    def _share_updates(self) -> float:
        """Every owner's updated parameters to every rank, held to the link as an all-gather; bytes this rank sent
        (a ring all-gather's: all but one rank's part of the parameters)."""
        start = time.perf_counter()
        self.sharded.share_updates()
        world = self.sharded.shards.world
        sent = sum(f.numel() * f.element_size() for f in self.sharded.flats) * (world - 1) / world
        if self.link:
            self.link.hold(self.link.send(start, sent, world - 1), start)
        return sent

    def state_dict(self) -> dict | None:
        """AdamW's state keyed by position in ``model.parameters()``; under ZeRO every rank must call it and
        the shards' first owner (rank 0; in a pipeline, each stage's first replica) gets the whole state of its
        parameters, gathered from every shard (``None`` elsewhere)."""
        if self.sharded:
            mine = [self.optimizer.state.get(p, {}) for p in self.sharded.params]
            whole = self.sharded.whole_state(mine, self.flat_index)
            if whole is None:
                return None
            group = {k: v for k, v in self.optimizer.state_dict()["param_groups"][0].items() if k != "params"}
            return {"state": {i: s for i, s in whole if s}, "param_groups": [{**group, "params": self.index}]}
        state = self.optimizer.state_dict()
        return {
            "state": {self.index[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [self.index[i] for i in g["params"]]} for g in state["param_groups"]],
        }

    def load_state_dict(self, state: dict) -> None:
        """Load the entries of this rank's parameters (its shard's, under ZeRO) from a whole-model state."""
        group = state["param_groups"][0]
        if self.sharded:
            slices = self.sharded.slice_state(state["state"], self.flat_index)
            self.optimizer.load_state_dict(
                {
                    "state": {i: s for i, s in enumerate(slices) if s},
                    "param_groups": [{**group, "params": list(range(len(slices)))}],
                }
            )
            return
        local = {g: i for i, g in enumerate(self.index)}
        self.optimizer.load_state_dict(
            {
                "state": {local[g]: s for g, s in state["state"].items() if g in local},
                "param_groups": [{**group, "params": list(range(len(self.index)))}],
            }
        )


DEEPSPEED_TYPES = {"onebit_adam": "OneBitAdam", "zero_one_adam": "ZeroOneAdam"}


def deepspeed_config(cfg: RunConfig, world: int, on_gpu: bool) -> dict:
    """The DeepSpeed config for ``cfg``'s 1-bit optimizer, in fp32 with ZeRO off.

    Gradient accumulation is ours (ranks run different numbers of micro-batches), so
    DeepSpeed's is unmanaged: ``backward`` only accumulates, ``step`` reduces and updates.
    The batch sizes are nominal (DeepSpeed insists on them; it never sees our data).
    """
    opt = cfg.optimizer
    warmup = opt.warmup_steps(cfg.train.steps)
    params: dict = {
        "lr": cfg.train.lr,
        "betas": list(opt.betas),
        "weight_decay": cfg.train.weight_decay,
        # cupy + NCCL on GPUs; on CPU the project's gloo backend serves the "compressed" name.
        "comm_backend_name": "nccl" if on_gpu else "compressed",
        "cuda_aware": False,
    }
    if opt.name == "onebit_adam":
        params["freeze_step"] = warmup
    else:
        params |= {
            "var_freeze_step": warmup,
            "var_update_scaler": opt.var_update_scaler,
            "local_step_scaler": opt.local_step_scaler,
            "local_step_clipper": opt.local_step_clipper,
        }
    ours = {
        "train_batch_size": world,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": DEEPSPEED_TYPES[opt.name], "params": params},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 2**31 - 1,
    }
    return merge_config(ours, opt.deepspeed)


def merge_config(ours: dict, theirs: dict, where: str = "optimizer.deepspeed") -> dict:
    """``ours`` with ``theirs`` merged in, key by key; a key both set to different values is a ``ConfigError``
    naming it (hetero-ray's values carry its split, its accumulation and its run config)."""
    merged = dict(ours)
    for key, value in theirs.items():
        path = f"{where}.{key}"
        if isinstance(value, dict) and isinstance(ours.get(key), dict):
            merged[key] = merge_config(ours[key], value, path)
        elif key in ours and ours[key] != value:
            raise ConfigError(
                f"{path}: {value!r} conflicts with hetero-ray's {ours[key]!r} (set from the run config and the "
                "plan); drop it, or set it through the run config"
            )
        else:
            merged[key] = value
    return merged


# DeepSpeed's per-tensor sizing and error-feedback state: it re-derives the sizes and resets
# the errors whenever it loads a state (the errors are each rank's own), so checkpoints omit them.
DEEPSPEED_REDERIVED = {"worker_error", "server_error", "momentum_accumulator", "tensor_size", "corrected_tensor_size"}
DEEPSPEED_REDERIVED |= {"server_chunk_size"}
# The per-element moments both optimizers keep, one tensor the size of the parameter each.
PER_ELEMENT = ("exp_avg", "exp_avg_sq")


class DeepSpeedOnebit:
    """DeepSpeed's OnebitAdam / ZeroOneAdam over a data-parallel group, its updates applied to the model.

    On gloo (CPU) the parameters become views into one flat fp32 parameter, the only one
    DeepSpeed sees, so it makes one compressed call per step, and the backend gives every
    original tensor its own scale (``onebit/flat.py``, ``GlooCompressedBackend.set_segments``).
    On GPUs, DeepSpeed's NCCL backend has one scale per call, so there DeepSpeed gets the
    tensors themselves and compresses tensor by tensor (one flat tensor under one scale
    trained measurably worse: ``docs/decisions.md``).

    DeepSpeed averages over the group; the loss is weighted as for a sum (``loss_weight`` 1,
    like pipeline stages) and the gradients are multiplied by the group size before the
    step. Until the warm-up ends DeepSpeed all-reduces fp32 gradients; then only 1-bit
    compressed momentum crosses the wire, counted by our backend. ``bucket``: this rank's
    parameters and their data-parallel group in a pipelined plan (``mpu`` for DeepSpeed);
    ``None``: the whole model over the world. The loss and stop vote take one extra
    2-element all-reduce over the world. Optimizer state is saved per parameter, by
    position in ``model.parameters()`` as ``TorchAdam`` saves it.
    """

    loss_weight = 1.0

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: RunConfig,
        device: torch.device,
        bucket: Bucket | None = None,
        link: EmulatedLink | None = None,
    ):
        from hetero_ray.train.onebit import (
            FlatParameters,
            data_parallel_mpu,
            init_distributed_on_gloo,
            initialize_on_gloo,
        )

        self.device = device
        self.link = link
        self.world = dist.get_world_size()
        params = bucket.params if bucket is not None else list(model.parameters())
        self.group_size = bucket.size if bucket is not None else self.world
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self.index = [position[id(p)] for p in params]
        self.numels = [p.numel() for p in params]
        self.params = params
        self.optimizer_elements = sum(self.numels)  # no ZeRO with 1-bit optimizers: state for all it holds
        mpu = data_parallel_mpu(bucket.group) if bucket is not None else None
        config = deepspeed_config(cfg, self.group_size, device.type == "cuda")
        self.flat = None if device.type == "cuda" else FlatParameters(params)
        if self.flat is None:
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl")
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                config=config, model=model, model_parameters=params, mpu=mpu
            )
        else:
            init_distributed_on_gloo()
            self.engine, self.optimizer, _, _ = initialize_on_gloo(
                config=config, model=self.flat, model_parameters=[self.flat.flat], mpu=mpu
            )
        self.backend = self.optimizer.comm_backend_handle
        if self.flat is not None:
            self.backend.set_segments(self.numels)
        self.grad_copy_s = 0.0  # cumulative time moving gradients into the flat one (and scaling them)

    def arm(self, passes: int = 1) -> None:
        """Nothing to start early: DeepSpeed reduces in its step, in its own buckets."""

    def model_state(self, model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """A copy of the whole model's state dict if ``keep`` (else ``None``)."""
        return copy_state(model, keep)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def compressed(self) -> bool:
        """Whether the optimizer is past its warm-up (only compressed momentum is exchanged)."""
        return bool(getattr(self.optimizer, "adam_freeze_key", False) or getattr(self.optimizer, "freeze_key", False))

    def step(self, loss_sum: float, stop: bool) -> Synced:
        """Reduce (fp32 or compressed, as DeepSpeed's phase says) and update."""
        compressed = self.compressed()
        counted = hasattr(self.backend, "bytes_sent")  # ours counts; DeepSpeed's NCCL backend does not
        before = (self.backend.bytes_sent, self.backend.rounds) if counted else (0, 0)
        t0 = time.perf_counter()
        if self.flat is not None:
            self.flat.collect_grads(self.group_size)
        else:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.group_size)
        self.grad_copy_s += time.perf_counter() - t0
        self.engine.step()
        votes = torch.tensor([loss_sum, float(stop)], device=self.device)
        dist.all_reduce(votes)
        vote_bytes, vote_rounds = ring_allreduce_bytes(4 * votes.numel(), self.world), 2 * (self.world - 1)
        group = self.group_size
        if not compressed:
            # DeepSpeed buckets the fp32 all-reduce into one ring.
            sent, rounds = ring_allreduce_bytes(4 * sum(self.numels), group), 2 * (group - 1)
        elif counted:
            sent, rounds = self.backend.bytes_sent - before[0], self.backend.rounds - before[1]
        else:
            # DeepSpeed's NCCL backend: tensor by tensor, four collectives each.
            sent = sum(onebit_allreduce_bytes(n, group) for n in self.numels)
            rounds = 4 * len(self.numels) * (group - 1)
        if self.link:
            self.link.hold(self.link.send(t0, sent + vote_bytes, rounds + vote_rounds), t0)
        return Synced(
            loss_total=float(votes[0]),
            stop=bool(votes[1] > 0),
            bytes_sent=sent + vote_bytes,
            messages=rounds + vote_rounds,
            compressed=compressed,
        )

    def state_dict(self) -> dict:
        """DeepSpeed's state per parameter, keyed by position in ``model.parameters()``, without its errors."""
        state = self.optimizer.state_dict()
        group = {k: v for k, v in state["param_groups"][0].items() if k not in ("params", "exp_avg_mask")}
        entries = state["state"]
        if self.flat is None:
            per_param = {self.index[i]: s for i, s in entries.items()}
        elif entries:
            # The flat parameter's moments, cut back into the tensors; counters hold for every tensor.
            split = {k: self.flat.split(entries[0][k]) for k in PER_ELEMENT if k in entries[0]}
            per_param = {
                g: {k: split[k][j] if k in split else v for k, v in entries[0].items()}
                for j, g in enumerate(self.index)
            }
        else:
            per_param = {}
        return {
            "state": {g: {k: v for k, v in s.items() if k not in DEEPSPEED_REDERIVED} for g, s in per_param.items()},
            "param_groups": [group | {"params": self.index}],
        }

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's parameters' entries of a whole-model state; DeepSpeed resets the compression errors."""
        mine = {
            i: {k: v for k, v in state["state"][g].items() if k not in DEEPSPEED_REDERIVED}
            for i, g in enumerate(self.index)
            if g in state["state"]
        }
        hyper = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        if self.flat is None:
            local = mine
            groups = [{**hyper, "params": list(range(len(self.index)))}]
        elif len(mine) == len(self.index) > 0:
            # All of this rank's tensors have state, or none (before the first step).
            joined = {k: self.flat.join([mine[i][k] for i in range(len(mine))]) for k in PER_ELEMENT if k in mine[0]}
            local = {0: mine[0] | joined}
            groups = [{**hyper, "params": [0]}]
        else:
            local, groups = {}, [{**hyper, "params": [0]}]
        opt = self.optimizer
        opt.load_state_dict({"state": local, "param_groups": groups})
        if not local:
            return
        # A fresh optimizer's first step() only initialises, and after a load in the compressed
        # phase it would also switch compression off for the step after it while the engine's
        # all-reduce stays off (the load turned it off): un-reduced local gradients would be
        # applied and the ranks would drift apart. The loaded state is initialised.
        opt.initialize = True
        if hasattr(opt, "var_freeze_step"):
            # ZeroOneAdam's load sets `var_freeze_key`, which its step() never reads: restore
            # `freeze_key` as its last step left it. Finding no error buffers, its next step
            # restarts its intervals at 1, so a step inside the warm-up updates the variance
            # from the gradient and needs the engine's all-reduce, whatever the load decided.
            steps = next(iter(opt.state.values()))["step"]  # every parameter steps together
            opt.freeze_key = steps > opt.var_freeze_step
            self.engine.enable_backward_allreduce = not opt.freeze_key


def onebit_bucket(buckets: list[Bucket], optimizer: str) -> Bucket:
    """The one bucket a 1-bit optimizer runs on in a pipelined plan, or a one-line ConfigError naming the plan's shape.

    Every rank decides on every rank's buckets (one ``all_gather_object``), so no rank enters
    DeepSpeed while another raises.
    """
    mine = [
        tuple(dist.get_process_group_ranks(b.group)) if b.group is not None else (dist.get_rank(),) for b in buckets
    ]
    everyone: list[list[tuple[int, ...]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    unfit = [(rank, sets) for rank, sets in enumerate(everyone) if len(sets) != 1 or len(sets[0]) < 2]
    if unfit:
        rank, sets = unfit[0]
        raise ConfigError(
            f"optimizer.name: {optimizer} on a pipelined plan needs each rank's layers summed over one set of "
            f"two or more ranks (pipelines all cut alike), but rank {rank}'s are summed over rank sets {sets}; "
            f"use adam, or a plan whose pipelines are all cut alike"
        )
    return buckets[0]


def make_sync(
    model: torch.nn.Module,
    cfg: RunConfig,
    device: torch.device,
    precision: str | None,
    buckets: list[Bucket] | None = None,
    link: EmulatedLink | None = None,
    shard_weights: Sequence[float] | None = None,
    tp_degree: int = 1,
    zero_stage: int = 0,
    layers: Sequence[torch.nn.Module] | None = None,
    shard_group: tuple[dist.ProcessGroup | None, Sequence[int]] | None = None,
):
    """The synchroniser the config asks for; ``buckets`` when this rank holds part of the model; ``link``: the
    emulated link its messages are held to; ``shard_weights``: each rank's share of ZeRO's shards;
    ``tp_degree``: the members of this rank's tensor-parallel stage; ``zero_stage``: the plan's; ``layers``:
    the workload's, which ZeRO-2 and 3 cut and gather by; ``shard_group``: the process group and ranks ZeRO
    shards over (``None``: the world; a pipelined plan's stage replicas, ``pipeline.shard_group``)."""
    if cfg.optimizer.name == "adam":
        return TorchAdam(
            model, cfg, device, precision, buckets, link, shard_weights, tp_degree, zero_stage, layers, shard_group
        )
    bucket = onebit_bucket(buckets, cfg.optimizer.name) if buckets is not None else None
    return DeepSpeedOnebit(model, cfg, device, bucket, link)
