"""The ``mpu`` DeepSpeed takes to run its engine and 1-bit optimizers over a data-parallel group only.

What DeepSpeed 0.19.6 reads from ``deepspeed.initialize(mpu=...)`` on this path (no ZeRO,
no DeepSpeed pipeline engine, no sequence or tensor parallelism):

- ``get_data_parallel_group`` / ``_world_size`` / ``_rank``: the engine's gradient
  all-reduce and its average (``_reduce_non_expert_gradients`` through
  ``groups._get_sequence_data_parallel_group``), the parameter broadcast from the
  group's first rank at start (``_broadcast_model``), and the 1-bit backends
  (``CompressedBackend(mpu)`` / ``NcclBackend(mpu)`` take ``get_data_parallel_group()``);
- ``get_model_parallel_world_size`` / ``_rank`` / ``_group``: 1, 0 and a group of this rank
  alone -- each rank's module is, for DeepSpeed, a whole replica over its data-parallel
  group (the pipeline is hetero-ray's). DeepSpeed's gradient clipping (on by default, at
  norm 1.0) sums squared norms over the model-parallel group, so each stage clips its own
  part by its own part's norm: never more than whole-model clipping would.

The engine stores the object in ``deepspeed.utils.groups.mpu``, a process-wide global:
one engine per process, as in hetero-ray's workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class DataParallelGroup:
    """An ``mpu`` whose data-parallel group is ``group`` and whose model-parallel group is ``alone`` (this rank)."""

    group: dist.ProcessGroup
    alone: dist.ProcessGroup

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.alone


def data_parallel_mpu(group: dist.ProcessGroup) -> DataParallelGroup:
    """The ``mpu`` for ``group``; every rank must call it (it creates one single-rank group per rank, collectively)."""
    rank = dist.get_rank()
    singletons = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return DataParallelGroup(group, singletons[rank])
