"""What one worker of a run is: its device, its place in the plan, its part of each batch.

``setup_worker`` runs first on every worker a ``HeteroTrainer`` starts (the built-in loop and a user's own
loop alike): it finds the worker's GPU type, agrees on the plan with the other workers and enters the
emulated device. The loop then reads it through ``get_context()``, as a Ray Train loop reads
``ray.train.get_context()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hetero_ray.cluster.catalog import Catalog, load_catalog
from hetero_ray.cluster.emulated_device import EmulatedDevice
from hetero_ray.config import RunConfig
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.cost import RECOMPUTE_FACTOR
from hetero_ray.plan.plan import Plan, WorkerRole
from hetero_ray.train.device import enter_device, torch_device, worker_gpu_type
from hetero_ray.train.precision import compute_precision
from hetero_ray.train.prepare import plan_for


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """One worker's view of the run (``get_context()``).

    ``role`` is ``None`` for a worker the plan gives no samples (an elastic run's spare). ``precision`` is
    what the worker computes in (``None`` without a role); ``emu`` the emulated device it drives, if any.
    """

    config: RunConfig
    footprint: Footprint
    catalog: Catalog
    plan: Plan
    rank_types: list[str]
    roles: list[WorkerRole | None]
    device: torch.device
    emu: EmulatedDevice | None
    precision: str | None
    efficiency: float
    dilation: float | None
    # The claim on a throttled device's CPU slice, held for the worker's life.
    device_slice: Any = None

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return len(self.rank_types)

    @property
    def gpu_type(self) -> str:
        return self.rank_types[self.rank]

    @property
    def role(self) -> WorkerRole | None:
        return self.roles[self.rank]

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    @property
    def local_batch(self) -> int:
        """Samples of each global batch this worker computes (0 without a role)."""
        return self.role.local_batch if self.role else 0

    @property
    def micro_batch(self) -> int:
        """The largest batch this worker runs at once: its local batch is accumulated in micro-batches of it."""
        return self.role.micro_batch if self.role else 0

    @property
    def share(self) -> float:
        """This worker's fraction of each global batch."""
        return self.local_batch / self.global_batch

    @property
    def emulated(self) -> bool:
        return self.config.emulation is not None


_CURRENT: ContextVar[WorkerContext | None] = ContextVar("hetero_ray_worker", default=None)


def get_context() -> WorkerContext:
    """This worker's context; only inside a ``HeteroTrainer``'s ``train_loop_per_worker``."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "hetero_ray.train.get_context: no hetero-ray worker here; call it inside the train_loop_per_worker "
            "a HeteroTrainer runs"
        )
    return ctx


@contextmanager
def active(ctx: WorkerContext) -> Iterator[WorkerContext]:
    """Make ``ctx`` what ``get_context()`` returns while the loop runs."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def setup_worker(payload: dict[str, Any]) -> WorkerContext:
    """Everything a worker settles before its loop: device, plan (the driver's when it fits these workers),
    role, emulated device and compute precision. Every worker must call it (two collectives)."""
    cfg = RunConfig.model_validate(payload["config"])
    footprint = Footprint.from_dict(payload["footprint"])
    catalog = load_catalog(cfg.gpus_file)
    gpu_type, emulated = worker_gpu_type(catalog)
    device_slice = enter_device(cfg, emulated)
    rank_types: list[str] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(rank_types, gpu_type)
    plan = _plan(payload, cfg, rank_types, catalog, footprint, emulated)
    roles = plan.roles_for(rank_types)
    role = roles[dist.get_rank()]
    device = torch_device(emulated)
    if emulated:
        # Workers share this machine's cores; one thread each keeps them from fighting.
        torch.set_num_threads(1)
    emu = (
        EmulatedDevice(
            spec=catalog.get(gpu_type),
            precision=role.precision,
            flops_per_sample=_flops_per_sample(footprint, role, plan),
            efficiency=payload["efficiency"],
            dilation=payload["dilation"],
            padded=device_slice is None,
        )
        if emulated and role
        else None
    )
    precision = (
        compute_precision(role.precision, device, bool(cfg.emulation and cfg.emulation.autocast)) if role else None
    )
    return WorkerContext(
        config=cfg,
        footprint=footprint,
        catalog=catalog,
        plan=plan,
        rank_types=rank_types,
        roles=roles,
        device=device,
        emu=emu,
        precision=precision,
        efficiency=payload["efficiency"],
        dilation=payload["dilation"],
        device_slice=device_slice,
    )


def _flops_per_sample(footprint: Footprint, role: WorkerRole, plan: Plan) -> float:
    """FLOPs of one sample on this worker: its stage's layers under a pipeline (a tensor-parallel member's
    share of them, by its weight), with recomputation if any."""
    # A pipelined plan may keep one whole-model replica beside its staged pipelines (layers None).
    flops = (
        sum(
            footprint.layers[i].part(role.tp_share).flops_per_sample
            for i in range(*(role.layers or (0, len(footprint.layers))))
        )
        if plan.is_pipelined
        else footprint.flops_per_sample
    )
    return flops * (RECOMPUTE_FACTOR if role.activation_checkpointing else 1.0)


def _plan(payload, cfg: RunConfig, rank_types, catalog, footprint, emulated: bool) -> Plan:
    """The plan the driver chose (``--plan``) when it fits these workers (all its devices, or those it gives
    samples when its excluded ones were not started), else one made for them."""
    if payload.get("plan") is not None:
        plan = Plan.from_dict(payload["plan"])
        working = [r.gpu_type for r in plan.roles]
        excluded = [e.gpu_type for e in plan.excluded for _ in range(e.count)]
        if sorted(rank_types) in (sorted(working), sorted(working + excluded)):
            return plan
    return plan_for(cfg, rank_types, catalog, footprint, payload["efficiency"], emulated=emulated)
