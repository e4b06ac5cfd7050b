"""Gradient buckets as DDP keeps them: gradients are views into flat buckets, each bucket all-reduced as soon
as the backward has filled it, the step waiting only for what is still on the wire.

Each ``Bucket`` (parameters summed over one process group) is cut into chunks of at most
``bucket_bytes``, in reverse order of ``params`` (the order the backward reaches them). Every
parameter's ``.grad`` is a view into its chunk's flat tensor, so autograd accumulates micro-batch after
micro-batch in place and no second copy of the gradients exists. During the step's last backward
pass (``arm``), autograd's post-accumulate-grad hooks count the parameters of each chunk; a full chunk
is launched as an asynchronous SUM all-reduce, chunks strictly in order so that every rank issues the
same collectives in the same order (gloo and NCCL match them by order). ``finish`` launches what the
backward did not (a rank without samples, a parameter the step did not use) and waits.

On the wire a chunk is ``wire`` (``train.reduce_dtype``): fp32 reduces the chunk in place; bf16 and
fp16 reduce a half-width copy and copy the sum back into the fp32 chunk, as DDP's compression hooks do.

On an emulated device with a named link (``EmulatedLink``), ``finish`` holds the chunks until the link
would have delivered them, one after another, each from its launch: before the optimizer can apply them.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetero_ray.cluster.emulated_device import sleep_until
from hetero_ray.plan.cost import link_seconds, ring_allreduce_bytes

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are summed over ``group`` of ``size`` ranks (``None``: the world)."""

    group: dist.ProcessGroup | None
    size: int
    params: list[torch.nn.Parameter]


@dataclass(eq=False)
class EmulatedLink:
    """The named link an emulated device's messages are held to: bytes ÷ bandwidth + latency per message round,
    × ``dilation`` as all of a padded device's times. ``overlapped``: messages start when they are sent (a
    throttled device computes in real time); else at the end of the step's compute, which on a padded device
    is not the modelled one. ``overruns`` counts the times loopback was slower than the modelled link."""

    bandwidth_bytes_s: float
    latency_s: float
    dilation: float = 1.0
    overlapped: bool = True
    overruns: int = 0
    _free: float = field(default=-math.inf, init=False, repr=False)  # when all sent so far is delivered

    def send(self, start: float, bytes_sent: float, messages: int) -> float:
        """When (``time.perf_counter``) a message sent at ``start`` is delivered: one message after another, each
        taking bytes ÷ bandwidth + latency per round, × dilation."""
        seconds = link_seconds(bytes_sent, messages, self.bandwidth_bytes_s, self.latency_s)
        self._free = max(self._free, start) + self.dilation * seconds
        return self._free

    def hold(self, until: float, since: float) -> None:
        """Sleep until ``until`` (``time.perf_counter``); past it already, count an overrun unless the messages
        were due before ``since``, when the wait for them began (hidden behind compute)."""
        if not sleep_until(until) and until > since:
            self.overruns += 1


@dataclass(eq=False)
class _Chunk:
    group: dist.ProcessGroup | None
    size: int
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    views: dict[torch.nn.Parameter, torch.Tensor]  # each parameter's gradient in ``flat``
    pending: int = 0  # parameters still to be filled by the armed pass
    wire: torch.Tensor | None = None  # the half-width copy in flight
    work: dist.Work | None = None
    launched_at: float | None = None


@dataclass(frozen=True)
class Launch:
    """One chunk's all-reduce: when it started (``time.perf_counter``), bytes this rank sent, message rounds."""

    at: float
    bytes_sent: float
    messages: int


