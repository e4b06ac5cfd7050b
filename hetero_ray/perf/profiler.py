"""Short timed runs of a workload's training step on the local device, one history row per point.

A point is (micro-batch, precision). Each step is forward + backward + optimizer
step (AdamW, as the runtime trains) on the first ``micro_batch`` samples of the
workload's dataset. After ``warmup`` untimed steps per point, the timed repeats run
in rounds across the micro-batches (one step of each per round), so a change in the
machine's load mid-profile touches every point alike instead of one; each point
keeps the median of its repeats and their interquartile range.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over one step; on a CPU or
an emulated device, which have no allocator statistics, the bytes of parameters,
gradients and optimizer state plus the bytes autograd saves for backward (the
quantity the emulated memory cap enforces).

On a padded emulated device the step time is the type's modelled time (catalog peak ×
efficiency, undilated) and the row says ``emulated=True``; the real step still runs
once per point, to measure memory and enforce the type's memory as a cap. A
throttled emulated device is timed like a real one (wall clock: its CPU share is
what makes it slow), under the type's memory cap, and its rows say ``emulated=True``.

Half precisions run under autocast, as training does; fp16 steps run without a loss
scaler (a few elementwise operations per step).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import default_collate

from hetero_ray.cluster.catalog import PRECISIONS, GpuSpec
from hetero_ray.cluster.emulated_device import EmulatedDevice, EmulatedOOM
from hetero_ray.perf.footprint import saved_activation_bytes
from hetero_ray.perf.history import CPU, CUDA_MEMORY, HOST_MEMORY, Measurement, options_hash, options_json
from hetero_ray.plan.cost import activation_scale
from hetero_ray.suggest import did_you_mean
from hetero_ray.train.precision import autocast, compute_precision
from hetero_ray.workloads import Workload

# Shortest timed run of steps per repeat on a throttled device: fifty of its 10 ms CFS periods.
THROTTLED_REPEAT_S = 0.5

ProgressFn = Callable[[int, int], None]
Clock = Literal["wall", "thread_cpu"]
CLOCKS: tuple[Clock, ...] = get_args(Clock)


class ProfileError(ValueError):
    """A profile request that cannot run as asked; the message names the field and what is valid."""


@dataclass(frozen=True, kw_only=True)
class ProfileSpec:
    """What to measure: micro-batches × precisions, with warm-up and repeats per point."""

    micro_batches: tuple[int, ...]
    precisions: tuple[str, ...] = ("fp32",)
    warmup: int = 2
    """Untimed steps per point before the timed ones (allocator, caches, lazy init)."""
    repeats: int = 7
    """Timed steps per point; the row keeps their median."""
    threads: int | None = 1
    """torch intra-op threads on a CPU (1: the figure does not depend on the neighbours' load); None keeps torch's."""
    clock: Clock = "wall"
    """What a timed step counts: wall time (CUDA synchronised), or on a CPU with one thread that thread's CPU
    time, which leaves out the time slices a shared host gives to other processes."""

    def __post_init__(self) -> None:
        if not self.micro_batches or any(not isinstance(b, int) or b < 1 for b in self.micro_batches):
            raise ProfileError(f"micro_batches: need positive integers (got {list(self.micro_batches)})")
        bad = [p for p in self.precisions if p not in PRECISIONS]
        if not self.precisions or bad:
            raise ProfileError(
                f"precisions: {', '.join(bad) or 'none given'} not known"
                f"{did_you_mean(bad[0], PRECISIONS) if bad else ''}; valid: {', '.join(PRECISIONS)}"
            )
        if self.warmup < 0 or self.repeats < 1:
            raise ProfileError(f"warmup must be >= 0 and repeats >= 1 (got {self.warmup}, {self.repeats})")
        if self.threads is not None and self.threads < 1:
            raise ProfileError(f"threads: must be >= 1 or None (got {self.threads})")
        if self.clock not in CLOCKS:
            raise ProfileError(f"clock: {self.clock!r} not known; valid: {', '.join(CLOCKS)}")
        if self.clock == "thread_cpu" and self.threads != 1:
            raise ProfileError(f"clock: thread_cpu counts one thread's time; it needs threads=1 (got {self.threads})")
        object.__setattr__(self, "micro_batches", tuple(sorted(set(self.micro_batches))))
        object.__setattr__(self, "precisions", tuple(dict.fromkeys(self.precisions)))

    def steps(self, modelled: bool) -> int:
        """Steps the profile runs per precision (what a progress bar counts); ``modelled``: a padded device."""
        per_point = 2 if modelled else 1 + self.warmup + self.repeats
        return per_point * len(self.micro_batches)


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A point not measured, and why (out of memory, precision the device lacks, too little data)."""

    micro_batch: int
    precision: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    """Rows measured and points skipped, in (precision, micro-batch) order."""

    measurements: tuple[Measurement, ...]
    skipped: tuple[Skipped, ...]


@dataclass(frozen=True, kw_only=True)
class Emulation:
    """What prices a padded emulated device's step (its catalog entry, the efficiency, the workload's FLOPs),
    or, for a throttled one (``padded=False``), only its memory and precisions."""

    spec: GpuSpec
    efficiency: float
    flops_per_sample: float
    padded: bool = True


@dataclass(frozen=True, kw_only=True)
class Target:
    """The device a profile runs on: a CPU, a real GPU, or an emulated one (``emulated`` set)."""

    gpu_type: str = CPU
    device: torch.device = torch.device("cpu")
    emulated: Emulation | None = None


def _step(workload: Workload, model: torch.nn.Module, optimizer, batch, precision: str, device) -> None:
    # An emulated device computes in fp32, as it trains by default (``emulation.autocast`` off).
    with autocast(compute_precision(precision, device, cpu_autocast=False), device):
        loss = workload.loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(
    workload,
    model,
    optimizer,
    batch,
    precision,
    device,
    clock: str,
    under: Callable[[], AbstractContextManager] = nullcontext,
) -> float:
    """One step's time on ``clock``, the step run inside ``under()``."""
    now = time.thread_time if clock == "thread_cpu" else time.perf_counter
    _sync(device)
    start = now()
    with under():
        _step(workload, model, optimizer, batch, precision, device)
    _sync(device)
    return now() - start


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients (one per parameter) and the optimizer's state tensors, in bytes."""
    params = _tensor_bytes(model.parameters())
    state = _tensor_bytes(v for s in optimizer.state.values() for v in s.values())
    return 2 * params + state


def _host_peak_bytes(workload, model, optimizer, batch, precision, device, scale: float) -> int:
    """Static bytes plus the bytes autograd saved for backward during one step (``scale``: half widths)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen, pack = saved_activation_bytes(params)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(workload, model, optimizer, batch, precision, device)
    return int(_static_bytes(model, optimizer) + scale * sum(seen.values()))


def _cuda_peak_bytes(workload, model, optimizer, batch, precision, device) -> int:
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    _step(workload, model, optimizer, batch, precision, device)
    _sync(device)
    return int(torch.cuda.max_memory_allocated(device))


@contextmanager
def _threads(n: int | None, device: torch.device):
    if n is None or device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tf32(precision: str, device: torch.device) -> AbstractContextManager:
    """TF32 tensor cores for a ``tf32`` point on CUDA; other points keep torch's settings, as training does."""
    if device.type != "cuda" or precision != "tf32":
        return nullcontext()

    @contextmanager
    def allow():
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before

    return allow()


def _unsupported(precision: str, target: Target) -> str | None:
    """Why ``target`` cannot run ``precision``, or None."""
    if target.emulated is not None:
        have = target.emulated.spec.peak_tflops
        return None if precision in have else f"{target.gpu_type} has no {precision} peak (has {', '.join(have)})"
    if target.device.type == "cpu" and precision != "fp32":
        # A CPU computes in fp32 (see compute_precision); a half-precision CPU row would be an fp32 one.
        return "a CPU profiles in fp32 only"
    return None


def profile(
    factory: Callable[[], Workload],
    spec: ProfileSpec,
    *,
    workload_name: str,
    options: Mapping[str, Any],
    target: Target = Target(),
    on_progress: ProgressFn | None = None,
    until: Callable[[], bool] | None = None,
) -> ProfileResult:
    """Measure ``factory()``'s training step at every (micro-batch, precision) of ``spec`` on ``target``.

    ``factory`` builds the workload (the same for every precision; seeded here);
    ``workload_name`` and ``options`` identify it in the rows. ``on_progress(done,
    total)`` is called after every step, with ``total`` fixed from the start.
    ``until``: after the last timed step, keep stepping (untimed) until it returns True, for devices
    profiled together (see ``perf/remote.py``).
    """
    emulated = target.emulated is not None
    modelled = emulated and target.emulated.padded
    if spec.clock == "thread_cpu" and (emulated or target.device.type != "cpu"):
        # A throttled device's slowness is the time it waits for its CPU share, which its thread clock omits.
        raise ProfileError("clock: thread_cpu times a CPU's own work; use wall on a GPU or an emulated device")
    total = spec.steps(modelled) * len(spec.precisions)
    done = 0

    def advance(n: int = 1) -> None:
        nonlocal done
        done += n
        if on_progress is not None:
            on_progress(done, total)

    rows: list[Measurement] = []
    skipped: list[Skipped] = []
    reasons = {p: _unsupported(p, target) for p in spec.precisions}
    supported = [p for p, reason in reasons.items() if not reason]
    with _threads(spec.threads, target.device):
        for precision, reason in reasons.items():
            if reason:
                skipped += [Skipped(micro_batch=b, precision=precision, reason=reason) for b in spec.micro_batches]
                advance(spec.steps(modelled))
                continue
            with _tf32(precision, target.device):
                last = precision == supported[-1]
                points, lost = _profile_precision(factory, spec, precision, target, advance, until if last else None)
            skipped += lost
            identity = {
                "workload": workload_name,
                "workload_hash": options_hash(options),
                "workload_options": options_json(options),
                "gpu_type": target.gpu_type,
                "emulated": emulated,
                "precision": precision,
                "threads": torch.get_num_threads() if target.device.type == "cpu" else 0,
                "clock": "modelled" if modelled else spec.clock,
            }
            rows += [Measurement(**identity, **p) for p in points]
    return ProfileResult(measurements=tuple(rows), skipped=tuple(skipped))


def _profile_precision(
    factory: Callable[[], Workload],
    spec: ProfileSpec,
    precision: str,
    target: Target,
    advance: Callable[..., None],
    until: Callable[[], bool] | None,
) -> tuple[list[dict[str, Any]], list[Skipped]]:
    """Measured fields per micro-batch at one precision, and the points skipped."""
    device, emu = target.device, target.emulated
    torch.manual_seed(0)
    workload = factory()
    model = workload.model.to(device)
    # lr = 0: the update's arithmetic runs in full, the weights stay put, so every repeat does the same work.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    batches: dict[int, Any] = {}
    skipped: list[Skipped] = []
    memory: dict[int, int] = {}
    modelled = emu is not None and emu.padded
    per_point = spec.steps(modelled) // len(spec.micro_batches)

    for b in spec.micro_batches:
        if b > len(workload.dataset):
            skipped.append(
                Skipped(micro_batch=b, precision=precision, reason=f"dataset has {len(workload.dataset)} samples")
            )
            advance(per_point)
            continue
        batch = tree_map(lambda t: t.to(device), default_collate([workload.dataset[i] for i in range(b)]))
        try:
            memory[b] = _peak_bytes(workload, model, optimizer, batch, precision, target)
        except torch.OutOfMemoryError as exc:
            _release(model, optimizer, device)
            # A larger micro-batch needs more memory still: skip the rest of this precision.
            for rest in (m for m in spec.micro_batches if m >= b):
                skipped.append(Skipped(micro_batch=rest, precision=precision, reason=f"out of memory: {exc}"[:200]))
            advance(per_point * sum(1 for m in spec.micro_batches if m >= b))
            break
        batches[b] = batch
        advance()

    device_model = (
        EmulatedDevice(
            spec=emu.spec,
            precision=precision,
            flops_per_sample=emu.flops_per_sample,
            efficiency=emu.efficiency,
            dilation=1.0,
            padded=emu.padded,
        )
        if emu is not None
        else None
    )
    if modelled:
        # The type's modelled step, undilated: the emulated device's own model, with nothing to repeat.
        rows = []
        for b in batches:
            rows.append(_fields(b, [device_model.modelled_seconds(b)], memory[b], HOST_MEMORY, repeats=0))
            advance()
        return rows, skipped

    # A throttled device trains under its memory cap, whose saved-tensor hooks cost a V100 slice 2 % of its step
    # (measured): its profile times its steps under the same hooks.
    under = functools.partial(device_model.memory_cap, model, 0) if device_model is not None else nullcontext

    def timed(batch) -> float:
        return _timed_step(workload, model, optimizer, batch, precision, device, spec.clock, under)

    block = {b: 1 for b in batches}
    for b, batch in batches.items():
        for _ in range(spec.warmup):
            warm = timed(batch)
            advance()
        if emu is not None and spec.warmup:
            # A throttled device runs its quota at full speed, then waits out the period: a step shorter than a
            # few periods would time the burst. Each repeat times enough steps in a row to span them.
            block[b] = max(1, math.ceil(THROTTLED_REPEAT_S / warm))
    times: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(spec.repeats):
        for b, batch in batches.items():
            run = [timed(batch) for _ in range(block[b])]
            times[b].append(sum(run) / block[b])
            advance()
    if until is not None and batches:
        # Devices profiled together share the host as they share it in training; one that stopped when its own
        # points were done would leave the slower ones timed on a quieter host than any step of the run sees.
        batch = batches[max(batches)]
        while not until():
            _step(workload, model, optimizer, batch, precision, device)
    source = CUDA_MEMORY if device.type == "cuda" else HOST_MEMORY
    return [_fields(b, times[b], memory[b], source, repeats=len(times[b])) for b in batches], skipped


def _peak_bytes(workload, model, optimizer, batch, precision: str, target: Target) -> int:
    """One untimed step's peak memory; raises ``torch.OutOfMemoryError`` (or the emulated kind)."""
    if target.device.type == "cuda":
        return _cuda_peak_bytes(workload, model, optimizer, batch, precision, target.device)
    emu = target.emulated
    scale = activation_scale(precision) if emu is not None else 1.0
    used = _host_peak_bytes(workload, model, optimizer, batch, precision, target.device, scale)
    if emu is not None and used > emu.spec.memory_bytes:
        raise EmulatedOOM(
            f"emulated {emu.spec.name}: {used / 2**30:.2f} GiB needed, {emu.spec.memory_gib:g} GiB available"
        )
    return used


def _release(model, optimizer, device: torch.device) -> None:
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fields(b: int, times: list[float], peak: int, source: str, *, repeats: int) -> dict[str, Any]:
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    return {
        "micro_batch": b,
        "step_s": statistics.median(times),
        "step_s_spread": q3 - q1,
        "repeats": repeats,
        "peak_memory_bytes": peak,
        "memory_source": source,
    }
