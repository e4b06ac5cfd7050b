"""An emulated GPU: real computation on CPU under the type's memory cap, at a speed set one of two ways.

- *padded*: each step is padded to the type's modelled time. Relative speeds come
  from the catalog (peak FLOP/s at the device's precision times one efficiency);
  ``dilation`` stretches every modelled time so that it exceeds what this CPU really
  needs, which is what makes padding possible.
- *throttled*: the process runs in a cgroup holding a share of one core
  (``cluster/cpu_slices.py``); compute takes the time it really takes and nothing
  here knows the share. Only communication over a named link is padded.

Memory is enforced on what the step really saves for backward, measured with
autograd's saved-tensor hooks, so an emulated OOM is a measured one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hetero_ray.cluster.catalog import GpuSpec
from hetero_ray.plan.cost import activation_scale, compute_seconds, link_seconds, ring_allreduce_bytes

GiB = 2**30


class EmulatedOOM(torch.OutOfMemoryError):
    """The emulated device's memory cap was exceeded (caught like a CUDA OOM)."""


def sleep_until(target: float) -> bool:
    """Sleep until ``time.perf_counter()`` reaches ``target``; False if it already had."""
    remaining = target - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
    return remaining > 0


@dataclass(kw_only=True)
class EmulatedDevice:
    """One emulated GPU of type ``spec`` as seen by the worker that drives it."""

    spec: GpuSpec
    precision: str
    flops_per_sample: float
    efficiency: float
    dilation: float
    # False: a throttled device, whose compute is timed, never padded.
    padded: bool = True
    overrun_steps: int = field(default=0, init=False)
    # Most bytes held at once under ``memory_cap``: weights and optimizer state plus live activations.
    peak_bytes: float = field(default=0.0, init=False)
    # Changed by emulated events: a throttled device (speed < 1), a device with less memory.
    speed: float = field(default=1.0, init=False)
    memory_bytes: int = field(default=0, init=False)
    # Modelled seconds of the tensor-parallel all-reduces so far, which a padded stage adds to its compute.
    all_reduce_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.memory_bytes = self.spec.memory_bytes

    def modelled_seconds(self, samples: int) -> float:
        """Wall time this step's compute is padded to: the GPU's modelled time × dilation."""
        return self.dilation * compute_seconds(
            self.spec, self.precision, samples * self.flops_per_sample, self.efficiency * self.speed
        )

    def pad(self, started: float, samples: int) -> float:
        """Sleep until the step that began at ``started`` has taken its modelled compute time.

        Returns the modelled time. When the CPU was slower than the model, the step
        is not padded and ``overrun_steps`` counts it: the figure is then not the
        emulated GPU's, and reports say so. A throttled device returns the time the
        step really took.
        """
        if not self.padded:
            return time.perf_counter() - started
        modelled = self.modelled_seconds(samples)
        if not sleep_until(started + modelled):
            self.overrun_steps += 1
        return modelled

    def all_reduce_hook(self, link: tuple[float, float], members: int) -> Callable[[torch.Tensor, float], None]:
        """Hold each all-reduce of a tensor-parallel group of ``members`` to the named ``link`` (bandwidth
        bytes/s, latency s), as the planner prices it: a ring's bytes ÷ bandwidth + 2(members − 1) latencies,
        × dilation, from when it began (loopback's own time counts toward it)."""

        def hold(reduced: torch.Tensor, started: float) -> None:
            payload = reduced.numel() * reduced.element_size()
            seconds = self.dilation * link_seconds(ring_allreduce_bytes(payload, members), 2 * (members - 1), *link)
            sleep_until(started + seconds)
            self.all_reduce_s += seconds

        return hold

    @contextmanager
    def memory_cap(self, model: torch.nn.Module, static_bytes: int) -> Iterator[None]:
        """Raise ``EmulatedOOM`` when weights, optimizer state and live saved activations exceed the type's memory.

        A saved tensor is live from when autograd saves it until its backward unpacks it
        (a graph is not kept for a second backward), so a pipeline schedule that starts
        backwards early (1F1B) is charged for what it really holds.
        """
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        scale = activation_scale(self.precision)
        cap = self.memory_bytes
        live: dict[int, list[int]] = {}  # storage → [saved tensors using it, bytes]
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in params:
                return t
            entry = live.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:
                total[0] += entry[1]
            entry[0] += 1
            used = static_bytes + scale * total[0]
            self.peak_bytes = max(self.peak_bytes, used)
            if used > cap:
                raise EmulatedOOM(
                    f"emulated {self.spec.name} out of memory: {used / GiB:.3g} GiB needed, {cap / GiB:.3g} GiB available"
                )
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            entry = live.get(t.untyped_storage()._cdata)
            if entry:
                entry[0] -= 1
                if entry[0] == 0:
                    total[0] -= entry[1]
                    del live[t.untyped_storage()._cdata]
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