@dataclass(eq=False)
class GradBuckets:
    """This rank's gradient chunks, their hooks and their in-flight all-reduces (see the module docstring)."""

    buckets: Sequence[Bucket]
    wire: torch.dtype = torch.float32
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    link: EmulatedLink | None = None
    # Each chunk is multiplied by it before its all-reduce: a loop whose loss is its local batch's mean weights
    # it by its share of the global batch here (hetero-ray's own loop weights the loss instead).
    scale: float = 1.0
    chunks: list[_Chunk] = field(init=False, default_factory=list)
    _next: int = field(init=False, default=0)  # first chunk not launched
    _armed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes: must be >= 1 (got {self.bucket_bytes})")
        for bucket in self.buckets:
            current: list[torch.nn.Parameter] = []
            # Frozen parameters have no gradient to sum.
            for p in reversed([p for p in bucket.params if p.requires_grad]):
                same_dtype = not current or current[0].dtype == p.dtype
                if current and (not same_dtype or _nbytes(current) + _nbytes([p]) > self.bucket_bytes):
                    self._add_chunk(bucket, current)
                    current = []
                current.append(p)
            if current:
                self._add_chunk(bucket, current)
        for c in self.chunks:
            for p in c.params:
                p.register_post_accumulate_grad_hook(functools.partial(self._filled, c))

    def _add_chunk(self, bucket: Bucket, params: list[torch.nn.Parameter]) -> None:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views, offset = {}, 0
        for p in params:
            p.grad = views[p] = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.chunks.append(_Chunk(group=bucket.group, size=bucket.size, params=params, flat=flat, views=views))

    def arm(self, passes: int = 1) -> None:
        """The next ``passes`` backward passes end the step (a pipeline stage's micro-batches run inside its
        schedule): launch each chunk once they have filled it."""
        self._armed = True
        for c in self.chunks:
            c.pending = passes * len(c.params)

    def _filled(self, chunk: _Chunk, param: torch.nn.Parameter) -> None:
        view = chunk.views[param]
        if param.grad.data_ptr() != view.data_ptr():
            # zero_grad(set_to_none=True) dropped the view and the backward made a new gradient: it holds all
            # that accumulated since, so it goes back into the chunk (DDP does the same with its bucket views).
            param.grad = view.copy_(param.grad)
        if not self._armed:
            return
        chunk.pending -= 1
        while self._next < len(self.chunks) and self.chunks[self._next].pending == 0:
            self._launch(self.chunks[self._next])

    def _launch(self, chunk: _Chunk) -> None:
        self._next += 1
        chunk.launched_at = time.perf_counter()
        if self.scale != 1.0:
            chunk.flat.mul_(self.scale)
        if chunk.size == 1:
            return  # a layer one rank holds alone: nothing to sum
        if self.wire == chunk.flat.dtype:
            chunk.work = dist.all_reduce(chunk.flat, group=chunk.group, async_op=True)
        else:
            chunk.wire = chunk.flat.to(self.wire)
            chunk.work = dist.all_reduce(chunk.wire, group=chunk.group, async_op=True)

    def finish(self) -> tuple[bool, list[Launch]]:
        """Launch the chunks the backward did not, wait for all; whether every summed gradient is finite, and
        each summed chunk's launch."""
        waiting = time.perf_counter()
        while self._next < len(self.chunks):
            self._launch(self.chunks[self._next])
        finite, launches = True, []
        for c in self.chunks:
            if c.work is not None:
                c.work.wait()
                if c.wire is not None:
                    c.flat.copy_(c.wire)
                size = c.wire.element_size() if c.wire is not None else c.flat.element_size()
                sent = ring_allreduce_bytes(size * c.flat.numel(), c.size)
                launches.append(Launch(c.launched_at, sent, 2 * (c.size - 1)))
            finite = finite and bool(torch.isfinite(c.flat).all())
            c.work, c.wire, c.launched_at = None, None, None
        self._next, self._armed = 0, False
        if self.link is not None and launches:
            start = (lambda x: x.at) if self.link.overlapped else (lambda x: waiting)
            delivered = [self.link.send(start(x), x.bytes_sent, x.messages) for x in launches]
            self.link.hold(delivered[-1], waiting)
        return finite, launches

    def zero(self) -> None:
        """Zero every gradient in place (the views stay: ``optimizer.zero_grad`` would drop them)."""
        for c in self.chunks:
            c.flat.zero_()


def _nbytes(params: Sequence[torch.nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
