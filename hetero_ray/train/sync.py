"""How a step's gradients are synchronised and applied.

``TorchAdam``: AdamW over one flat SUM all-reduce. ``DeepSpeedOnebit``: DeepSpeed's
OnebitAdam / ZeroOneAdam through ``deepspeed.initialize``, which average across
ranks (so losses are weighted ``× world``) and switch to 1-bit compressed momentum
after their warm-up. Both give the same interface to the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetero_ray.config import ConfigError, RunConfig
from hetero_ray.plan.cost import onebit_allreduce_bytes, ring_allreduce_bytes
from hetero_ray.train.precision import needs_loss_scaling


@dataclass(frozen=True)
class Synced:
    """What one synchronisation returns: the summed loss, the stop vote, bytes this rank sent."""

    loss_total: float
    stop: bool
    bytes_sent: float
    messages: int
    compressed: bool


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are summed over ``group`` of ``size`` ranks (``None``: the world)."""

    group: dist.ProcessGroup | None
    size: int
    params: list[torch.nn.Parameter]


class TorchAdam:
    """AdamW on the full-batch mean gradient, from one SUM all-reduce of flat gradients per bucket.

    Each micro-batch's loss is weighted ``size / global_batch``, so the sum over
    the ranks holding a parameter is the full-batch mean. Data parallelism has
    one bucket, the whole model over the world; a pipelined plan has one per set
    of ranks holding the same layers. fp16 ranks unscale locally before the
    all-reduce (scales differ by rank), and all ranks skip a step together when any
    gradient is not finite. Optimizer state is saved by position in
    ``model.parameters()``, so a checkpoint loads on any plan.
    """

    loss_weight = 1.0

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: RunConfig,
        device: torch.device,
        precision: str | None,
        buckets: list[Bucket] | None = None,
    ):
        self.buckets = (
            buckets if buckets is not None else [Bucket(None, dist.get_world_size(), list(model.parameters()))]
        )
        self.params = [p for b in self.buckets for p in b.params]
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self.index = [position[id(p)] for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.train.lr, betas=cfg.optimizer.betas, weight_decay=cfg.train.weight_decay
        )
        self.scaler = torch.amp.GradScaler("cuda") if precision and needs_loss_scaling(precision, device) else None
        self.device = device

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _reduce(self, bucket: Bucket) -> bool:
        """Sum the bucket's gradients over its ranks in place; whether they are all finite."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if bucket.size > 1:
            dist.all_reduce(flat, group=bucket.group)
        offset = 0
        for p, g in zip(bucket.params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(p).to(p.dtype)
            offset += g.numel()
        return bool(torch.isfinite(flat).all())

    def step(self, loss_sum: float, stop: bool) -> Synced:
        """All-reduce gradients bucket by bucket, agree on loss, stop and finiteness, then update."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        finite = all([self._reduce(b) for b in self.buckets])
        world = dist.get_world_size()
        votes = torch.tensor([loss_sum, float(stop), float(not finite)], device=self.device)
        dist.all_reduce(votes)
        if votes[2] == 0:
            self.optimizer.step()
        if self.scaler:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        summed = [b for b in self.buckets if b.size > 1]
        return Synced(
            loss_total=float(votes[0]),
            stop=bool(votes[1] > 0),
            bytes_sent=sum(ring_allreduce_bytes(4 * sum(p.numel() for p in b.params), b.size) for b in summed)
            + ring_allreduce_bytes(4 * votes.numel(), world),
            messages=sum(2 * (b.size - 1) for b in summed) + 2 * (world - 1),
            compressed=False,
        )

    def state_dict(self) -> dict:
        """AdamW's state keyed by position in ``model.parameters()``."""
        state = self.optimizer.state_dict()
        return {
            "state": {self.index[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [self.index[i] for i in g["params"]]} for g in state["param_groups"]],
        }

    def load_state_dict(self, state: dict) -> None:
        """Load the entries of this rank's parameters from a whole-model state."""
        local = {g: i for i, g in enumerate(self.index)}
        group = state["param_groups"][0]
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
    return {
        "train_batch_size": world,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": DEEPSPEED_TYPES[opt.name], "params": params},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 2**31 - 1,
    }


class DeepSpeedOnebit:
    """DeepSpeed's OnebitAdam / ZeroOneAdam on the process group Ray Train set up.

    They average across ranks, so each rank's loss is weighted ``× world``. Until the
    warm-up ends the engine all-reduces fp32 gradients; then only 1-bit compressed
    momentum crosses the wire, counted by the backend: DeepSpeed compresses each
    parameter tensor in its own collective, each with its own scale. The loss and
    stop vote take one extra 2-element all-reduce.
    """

    def __init__(self, model: torch.nn.Module, cfg: RunConfig, device: torch.device):
        from hetero_ray.train.onebit import init_distributed_on_gloo, initialize_on_gloo

        self.device = device
        self.world = dist.get_world_size()
        self.numels = [p.numel() for p in model.parameters()]
        self.loss_weight = float(self.world)
        config = deepspeed_config(cfg, self.world, device.type == "cuda")
        if device.type == "cuda":
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl")
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                config=config, model=model, model_parameters=model.parameters()
            )
        else:
            init_distributed_on_gloo()
            self.engine, self.optimizer, _, _ = initialize_on_gloo(
                config=config, model=model, model_parameters=model.parameters()
            )
        self.backend = self.optimizer.comm_backend_handle

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def compressed(self) -> bool:
        """Whether the optimizer is past its warm-up (only compressed momentum is exchanged)."""
        return bool(getattr(self.optimizer, "adam_freeze_key", False) or getattr(self.optimizer, "freeze_key", False))

    def step(self, loss_sum: float, stop: bool) -> Synced:
        """Reduce (fp32 or compressed, as DeepSpeed's phase says) and update."""
        compressed = self.compressed()
        counted = hasattr(self.backend, "bytes_sent")  # ours counts; DeepSpeed's NCCL backend does not
        before = self.backend.bytes_sent if counted else 0
        self.engine.step()
        votes = torch.tensor([loss_sum, float(stop)], device=self.device)
        dist.all_reduce(votes)
        if not compressed:
            sent = ring_allreduce_bytes(4 * sum(self.numels), self.world)
        elif counted:
            sent = self.backend.bytes_sent - before
        else:
            sent = sum(onebit_allreduce_bytes(n, self.world) for n in self.numels)
        return Synced(
            loss_total=float(votes[0]),
            stop=bool(votes[1] > 0),
            bytes_sent=sent,
            # DeepSpeed buckets the fp32 all-reduce; it compresses tensor by tensor.
            messages=(4 * len(self.numels) if compressed else 2) * (self.world - 1),
            compressed=compressed,
        )

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """DeepSpeed resets the compression errors on load (each rank's own, not in the checkpoint)."""
        self.optimizer.load_state_dict(state)


def make_sync(
    model: torch.nn.Module,
    cfg: RunConfig,
    device: torch.device,
    precision: str | None,
    buckets: list[Bucket] | None = None,
):
    """The synchroniser the config asks for; ``buckets`` when this rank holds part of the model."""
    if cfg.optimizer.name == "adam":
        return TorchAdam(model, cfg, device, precision, buckets)
    if buckets is not None:
        raise ConfigError(
            f"optimizer.name: {cfg.optimizer.name} does not run on pipelined plans yet; use adam, or a plan without stages"
        )
    return DeepSpeedOnebit(model, cfg, device)
