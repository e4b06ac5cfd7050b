"""1-bit compressed all-reduce on gloo, in plain torch, with DeepSpeed's backend contract.

DeepSpeed's ``OnebitAdam`` / ``ZeroOneAdam`` talk to their communication backend through
one method, ``compressed_allreduce(buffer_m, worker_error, server_error, local_rank)``,
and read one attribute, ``size``. DeepSpeed's own backends need cupy + NCCL (``nccl``),
MPI (``mpi``), Ascend (``hccl``) or a compiled packbits op (``compressed``), so none runs
on CPU/gloo; :class:`GlooCompressedBackend` is the same algorithm with torch ops only.

The algorithm (error-compensated 1-bit compression, https://arxiv.org/abs/2102.02888),
for W ranks and a buffer padded to ``worker_error.numel()`` elements::

    worker:  x += worker_error;  s = ||x|| / sqrt(numel);  bits = x >= 0
             worker_error = x - s * (+1 | -1);  pack bits 8 per byte
             all_to_all: rank r receives chunk r of every rank's bits; all_gather the s
    server:  m = sum_i (+-1)_i * (s_i * (1/W)) over the W received chunks  (an AVERAGE)
             m += server_error;  t = ||m|| / sqrt(chunk);  server_error = m - t * (+-1)
             all_gather every rank's packed server bits and its t
    result:  buffer_m[:] = concatenation over ranks of t_r * (+-1)_r   (same on every rank)

Averaging, not summing, matters for heterogeneous data parallelism: a rank with local
batch b_i of a global batch B must scale its loss by W * b_i / B (not b_i / B) for the
average to be the full-batch gradient.

Bytes are counted as this rank puts them on the wire (``last_bytes_sent``, cumulative
``bytes_sent``): per phase one packed chunk of ``padded / (8 W)`` bytes and one fp32 scale
to each of the W-1 other ranks, i.e. ``2 (W-1) (padded / (8 W) + 4)`` per call -- the same
per-rank basis as an fp32 ring all-reduce's ``2 (W-1) / W * numel * 4``, about 32 times more.
"""

from __future__ import annotations

import math

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


def _compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-bit compression of a flat fp32 tensor: (1-element scale, sign bits, compression error).

    Zero (and NaN) count as +1, as in DeepSpeed, so every element carries a sign.
    """
    # A 1-element scale, not 0-dim: gloo's all_gather rejects 0-dim inputs ("invalid tensor size").
    scale = (torch.linalg.norm(x) / math.sqrt(x.numel())).reshape(1)
    bits = torch.logical_not(x < 0)
    error = x - scale * bits.float().mul_(2.0).sub_(1.0)
    return scale, bits, error


class GlooCompressedBackend:
    """DeepSpeed's 1-bit ``compressed_allreduce`` contract on a gloo process group, CPU tensors.

    Attributes read by DeepSpeed's optimizers and kept for parity with its backends:
    ``size`` and ``rank`` (in ``world_group``) and ``world_group``. Counters: ``calls``,
    ``last_bytes_sent`` and cumulative ``bytes_sent``.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        """Communicate within ``group`` (the data-parallel group; ``None`` = the default group)."""
        if not dist.is_initialized():
            raise RuntimeError("GlooCompressedBackend needs torch.distributed initialised (gloo) first")
        self.world_group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.calls = 0
        self.last_bytes_sent = 0
        self.bytes_sent = 0

    @classmethod
    def from_mpu(cls, mpu: object | None = None) -> GlooCompressedBackend:
        """Build the backend the way DeepSpeed's optimizers build theirs: ``CompressedBackend(engine.mpu)``."""
        return cls(None if mpu is None else mpu.get_data_parallel_group())

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

        x = torch.zeros(padded, dtype=torch.float32)
        x[:numel] = buffer_m.reshape(-1)
        x += worker_error
        worker_scale, worker_bits, new_worker_error = _compress(x)
        worker_error.copy_(new_worker_error)

        # Phase 1: rank r receives chunk r of everyone's signs, and everyone's scale.
        sent_signs = pack_signs(worker_bits.reshape(self.size, chunk))  # (W, chunk/8)
        received_signs = torch.empty_like(sent_signs)
        dist.all_to_all_single(received_signs, sent_signs, group=self.world_group)
        worker_scales = [torch.empty(1) for _ in range(self.size)]
        dist.all_gather(worker_scales, worker_scale, group=self.world_group)

        # Server: average of the decompressed chunks, compressed again with its own error feedback.
        weights = torch.stack(worker_scales).mul_(1.0 / self.size)  # (W, 1)
        server_m = unpack_signs(received_signs).mul_(weights).sum(dim=0)  # (chunk,)
        server_m += server_error
        server_scale, server_bits, new_server_error = _compress(server_m)
        server_error.copy_(new_server_error)

        # Phase 2: every rank gets every chunk's server signs and scale.
        server_signs = pack_signs(server_bits)  # (chunk/8,)
        all_server_signs = [torch.empty_like(server_signs) for _ in range(self.size)]
        dist.all_gather(all_server_signs, server_signs, group=self.world_group)
        server_scales = [torch.empty(1) for _ in range(self.size)]
        dist.all_gather(server_scales, server_scale, group=self.world_group)

        result = unpack_signs(torch.stack(all_server_signs)).mul_(torch.stack(server_scales)).reshape(-1)
        buffer_m.copy_(result[:numel].reshape(buffer_m.shape))

        # Everything sent reaches the W-1 other ranks once; the own chunk / own copy stays here.
        others = self.size - 1
        self.last_bytes_sent = (
            others * sent_signs[0].nbytes
            + others * worker_scale.nbytes
            + others * server_signs.nbytes
            + others * server_scale.nbytes
        )
        self.bytes_sent += self.last_bytes_sent
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
