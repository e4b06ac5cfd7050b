"""What a user's own training loop calls, as a Ray Train loop calls ``ray.train.torch.prepare_model`` and
``prepare_data_loader``: the model's backward then gives every worker the full-batch mean gradient, and each
worker's loader yields its share of every global batch, in proportion to its speed.

A user loop, the rest is plain PyTorch (any optimizer, ``clip_grad_norm_``, any ``lr_scheduler``) and Ray
Train (``ray.train.report``, ``ray.train.get_checkpoint``)::

    def train_loop_per_worker(config):
        model = prepare_model(build_model())
        loader = prepare_data_loader(DataLoader(dataset, batch_size=GLOBAL_BATCH))
        optimizer = torch.optim.AdamW(model.parameters())
        for batch in loader:
            model(batch).loss.backward()  # the mean over this worker's share
            optimizer.step()
            optimizer.zero_grad()
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import ray.data
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from hetero_ray.config import ConfigError
from hetero_ray.train.buckets import WIRE_DTYPES, Bucket, EmulatedLink, GradBuckets
from hetero_ray.train.context import WorkerContext, get_context
from hetero_ray.train.data import GlobalBatches
from hetero_ray.train.precision import autocast


class HeteroModel(torch.nn.Module):
    """A module whose backward ends with its gradients summed over the workers, each weighted by its worker's
    share of the global batch (``prepare_model``); ``module`` is the user's, on this worker's device.

    Like DDP, every forward in training mode with gradients on makes the backward that follows end the step's
    accumulation: it puts gradient buckets on the wire as they fill and returns once all are summed. Forwards
    inside ``no_sync()`` accumulate locally (micro-batches). Forwards run in the worker's compute precision
    (autocast), on an emulated device under its memory cap and, on a padded one, its modelled time.
    """

    def __init__(self, module: torch.nn.Module, ctx: WorkerContext):
        super().__init__()
        cfg = ctx.config
        self.module = module.to(ctx.device)
        self._ctx = ctx
        link = cfg.link
        self._link = (
            EmulatedLink(link.bandwidth_bytes_s, link.latency_s, ctx.emu.dilation, overlapped=not ctx.emu.padded)
            if ctx.emu and link
            else None
        )
        self.grads = GradBuckets(
            [Bucket(None, ctx.world_size, list(self.module.parameters()))],
            wire=WIRE_DTYPES[cfg.train.reduce_dtype],
            bucket_bytes=int(cfg.train.bucket_mb * 2**20),
            link=self._link,
            scale=ctx.share,
        )
        # Registered after the buckets' own hooks, so it sees a parameter once its chunk has counted it.
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._first_gradient)
        self._sync = True
        self._armed = False
        self._step_started: float | None = None
        # Weights and optimizer state (Adam's two moments) beside the activations, as the planner counts them.
        self._static_bytes = ctx.footprint.static_bytes

    def forward(self, *args, **kwargs):
        training = self.training and torch.is_grad_enabled()
        if training:
            if self._step_started is None:
                self._step_started = time.perf_counter()
            if self._sync:
                self.grads.arm()
                self._armed = True
        emu = self._ctx.emu
        with emu.memory_cap(self.module, self._static_bytes) if emu and training else nullcontext():
            with autocast(self._ctx.precision, self._ctx.device):
                return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside accumulate gradients without summing them over the workers."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _first_gradient(self, _param: torch.Tensor) -> None:
        if self._armed:
            self._armed = False
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        """The end of the step's last backward: a padded device waits out its modelled compute time, then the
        buckets still on the wire are summed."""
        emu = self._ctx.emu
        if emu is not None:
            emu.pad(self._step_started, self._ctx.local_batch)
        self._step_started = None
        self.grads.finish()

    @property
    def comm_overruns(self) -> int:
        """Times the loopback was slower than the emulated link (0 without one)."""
        return self._link.overruns if self._link else 0


def prepare_model(model: torch.nn.Module) -> HeteroModel:
    """Wrap ``model`` for this worker (``HeteroModel``): on its device, computing in its precision, its
    backward giving every worker the full-batch mean gradient when the loss is the mean over the worker's
    samples. The same seed on every worker gives identical initial weights; they then stay identical."""
    ctx = get_context()
    if ctx.role is None:
        raise ConfigError(
            f"prepare_model: the plan gives worker {ctx.rank} ({ctx.gpu_type}) no samples; own loops need every "
            "worker in the plan (elastic runs and excluded devices run the built-in loop)"
        )
    if ctx.plan.is_pipelined:
        raise ConfigError(
            "prepare_model: the plan pipelines the model or splits its layers across devices, which an own loop "
            "cannot step; raise devices' memory, lower train.global_batch, set train.max_tensor_parallel: 1, or "
            "run the built-in loop"
        )
    if ctx.precision == "fp16":
        raise ConfigError(
            f"prepare_model: worker {ctx.rank} ({ctx.gpu_type}) would compute in fp16, which needs the built-in "
            "loop's loss scaler; set train.precision: fp32"
        )
    return HeteroModel(model, ctx)


class ShareSampler(Sampler[list[int]]):
    """This worker's part of each global batch: a seeded permutation per epoch cut into global batches
    (``train/data.GlobalBatches``, as the built-in loop draws them), of which the worker takes its
    ``[offset, offset + local_batch)``. ``set_epoch`` as ``DistributedSampler``'s."""

    def __init__(self, batches: GlobalBatches, offset: int, local_batch: int):
        self.batches, self.offset, self.local_batch = batches, offset, local_batch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        first = self.epoch * self.batches.steps_per_epoch
        for step in range(first, first + len(self)):
            yield self.batches.indices(step)[self.offset : self.offset + self.local_batch].tolist()


