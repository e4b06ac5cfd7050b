"""1-bit compressed all-reduce on gloo, in plain torch, with DeepSpeed's backend contract.

DeepSpeed's ``OnebitAdam`` / ``ZeroOneAdam`` talk to their communication backend through
one method, ``compressed_allreduce(buffer_m, worker_error, server_error, local_rank)``,
and read one attribute, ``size``. DeepSpeed's own backends need cupy + NCCL (``nccl``),
MPI (``mpi``), Ascend (``hccl``) or a compiled packbits op (``compressed``), so none runs
on CPU/gloo; :class:`GlooCompressedBackend` is the same algorithm with torch ops only.

The algorithm (error-compensated 1-bit compression, https://arxiv.org/abs/2102.02888),
for W ranks and a buffer padded to ``worker_error.numel()`` elements, cut into segments
that each carry their own scale::

    worker:  x += worker_error;  per segment k: s_k = ||x_k|| / sqrt(len_k);  bits = x >= 0
             worker_error = x - s_seg * (+1 | -1);  pack bits 8 per byte
             all_to_all: rank r receives chunk r of every rank's bits, with the scales of the
             segments that chunk r meets
    server:  m = sum_i (+-1)_i * (s_i,seg * (1/W)) over the W received chunks  (an AVERAGE)
             m += server_error;  per piece p (a segment cut by the chunk): t_p = ||m_p|| / sqrt(len_p)
             server_error = m - t_piece * (+-1)
             all_gather every rank's packed server bits with its piece scales
    result:  buffer_m[:] = concatenation over ranks of t_r,piece * (+-1)_r   (same on every rank)

Segments: by default the whole padded buffer is one segment -- DeepSpeed's algorithm, one
scale per call, as its optimizers call it tensor by tensor. :meth:`GlooCompressedBackend.set_segments`
declares the tensors of a fused buffer (hetero-ray flattens the model into one parameter,
so DeepSpeed makes one call per step): each tensor is a segment, and the padding its own
(it stays exactly zero: zero input, zero error, zero scale). One call is then one
``all_to_all_single`` and one ``all_gather`` of bytes (signs and fp32 scales side by side),
whatever the number of tensors.

Averaging, not summing, matters for heterogeneous data parallelism: a rank with local
batch b_i of a global batch B must contribute W * b_i / B times its mean gradient
for the average to be the full-batch gradient.

Bytes are counted as this rank puts them on the wire (``last_bytes_sent``, cumulative
``bytes_sent``): per phase one packed chunk of ``padded / (8 W)`` bytes plus the chunk's
scales (4 bytes each, as many as the chunk meeting the most segments) to each of the W-1
other ranks -- the same per-rank basis as an fp32 ring all-reduce's ``2 (W-1) / W * numel * 4``,
about 32 times more. Each collective is counted as W-1 message rounds (``last_rounds``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hetero_ray.plan.cost import padded_numel

# Element 8k + j is bit 7 - j of byte k: most significant first, numpy's default bit order.
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor whose last dimension is a multiple of 8 into uint8, 8 bits per byte."""
    grouped = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.uint8)
    return (grouped * _BIT_WEIGHTS).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_signs`, as float ±1 (a set bit is +1)."""
    bits = packed.unsqueeze(-1).bitwise_and(_BIT_WEIGHTS).ne(0)
    return bits.reshape(*packed.shape[:-1], -1).float().mul_(2.0).sub_(1.0)


@dataclass(frozen=True)
class SegmentLayout:
    """Where a padded buffer's segments lie, and the pieces of them each server chunk holds.

    ``lengths``: the segments' lengths, in order, covering the padded buffer. ``pieces[r]``:
    the lengths of the pieces chunk r is cut into (segment boundaries inside it), and
    ``piece_segments[r]`` the segment of each. ``width``: the most pieces any chunk has,
    the number of scale slots every chunk's message carries.
    """

    lengths: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    piece_segments: tuple[tuple[int, ...], ...]
    width: int


def segment_layout(segments: Sequence[int], padded: int, world: int) -> SegmentLayout:
    """The layout of ``segments`` (non-empty lengths summing to at most ``padded``) plus the padding, in W chunks."""
    lengths = tuple(n for n in segments if n > 0) + ((padded - sum(segments),) if padded > sum(segments) else ())
    chunk = padded // world
    starts = [0, *itertools.accumulate(lengths)]
    pieces, piece_segments = [], []
    for r in range(world):
        lo, hi = r * chunk, (r + 1) * chunk
        meets = [k for k in range(len(lengths)) if starts[k] < hi and starts[k + 1] > lo]
        pieces.append(tuple(min(hi, starts[k + 1]) - max(lo, starts[k]) for k in meets))
        piece_segments.append(tuple(meets))
    return SegmentLayout(lengths, tuple(pieces), tuple(piece_segments), max(len(p) for p in pieces))


def fused_allreduce_bytes(numels: Sequence[int], world: int) -> int:
    """Bytes a rank sends in one :class:`GlooCompressedBackend` call over tensors of ``numels`` fused into one buffer.

    Two phases, each sending W-1 messages of one packed chunk (``padded / (8 W)`` bytes) and
    the scale slots every chunk carries (4 bytes x the most segments any chunk meets, the
    padding counted as one); with one tensor it is DeepSpeed's ``2 (W-1) (padded / (8 W) + 4)``.
    """
    padded = padded_numel(sum(numels), world)
    return 2 * (world - 1) * (padded // (8 * world) + 4 * segment_layout(numels, padded, world).width)


def _compress(x: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-bit compression of a flat fp32 tensor, segment by segment: (scales, sign bits, compression error).

    Zero (and NaN) count as +1, as in DeepSpeed, so every element carries a sign.
    """
    scales = torch.stack([torch.linalg.norm(part) / math.sqrt(part.numel()) for part in x.split(list(lengths))])
    bits = torch.logical_not(x < 0)
    per_element = scales.repeat_interleave(torch.tensor(lengths), output_size=x.numel())
    error = x - per_element * bits.float().mul_(2.0).sub_(1.0)
    return scales, bits, error


def _as_bytes(scales: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 scales in ``width`` slots (zeros after the last), as 4 * width raw bytes."""
    slots = torch.zeros(width, dtype=torch.float32)
    slots[: scales.numel()] = scales
    return slots.view(torch.uint8)


def _from_bytes(raw: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_as_bytes` for the last dimension: raw bytes back to fp32 slots."""
    return raw.clone().view(torch.float32)  # a copy starts at offset 0, where a float view is allowed


class GlooCompressedBackend:
    """DeepSpeed's 1-bit ``compressed_allreduce`` contract on a gloo process group, CPU tensors.

    Attributes read by DeepSpeed's optimizers and kept for parity with its backends:
    ``size`` and ``rank`` (in ``world_group``) and ``world_group``. Counters: ``calls``,
    ``last_bytes_sent``, cumulative ``bytes_sent``, ``last_rounds`` and cumulative ``rounds``.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        """Communicate within ``group`` (the data-parallel group; ``None`` = the default group)."""
        if not dist.is_initialized():
            raise RuntimeError("GlooCompressedBackend needs torch.distributed initialised (gloo) first")
        self.world_group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.segments: tuple[int, ...] | None = None
        self._layouts: dict[tuple[int, int], SegmentLayout] = {}
        self.calls = 0
        self.last_bytes_sent = 0
        self.bytes_sent = 0
        self.last_rounds = 0
        self.rounds = 0

    @classmethod
    def from_mpu(cls, mpu: object | None = None) -> GlooCompressedBackend:
        """Build the backend the way DeepSpeed's optimizers build theirs: ``CompressedBackend(engine.mpu)``."""
        return cls(None if mpu is None else mpu.get_data_parallel_group())

    def set_segments(self, numels: Sequence[int]) -> None:
        """From now on every buffer is the concatenation of tensors of ``numels`` elements, each with its own scale."""
        self.segments = tuple(int(n) for n in numels)
        self._layouts.clear()

    def _layout(self, numel: int, padded: int) -> SegmentLayout:
        if (numel, padded) not in self._layouts:
            if self.segments is not None and sum(self.segments) != numel:
                raise ValueError(
                    f"compressed_allreduce: buffer of {numel} elements, but the declared segments "
                    f"sum to {sum(self.segments)}; pass buffers of the fused tensors only"
                )
            segments = self.segments if self.segments is not None else (padded,)
            self._layouts[numel, padded] = segment_layout(segments, padded, self.size)
        return self._layouts[numel, padded]

    def compressed_allreduce(
        self,
        buffer_m: torch.Tensor,
        worker_error: torch.Tensor,
        server_error: torch.Tensor,
        local_rank: int = 0,
    ) -> torch.Tensor:
        """Average ``buffer_m`` over the group with 1-bit compression; write the result into it and return it.

        ``worker_error`` (``padded_numel(buffer_m.numel(), size)`` elements, flat) and
        ``server_error`` (``worker_error.numel() // size``) persist across calls and are
        updated in place; ``buffer_m`` may have any shape and is zero-padded here to the
        worker-error size, as DeepSpeed's backends do. ``local_rank`` is part of DeepSpeed's
        contract (it picks a CUDA device there) and unused on CPU.
        """
        numel = buffer_m.numel()
        if numel == 0:
            # An empty parameter has nothing to compress; stale errors would be meaningless.
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        self._check_sizes(numel, worker_error, server_error)
        padded = worker_error.numel()
        chunk = padded // self.size
        layout = self._layout(numel, padded)

        x = torch.zeros(padded, dtype=torch.float32)
        x[:numel] = buffer_m.reshape(-1)
        x += worker_error
        worker_scales, worker_bits, new_worker_error = _compress(x, layout.lengths)
        worker_error.copy_(new_worker_error)

        # Phase 1: rank r receives chunk r of everyone's signs, with the scales of the segments it meets.
        signs = pack_signs(worker_bits.reshape(self.size, chunk))  # (W, chunk/8)
        scales = torch.stack([_as_bytes(worker_scales[list(s)], layout.width) for s in layout.piece_segments])
        sent = torch.cat([signs, scales], dim=1)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.world_group)

        # Server: average of the decompressed chunks, compressed again piece by piece with its own error feedback.
        mine = layout.pieces[self.rank]
        lengths = torch.tensor(mine)
        weights = _from_bytes(received[:, chunk // 8 :])[:, : len(mine)].mul(1.0 / self.size)  # (W, pieces)
        per_element = weights.repeat_interleave(lengths, dim=1, output_size=chunk)  # (W, chunk)
        server_m = unpack_signs(received[:, : chunk // 8]).mul_(per_element).sum(dim=0)  # (chunk,)
        server_m += server_error
        server_scales, server_bits, new_server_error = _compress(server_m, mine)
        server_error.copy_(new_server_error)

        # Phase 2: every rank gets every chunk's server signs and piece scales.
        message = torch.cat([pack_signs(server_bits), _as_bytes(server_scales, layout.width)])
        gathered = [torch.empty_like(message) for _ in range(self.size)]
        dist.all_gather(gathered, message, group=self.world_group)

        result = []
        for r, raw in enumerate(gathered):
            pieces = layout.pieces[r]
            scale = _from_bytes(raw[chunk // 8 :])[: len(pieces)].repeat_interleave(
                torch.tensor(pieces), output_size=chunk
            )
            result.append(unpack_signs(raw[: chunk // 8]).mul_(scale))
        buffer_m.copy_(torch.cat(result)[:numel].reshape(buffer_m.shape))

        # Everything sent reaches the W-1 other ranks once; the own chunk / own copy stays here.
        others = self.size - 1
        self.last_bytes_sent = others * sent[0].nbytes + others * message.nbytes
        self.last_rounds = 2 * others
        self.bytes_sent += self.last_bytes_sent
        self.rounds += self.last_rounds
        self.calls += 1
        return buffer_m

    def _check_sizes(self, numel: int, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        """Error buffers sized as DeepSpeed's optimizers size them, or a one-line ValueError."""
        padded = worker_error.numel()
        if padded < numel or padded % (8 * self.size) or server_error.numel() * self.size != padded:
            raise ValueError(
                f"compressed_allreduce: buffer of {numel} elements got worker_error of {padded} and "
                f"server_error of {server_error.numel()}; for world size {self.size} they must be "
                f"{padded_numel(numel, self.size)} and {padded_numel(numel, self.size) // self.size}"
            )
