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

Under ZeRO-2 and 3 (``reduce_to_owners``) every backward pass, not only the last, sends each chunk as it
fills: one SUM reduce per slice to the slice's owner (``train/zero.py``), and the owner adds its piece into
``own``, its summed gradient, which outlives the passes. Between passes no rank holds a chunk: its flat
gradient exists from the pass's first gradient into it until its reduces complete, then its storage is freed
(autograd makes each parameter's gradient anew, which the hook copies into the regrown chunk and drops). A
launch first waits for every reduce but the previous chunk's, so a rank holds at most two chunks on the wire
besides those still filling: about two layers' gradients, as ``plan/data_parallel.py::zero_bytes`` counts.
gloo has no reduce-scatter, and uneven ownership would need ``all_to_all_single`` with uneven splits plus a
local sum of ``world`` received copies (``world`` times the piece in memory); a reduce per slice sends each
byte towards its owner once and is priced as the ring reduce-scatter it equals.

On an emulated device with a named link (``EmulatedLink``), ``finish`` holds the chunks until the link
would have delivered them, one after another, each from its launch: before the optimizer can apply them.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hetero_ray.cluster.emulated_device import sleep_until
from hetero_ray.plan.cost import link_seconds, ring_allreduce_bytes

if TYPE_CHECKING:
    from hetero_ray.train.zero import Shards

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
    works: list[dist.Work] = field(default_factory=list)
    launched_at: float | None = None
    pieces: tuple[tuple[int, int, int], ...] = ()  # ZeRO-2/3: (owner, lo, hi) of each slice
    mine: tuple[int, int] | None = None  # ZeRO-2/3: this rank's slice
    own: torch.Tensor | None = None  # ZeRO-2/3: this rank's slice of the summed gradient, kept across passes


@dataclass(frozen=True)
class Launch:
    """One chunk's all-reduce: when it started (``time.perf_counter``), bytes this rank sent, message rounds."""

    at: float
    bytes_sent: float
    messages: int


@dataclass(eq=False)
class GradBuckets:
    """This rank's gradient chunks, their hooks and their in-flight reductions (see the module docstring)."""

    buckets: Sequence[Bucket]
    wire: torch.dtype = torch.float32
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    link: EmulatedLink | None = None
    # Each chunk is multiplied by it before its reduction: a loop whose loss is its local batch's mean weights
    # it by its share of the global batch here (hetero-ray's own loop weights the loss instead); under ZeRO-2/3
    # an fp16 rank unscales its chunks here, which leave before its step could unscale them.
    scale: float = 1.0
    # Called with a chunk's index as it goes on the wire, its gradients all in: ZeRO-3 frees its parameters.
    on_launch: Callable[[int], None] | None = None
    chunks: list[_Chunk] = field(init=False, default_factory=list)
    # What went on the wire since the last ``finish``, in order; ZeRO-3's gathers are recorded here too.
    launches: list[Launch] = field(init=False, default_factory=list)
    owned: bool = field(init=False, default=False)  # reducing to owners (``reduce_to_owners``)
    _next: int = field(init=False, default=0)  # first chunk not launched
    _armed: bool = field(init=False, default=False)
    _in_flight: list[_Chunk] = field(init=False, default_factory=list)

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

    def reduce_to_owners(self, shards: Shards, rank: int) -> None:
        """ZeRO-2/3 from now on: every backward pass reduces each chunk's slices to their owners (``shards`` of
        the chunks' flattened order) as it fills, and ``end_pass`` ends a pass; this rank's summed slices are
        the chunks' ``own``. Every chunk is freed until a pass fills it."""
        self.owned, start = True, 0
        for c in self.chunks:
            c.pieces = tuple(shards.pieces(start, c.flat.numel()))
            c.mine = next(((lo, hi) for r, lo, hi in c.pieces if r == rank), None)
            c.own = torch.zeros(c.mine[1] - c.mine[0], dtype=c.flat.dtype, device=c.flat.device) if c.mine else None
            c.pending = len(c.params)
            for p in c.params:
                p.grad = None
            free_storage(c.flat)
            start += c.flat.numel()

    def arm(self, passes: int = 1) -> None:
        """The next ``passes`` backward passes end the step (a pipeline stage's micro-batches run inside its
        schedule): launch each chunk once they have filled it. Reducing to owners, every pass launches."""
        if self.owned:
            return
        self._armed = True
        for c in self.chunks:
            c.pending = passes * len(c.params)

    def _filled(self, chunk: _Chunk, param: torch.nn.Parameter) -> None:
        view = chunk.views[param]
        if self.owned:
            _grow(chunk.flat)
            view.copy_(param.grad)
            param.grad = None
        elif param.grad.data_ptr() != view.data_ptr():
            # zero_grad(set_to_none=True) dropped the view and the backward made a new gradient: it holds all
            # that accumulated since, so it goes back into the chunk (DDP does the same with its bucket views).
            param.grad = view.copy_(param.grad)
        if not (self._armed or self.owned):
            return
        chunk.pending -= 1
        while self._next < len(self.chunks) and self.chunks[self._next].pending == 0:
            self._launch(self.chunks[self._next])

    def _launch(self, chunk: _Chunk) -> None:
        index = self._next
        self._next += 1
        if self.owned:
            _grow(chunk.flat)  # a chunk the pass left empty sends zeros: every rank makes the same reduces
            while len(self._in_flight) > 1:
                self._settle(self._in_flight.pop(0))
            self._in_flight.append(chunk)
        chunk.launched_at = time.perf_counter()
        if self.on_launch is not None:
            self.on_launch(index)
        if self.scale != 1.0:
            chunk.flat.mul_(self.scale)
        if chunk.size == 1:
            return  # a layer one rank holds alone: nothing to sum
        if self.wire != chunk.flat.dtype:
            chunk.wire = chunk.flat.to(self.wire)
        sent = chunk.flat if chunk.wire is None else chunk.wire
        if self.owned:
            chunk.works = [
                dist.reduce(sent[lo:hi], dst=r, group=chunk.group, async_op=True) for r, lo, hi in chunk.pieces
            ]
        else:
            chunk.works = [dist.all_reduce(sent, group=chunk.group, async_op=True)]

    def _settle(self, chunk: _Chunk) -> None:
        """Wait for a launched chunk's reduction and put the sum in place: back into the chunk, or this rank's
        slice into ``own`` and the chunk freed."""
        for work in chunk.works:
            work.wait()
        summed = chunk.flat if chunk.wire is None else chunk.wire
        if self.owned:
            if chunk.mine is not None:
                chunk.own += summed[chunk.mine[0] : chunk.mine[1]]
            free_storage(chunk.flat)
        elif chunk.wire is not None:
            chunk.flat.copy_(chunk.wire)
        if chunk.works:
            ring = ring_allreduce_bytes(summed.element_size() * summed.numel(), chunk.size)
            # A reduce to the owners is a ring reduce-scatter: the first half of a ring all-reduce.
            sent, rounds = (ring / 2, chunk.size - 1) if self.owned else (ring, 2 * (chunk.size - 1))
            self.launches.append(Launch(chunk.launched_at, sent, rounds))
        chunk.works, chunk.wire, chunk.launched_at = [], None, None

    def end_pass(self) -> None:
        """After each backward pass when reducing to owners (else nothing): reduce the chunks the pass did not
        fill, wait for every reduce, and free the chunks."""
        if not self.owned:
            return
        while self._next < len(self.chunks):
            self._launch(self.chunks[self._next])
        while self._in_flight:
            self._settle(self._in_flight.pop(0))
        self._next = 0
        for c in self.chunks:
            c.pending = len(c.params)

    def finish(self) -> tuple[bool, list[Launch]]:
        """Launch the chunks the backward did not, wait for all; whether every summed gradient this rank holds is
        finite, and what went on the wire since the last ``finish``."""
        waiting = time.perf_counter()
        if not self.owned:
            while self._next < len(self.chunks):
                self._launch(self.chunks[self._next])
            for c in self.chunks:
                self._settle(c)
            self._next, self._armed = 0, False
        finite = all(bool(torch.isfinite(g).all()) for g, _ in self.summed())
        launches = list(self.launches)
        self.launches.clear()  # in place: ZeRO-3's gathers record into this same list
        if self.link is not None and launches:
            start = (lambda x: x.at) if self.link.overlapped else (lambda x: waiting)
            delivered = [self.link.send(start(x), x.bytes_sent, x.messages) for x in launches]
            self.link.hold(delivered[-1], waiting)
        return finite, launches

    def summed(self) -> list[tuple[torch.Tensor, int]]:
        """The summed gradients this rank holds after ``finish``, each with the number of ranks holding it alike:
        every chunk, summed over its group; reducing to owners, this rank's slices alone."""
        if self.owned:
            return [(c.own, 1) for c in self.chunks if c.own is not None]
        return [(c.flat, c.size) for c in self.chunks]

    def zero(self) -> None:
        """Zero every summed gradient in place (the views stay: ``optimizer.zero_grad`` would drop them)."""
        for g, _ in self.summed():
            g.zero_()


def _grow(flat: torch.Tensor) -> None:
    """Give a freed chunk its storage back, zeroed (its views and parameters see it again)."""
    storage = flat.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(flat.numel() * flat.element_size())
        flat.zero_()


def free_storage(flat: torch.Tensor) -> None:
    """Free a tensor's storage; its views keep their places in it, for ``_grow`` or a gather to refill."""
    flat.untyped_storage().resize_(0)


def _nbytes(params: Sequence[torch.nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