class DatasetShare:
    """This worker's share of each global batch of a Ray Data dataset: the dataset streamed in global batches,
    in its order, of which the worker keeps rows ``[offset, offset + local_batch)``.

    Every worker streams the whole dataset: Ray Data splits a dataset only evenly (``streaming_split``), and
    an uneven split must cut each global batch, not the dataset. Fine while a worker reads faster than it
    trains; shuffle with a seed (``random_shuffle(seed=…)``) so every worker sees one order.
    """

    def __init__(self, dataset: ray.data.Dataset, offset: int, local_batch: int, global_batch: int):
        self.dataset, self.offset, self.local_batch, self.global_batch = dataset, offset, local_batch, global_batch
        # Without it Ray Data may hand blocks over in the order they finish, which differs between workers.
        dataset.context.execution_options.preserve_order = True

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        end = self.offset + self.local_batch
        for batch in self.dataset.iter_torch_batches(batch_size=self.global_batch, drop_last=True):
            yield {k: v[self.offset : end] for k, v in batch.items()}


def prepare_data_loader(loader: DataLoader | ray.data.Dataset, seed: int | None = None) -> DataLoader | DatasetShare:
    """``loader`` over the same data, yielding this worker's share of each global batch.

    A ``DataLoader``'s ``batch_size`` must be the run's global batch; its samples are drawn as the built-in
    loop draws them (a permutation per epoch seeded by ``seed``, by default ``train.seed``; the loader's own
    sampler is replaced, as Ray Train's ``prepare_data_loader`` replaces it with a ``DistributedSampler``).
    A Ray Data ``Dataset`` becomes a ``DatasetShare``: dicts of tensors, in the dataset's order.
    """
    ctx = get_context()
    if isinstance(loader, ray.data.Dataset):
        return DatasetShare(loader, ctx.role.sample_offset, ctx.local_batch, ctx.global_batch)
    if loader.batch_size != ctx.global_batch:
        raise ConfigError(
            f"prepare_data_loader: the loader's batch_size is {loader.batch_size}, not the run's global batch "
            f"{ctx.global_batch}; give it the global batch (each worker then gets its share)"
        )
    batches = GlobalBatches(len(loader.dataset), ctx.global_batch, ctx.config.train.seed if seed is None else seed)
    return DataLoader(
        loader.dataset,
        batch_sampler=ShareSampler(batches, ctx.role.sample_offset, ctx.local_batch),
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
    )


def all_reduce_mean(value: float) -> float:
    """``value`` weighted by this worker's share and summed over the workers: the global batch's mean of a
    per-worker mean (a loss), the same on every worker. Every worker must call it."""
    total = torch.tensor([value * get_context().share], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)