# A backward pass costs about twice its forward (two matrix products per one).
FORWARD_SHARE = 1 / 3


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``hook``: placed at a stage's output (its backward runs first)
    and at its input (its backward runs last)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, hook) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hook(grad)
        return grad, None


class PaddedModule(torch.nn.Module):
    """A pipeline stage's layers on an emulated device: each micro-batch's forward and backward
    padded to their modelled times (a third and two thirds of ``emu.modelled_seconds``).

    The backward clock starts when the output's gradient arrives and stops when the
    input's gradient leaves; a stage fed integer tokens starts its backward clock's end
    after its first layer (an embedding lookup, whose backward is a cheap scatter).
    ``busy_s`` adds up the modelled time, for utilisation; on a throttled device,
    nothing is padded and ``busy_s`` adds up the time compute really took.

    With a ``link`` (bytes/s, latency s), each message this stage receives from a
    neighbour (activations forward unless it is the first stage, their gradient
    backward unless it is the last) arrives after bytes ÷ bandwidth + latency, as the
    planner prices it (``plan.cost.p2p_seconds``), × dilation as all emulated communication.
    """

    def __init__(
        self,
        layers: torch.nn.Sequential,
        emu: EmulatedDevice,
        micro_batch: int,
        *,
        link: tuple[float, float] | None = None,
        first: bool = True,
        last: bool = True,
    ):
        super().__init__()
        self.layers = layers
        self.micro_batch = micro_batch
        self.emu = emu
        self.link, self.first, self.last = link, first, last
        self.busy_s = 0.0
        self._backward_started = 0.0
        self._backward_reduced = 0.0

    def _receive(self, message: torch.Tensor) -> None:
        """Wait out a received message's time on the link (× dilation, as all emulated communication)."""
        bandwidth, latency = self.link
        time.sleep(self.emu.dilation * link_seconds(message.numel() * message.element_size(), 1, bandwidth, latency))

    def _start_backward(self, grad: torch.Tensor) -> None:
        if self.link and not self.last:
            self._receive(grad)
        self._backward_started = time.perf_counter()
        self._backward_reduced = self.emu.all_reduce_s

    def _finish(self, started: float, share: float, reduced_before: float) -> None:
        """Pad the part of a micro-batch that began at ``started`` to ``share`` of its modelled time, plus the
        modelled time of the tensor-parallel all-reduces inside it (``all_reduce_s`` was ``reduced_before``
        then); a throttled device: count the time it took."""
        if not self.emu.padded:
            self.busy_s += time.perf_counter() - started
            return
        modelled = self.emu.modelled_seconds(self.micro_batch) * share + self.emu.all_reduce_s - reduced_before
        if not sleep_until(started + modelled):
            self.emu.overrun_steps += 1
        self.busy_s += modelled

    def _end_backward(self, grad: torch.Tensor) -> None:
        self._finish(self._backward_started, 1 - FORWARD_SHARE, self._backward_reduced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.link and not self.first:
            self._receive(x)
        started, reduced = time.perf_counter(), self.emu.all_reduce_s
        rest = self.layers
        if not x.is_floating_point():
            x, rest = self.layers[0](x), self.layers[1:]
        if torch.is_grad_enabled() and x.requires_grad:
            x = _Mark.apply(x, self._end_backward)
        out = rest(x)
        self._finish(started, FORWARD_SHARE, reduced)
        return _Mark.apply(out, self._start_backward) if out.requires_grad else out
